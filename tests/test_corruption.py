"""Issue 26: damaged checkpoints never load silently. Weights holding NaN / inf / absurd values are refused by a
fused on-device check; files written by our tools carry a SHA-256 manifest that loading verifies; every
safetensors or Orbax read error is a CheckpointError naming the file. The sweeps flip bytes in and truncate every
file of a tiny Hugging Face and a tiny Orbax checkpoint."""

import json
import os
import shutil
import struct

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import rewrite_safetensors
from checkpoints_tools import convert, inspect as ckpt_inspect
from checkpoints_tools.make_tiny import make_tiny
from diffspec_jax import load_draft, load_target
from diffspec_jax.errors import CheckpointError, DiffspecError, IntegrityError
from diffspec_jax.outdir import MANIFEST
from diffspec_jax.target import MAX_ABS_WEIGHT, check_finite


#: DIFFSPEC_HYPOTHESIS_SCALE=20 runs 20x the examples (a deeper local search; CI keeps the default 1)
SCALE = int(os.environ.get("DIFFSPEC_HYPOTHESIS_SCALE", "1"))
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{"hf": a tiny HF checkpoint without manifest, "orbax": its Orbax conversion, "hf_manifest": the Orbax one
    exported back to HF (both with manifests)}."""
    root = tmp_path_factory.mktemp("corrupt")
    hf = make_tiny(root / "hf", "llama", seed=7)
    assert convert.main(["--hf", str(hf), "--out", str(root / "orbax"), "--dtype", "float32"]) == 0
    assert convert.main(["--orbax", str(root / "orbax"), "--out", str(root / "hf_manifest")]) == 0
    return {"hf": hf, "orbax": root / "orbax", "hf_manifest": root / "hf_manifest"}


def fresh(src, tmp_path, name="c"):
    dst = tmp_path / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------ values
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 3e7])
def test_weights_holding_nan_inf_or_absurd_values_are_refused(ckpts, tmp_path, value):
    d = fresh(ckpts["hf"], tmp_path)

    def poison(t):
        t["model.layers.2.mlp.down_proj.weight"][5, 7] = value

    rewrite_safetensors(d, poison)
    what = "NaN or infinite" if not np.isfinite(value) else f"magnitude 3e\\+07 > {MAX_ABS_WEIGHT:g}"
    with pytest.raises(IntegrityError, match=f"'model.layers.2.mlp.down_proj.weight' \\(params\\['layers'\\]\\[2\\]"
                                             f"\\['w_down'\\]\\) holds (NaN or infinite values|a value of {what})"):
        load_target(d, "float32")
    with pytest.raises(IntegrityError, match="verify=False"):
        load_target(d, "bfloat16")
    assert load_target(d, "float32", verify=False).config.num_hidden_layers == 4  # the check can be skipped


def test_every_bad_tensor_is_counted_and_the_check_is_one_fused_call(ckpts, tmp_path, monkeypatch):
    from diffspec_jax import target as tgt

    d = fresh(ckpts["hf"], tmp_path)

    def poison(t):
        for k in ("model.norm.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight"):
            t[k].flat[0] = np.nan

    rewrite_safetensors(d, poison)
    calls = []
    real = tgt._peak_magnitudes
    monkeypatch.setattr(tgt, "_peak_magnitudes", lambda leaves: calls.append(len(leaves)) or real(leaves))
    with pytest.raises(IntegrityError, match="3 tensors are bad"):
        load_target(d, "float32")
    assert calls == [39]  # one reduction over all floating leaves: embed, final norm, lm_head + 4 layers x 9
    params = {"a": jax.numpy.ones(3), "i": jax.numpy.arange(3), "b": {"c": jax.numpy.full((2,), MAX_ABS_WEIGHT)}}
    check_finite(params, "x")  # integers are skipped, the bound itself is allowed


def test_draft_holding_nan_is_refused(draft_dirs, targets, tmp_path):
    d = fresh(draft_dirs["llama"], tmp_path)

    def poison(t):
        t["fc.weight"][0, 0] = np.inf

    rewrite_safetensors(d, poison)
    with pytest.raises(IntegrityError, match="'fc.weight' \\(params\\['fc'\\]\\) holds NaN or infinite values"):
        load_draft(d, targets["llama"])
    assert load_draft(d, targets["llama"], verify=False).config.hidden_size == 64


# ------------------------------------------------------------------------------------------ manifests
def test_convert_writes_a_manifest_that_loading_and_inspect_verify(ckpts, tmp_path, capsys):
    for kind in ("orbax", "hf_manifest"):
        body = json.loads((ckpts[kind] / MANIFEST).read_text())
        assert body["format"] == "diffspec-manifest" and body["tool"] == "checkpoints_tools.convert"
        assert "config.json" in body["files"] and len(body["self_sha256"]) == 64
        assert ckpt_inspect.main([str(ckpts[kind]), "--verify"]) == 0
        assert "file(s) match diffspec_manifest.json" in capsys.readouterr().out
    assert ckpt_inspect.main([str(ckpts["hf"]), "--verify"]) == 1  # nothing to verify against
    assert "has no diffspec_manifest.json" in capsys.readouterr().err


def test_orbax_checkpoint_with_a_flipped_byte_is_refused(ckpts, tmp_path, capsys):
    d = fresh(ckpts["orbax"], tmp_path)
    data = max((p for p in (d / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # a low mantissa bit: the value barely changes, only the digest tells
    data.write_bytes(bytes(raw))
    rel = data.relative_to(d).as_posix()
    with pytest.raises(IntegrityError, match=f"{rel} has SHA-256 .* its manifest says"):
        load_target(d, "float32")
    assert ckpt_inspect.main([str(d), "--verify"]) == 1
    assert f"VERIFY FAILED: {d}: {rel} has SHA-256" in capsys.readouterr().err
    load_target(d, "float32", verify=False)  # skipping the check loads the (slightly wrong) values


def test_sharded_checkpoint_with_a_damaged_tensor_name(tmp_path, capsys):
    d = make_tiny(tmp_path / "sharded", "llama", seed=3, max_shard_bytes=150_000)
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1
    victim = next(s for s in shards if b"model.norm.weight" in s.read_bytes()[:20000])
    raw = victim.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].replace(b"model.norm.weight", b"model.norm.weighX")  # same length: a valid header
    victim.write_bytes(raw[:8] + header + raw[8 + n:])
    needle = f"maps tensors \\['model.norm.weight'\\] to shard {victim.name}, which does not contain them"
    with pytest.raises(CheckpointError, match=needle + ".*model.norm.weighX"):
        load_target(d)
    with pytest.raises(CheckpointError, match=needle):
        ckpt_inspect.describe(d)
    assert ckpt_inspect.main([str(d)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and victim.name in err


def test_damaged_index_and_shard_files(tmp_path):
    d = make_tiny(tmp_path / "sharded", "llama", seed=3, max_shard_bytes=150_000)
    index = d / "model.safetensors.index.json"
    good = index.read_text()
    for text, needle in (("[1]", "needs a non-empty"), ("{\"weight_map\": {\"a\": \"../x\"}}", "not a shard file"),
                         ("\xff", "not a readable safetensors index")):
        index.write_bytes(text.encode("latin-1"))
        with pytest.raises(CheckpointError, match=needle):
            load_target(d)
    index.write_text(good)
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"cannot read safetensors file .*{shard.name}.*damaged or incomplete"):
        load_target(d)


# ------------------------------------------------------------------------------------------ sweeps
def _corruptions(size):
    """(description, edit) pairs for a file of ``size`` bytes: bit flips at the start, a third, the middle and the
    end, and truncations (to half, and by one byte)."""
    out = []
    for pos, bit in ((0, 0x01), (size // 3, 0x80), (size // 2, 0x04), (size - 1, 0x10)):
        out.append((f"flip bit {bit:#04x} of byte {pos}", lambda raw, p=pos, b=bit: raw[:p] + bytes([raw[p] ^ b])
                    + raw[p + 1:]))
    out.append(("truncate to half", lambda raw: raw[: len(raw) // 2]))
    out.append(("drop the last byte", lambda raw: raw[:-1]))
    return out


@pytest.mark.parametrize("kind", ["orbax", "hf_manifest"])
def test_every_flip_or_truncation_of_every_file_is_caught(ckpts, tmp_path, kind):
    """With a manifest, no damage loads: a named error (usually the digest, else the parser that met it first)."""
    src = ckpts[kind]
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    assert len(files) >= 3
    d = fresh(src, tmp_path)
    seen = {}
    for rel in files:
        raw = (src / rel).read_bytes()
        for what, edit in _corruptions(len(raw)):
            (d / rel).write_bytes(edit(raw))
            with pytest.raises(DiffspecError) as info:
                load_target(d, "float32")
            seen[(str(rel), what)] = type(info.value).__name__
        (d / rel).write_bytes(raw)
    load_target(d, "float32")  # restored: loads again
    weights = [k for k in seen if k[0].endswith(".safetensors") or "/d/" in k[0]]
    assert weights and all(seen[k] in ("IntegrityError", "CheckpointError") for k in weights)
    assert "IntegrityError" in seen.values()


@pytest.mark.parametrize("kind", ["orbax", "hf_manifest"])
def test_deleting_any_file_is_caught(ckpts, tmp_path, kind):
    src = ckpts[kind]
    for rel in sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file()):
        if rel.name == MANIFEST:
            continue
        d = fresh(src, tmp_path)
        (d / rel).unlink()
        with pytest.raises(DiffspecError):
            load_target(d, "float32")
    d = fresh(src, tmp_path)
    (d / MANIFEST).unlink()  # the documented way to accept deliberate edits: no digests to check (values still are)
    load_target(d, "float32")


@settings(max_examples=40 * SCALE, **SETTINGS)
@given(data=st.data())
def test_damage_without_a_manifest_is_a_named_error_or_a_value_change(ckpts, tmp_path, data):
    """A checkpoint without manifest (as downloaded): damage to the safetensors header or config.json is a named
    error; damage to the weights is a finiteness failure or changes values (nothing else can tell), but never
    another exception."""
    src = ckpts["hf"]
    name = data.draw(st.sampled_from(["model.safetensors", "config.json"]), label="file")
    raw = (src / name).read_bytes()
    limit = 8 + struct.unpack("<Q", raw[:8])[0] if name == "model.safetensors" else len(raw)
    pos = data.draw(st.integers(0, limit - 1), label="position")
    bit = data.draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), label="bit")
    truncate = data.draw(st.booleans(), label="truncate")
    d = fresh(src, tmp_path)
    damaged = raw[:pos] if truncate else raw[:pos] + bytes([raw[pos] ^ bit]) + raw[pos + 1:]
    (d / name).write_bytes(damaged)
    try:
        load_target(d, "float32")
    except DiffspecError:
        return
    # it loaded: a flip of a value (undetectable without digests) or of a byte the loader does not use, or a cut
    # of nothing but trailing whitespace
    assert not truncate or not raw[pos:].strip()


@settings(max_examples=30 * SCALE, **SETTINGS)
@given(data=st.data())
def test_exponent_flips_in_weights_are_caught_without_a_manifest(ckpts, tmp_path, data):
    """Flipping the high exponent bit of a float32 weight of magnitude in (1e-20, 2) multiplies it by 2^128
    (>= 3e18, or inf / NaN): refused even without a manifest."""
    src = ckpts["hf"]
    raw = (src / "model.safetensors").read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    index = data.draw(st.integers(0, (len(raw) - start) // 4 - 1), label="float32 index")
    pos = start + 4 * index
    value = float(np.frombuffer(raw[pos:pos + 4], np.float32)[0])
    assume(1e-20 < abs(value) < 2.0)  # weights of these magnitudes have that exponent bit clear
    d = fresh(src, tmp_path)
    (d / "model.safetensors").write_bytes(raw[:pos + 3] + bytes([raw[pos + 3] ^ 0x40]) + raw[pos + 4:])
    with pytest.raises(IntegrityError, match="holds"):
        load_target(d, "float32")
