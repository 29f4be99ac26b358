"""Checkpoint loading, Orbax round trips, the inspect / convert CLIs, and one named error per bad input."""

import json
import shutil

import jax
import numpy as np
import pytest

from conftest import hf_logits, rel_err, rewrite_safetensors
from checkpoints_tools import convert, inspect as ckpt_inspect
from checkpoints_tools.make_tiny import make_tiny
from diffspec_jax import forward, load_target
from diffspec_jax.errors import CheckpointError, ConfigError, UnsupportedModelError


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_orbax_round_trip_is_bit_exact(tiny_dirs, tmp_path, dtype):
    src = load_target(tiny_dirs["qwen3"], dtype=dtype)
    assert convert.main(["--hf", str(tiny_dirs["qwen3"]), "--out", str(tmp_path / "ob"), "--dtype", dtype]) == 0
    back = load_target(tmp_path / "ob", dtype=dtype)
    assert back.config == src.config.replace(dtype=dtype)
    leaves_equal(src.params, back.params)


def test_orbax_to_hf_export_loads_in_transformers(tiny_dirs, tmp_path, hf_models):
    ids = np.random.default_rng(0).integers(0, 256, (1, 40))
    convert.main(["--hf", str(tiny_dirs["llama"]), "--out", str(tmp_path / "ob"), "--dtype", "float32"])
    assert convert.main(["--orbax", str(tmp_path / "ob"), "--out", str(tmp_path / "hf")]) == 0
    import torch
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert rel_err(hf_logits(model, ids), hf_logits(hf_models["llama"], ids)) < 1e-6


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_numpy_backend_checkpoint_is_complete_for_transformers(tmp_path, arch):
    """Our own writer (used without torch) produces exactly the tensors transformers expects."""
    import torch
    import transformers

    d = make_tiny(tmp_path / arch, arch, backend="numpy", seed=3)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = np.random.default_rng(1).integers(0, 256, (2, 33))
    assert rel_err(forward(load_target(d, dtype="float32"), ids), hf_logits(model, ids)) <= 1e-4


def test_sharded_index_written_by_transformers_loads(tmp_path):
    d = make_tiny(tmp_path / "sharded", "llama", backend="transformers", seed=5, max_shard_bytes=200_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (d / "model.safetensors").exists()
    single = make_tiny(tmp_path / "single", "llama", backend="transformers", seed=5)
    leaves_equal(load_target(d, "float32").params, load_target(single, "float32").params)


# ------------------------------------------------------------------------------------------ bad inputs
@pytest.fixture
def broken(tmp_path, tiny_dirs):
    """A fresh writable copy of the tiny Llama to damage."""
    dst = tmp_path / "copy"
    shutil.copytree(tiny_dirs["llama"], dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_target(tmp_path / "nope")


def test_no_weight_files_and_bin_hint(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_target(broken)
    (broken / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="--bin-to-safetensors"):
        load_target(broken)


def test_index_naming_a_missing_shard(broken):
    (broken / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="names shard model-00002-of-00002.safetensors, which does not exist"):
        load_target(broken)


def test_missing_tensor(broken):
    rewrite_safetensors(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_target(broken)


def test_shape_not_matching_config(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\], "
                                              r"but config.json implies \[96, 64\]"):
        load_target(broken)


def test_unexpected_tensor_such_as_a_bias(broken):
    rewrite_safetensors(broken, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    with pytest.raises(CheckpointError, match="unexpected tensors .*q_proj.bias"):
        load_target(broken)


def test_integer_weights_are_refused(broken):
    rewrite_safetensors(broken, lambda t: t.update(
        {"model.norm.weight": np.ones(64, np.int8)}))
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype I8; quantized or integer"):
        load_target(broken)


def test_unsupported_architecture_in_checkpoint(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="DeepseekV3ForCausalLM"):
        load_target(broken)


def test_unknown_dtype(tiny_dirs):
    with pytest.raises(ConfigError, match="dtype 'float8' is not supported"):
        load_target(tiny_dirs["llama"], dtype="float8")


def test_orbax_tree_not_matching_config(tiny_dirs, tmp_path):
    convert.main(["--hf", str(tiny_dirs["llama"]), "--out", str(tmp_path / "ob"), "--dtype", "float32"])
    cfg = json.loads((tmp_path / "ob" / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "ob" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="params tree does not match config.json"):
        load_target(tmp_path / "ob")


# ------------------------------------------------------------------------------------------ inspect CLI
def test_inspect_lists_tensors_counts_parameters_and_checks_hashes(tiny_dirs, capsys):
    d = tiny_dirs["qwen3"]
    info = ckpt_inspect.describe(d)
    model = load_target(d, "float32")
    assert info["num_parameters"] == model.config.num_parameters
    assert info["num_parameters"] == sum(x.size for x in jax.tree_util.tree_leaves(model.params))
    names = {t["name"] for t in info["tensors"]}
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names  # tied
    import hashlib

    good = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    assert ckpt_inspect.main([str(d), "--expect-sha256", f"model.safetensors={good}"]) == 0
    assert "1 file(s) match" in capsys.readouterr().out
    assert ckpt_inspect.main([str(d), "--json", "--expect-sha256", "model.safetensors=" + "0" * 64]) == 1
    out = json.loads(capsys.readouterr().out)
    assert "sha256 mismatch" in out["hash_check"]["problems"][0]
    assert ckpt_inspect.main([str(d), "--expect-sha256", "other.safetensors=ab"]) == 1
    assert "no such weight file" in capsys.readouterr().err
