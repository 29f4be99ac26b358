"""Issue 26: damaged checkpoints never load silently. Weights holding NaN / inf / absurd values are refused by a
fused on-device check; files written by our tools carry a SHA-256 manifest that loading verifies; every
safetensors or Orbax read error is a CheckpointError naming the file. The sweeps flip bytes in and truncate every
file of a tiny Hugging Face and a tiny Orbax checkpoint."""

import importlib
import json
import re
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


# ------------------------------------------------------------------------------------------ the shipped pair (issue 38)
SHARD = "model-00001-of-00002.safetensors"  # holds lm_head and layers 0-1 of the demo target (BF16)
Q0, K0, V0, O0 = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo")


def edit_header(file, change):
    """Rewrite a safetensors file's JSON header with ``change(header)`` applied (the data left as it is)."""
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def edit_values(file, name, change):
    """Apply ``change(uint16 view of the BF16 tensor name)`` to the bytes of one tensor, in place."""
    raw = bytearray(file.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    bits = np.frombuffer(bytes(raw[8 + n + begin:8 + n + end]), np.uint16).copy()
    change(bits)
    raw[8 + n + begin:8 + n + end] = bits.tobytes()
    file.write_bytes(bytes(raw))


def _swap(a, b):
    def change(h):
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    return change


def _set(name, key, value):
    return lambda h: h[name].__setitem__(key, value)


def _shift_last(h):
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    h[last]["data_offsets"] = [x + 64 for x in h[last]["data_offsets"]]


def _mantissa_flips(bits):
    rng = np.random.default_rng(0)
    bits[rng.choice(bits.size, 2000, replace=False)] ^= 1


def _exponent_flip(bits):
    i = int(np.flatnonzero((bits & 0x7F80) != 0)[0])  # a normal weight of magnitude < 2: its top exponent bit is 0
    bits[i] ^= 0x4000  # x 2^128


#: (damage, edit of the copied target directory, what refuses it without a manifest: a regex of the message, or
#: None where nothing can tell without digests)
PAIR_DAMAGE = [
    ("dtype BF16->F16", lambda d: edit_header(d / SHARD, _set(Q0, "dtype", "F16")), "one half-precision format"),
    ("dtype BF16->F32", lambda d: edit_header(d / SHARD, _set(Q0, "dtype", "F32")), "span 131072 bytes"),
    ("swapped q/o offsets", lambda d: edit_header(d / SHARD, _swap(Q0, O0)), "look swapped"),
    ("swapped k/v offsets", lambda d: edit_header(d / SHARD, _swap(K0, V0)), "look swapped"),
    ("overlapping offsets", lambda d: edit_header(d / SHARD, lambda h: h[V0].__setitem__(
        "data_offsets", [h[V0]["data_offsets"][0] - 64, h[V0]["data_offsets"][1] - 64])), "overlapping|gap"),
    ("offsets past the end", lambda d: edit_header(d / SHARD, _shift_last), "header describes .* bytes of tensor data"),
    ("truncated shard", lambda d: (d / SHARD).write_bytes((d / SHARD).read_bytes()[:-4096]), "damaged or incomplete"),
    ("NaN weight", lambda d: edit_values(d / SHARD, K0, lambda b: b.__setitem__(7, 0x7FC0)), "NaN or infinite"),
    ("1e7 weight", lambda d: edit_values(d / SHARD, K0, lambda b: b.__setitem__(7, 0x4B18)), "magnitude 9.96e\\+06"),
    ("exponent flip", lambda d: edit_values(d / SHARD, Q0, _exponent_flip), "holds"),
    ("sign flip of lm_head", lambda d: edit_values(d / SHARD, "lm_head.weight", lambda b: b.__ixor__(0x8000)), None),
    ("sign flip in q_proj", lambda d: edit_values(d / SHARD, Q0, lambda b: b.__setitem__(3, b[3] ^ 0x8000)), None),
    ("2000 mantissa flips", lambda d: edit_values(d / SHARD, "lm_head.weight", _mantissa_flips), None),
]


@pytest.fixture(scope="module")
def pair_target():
    from diffspec_jax import demo

    return load_target(demo.target_dir(), "float32")


def test_the_shipped_pair_carries_manifests_that_verify(capsys):
    import fnmatch
    import tomllib
    from pathlib import Path

    from diffspec_jax import demo

    globs = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["diffspec_jax"]
    for d in (demo.target_dir(), demo.draft_dir()):
        assert json.loads((d / MANIFEST).read_text())["tool"] == "diffspec_jax.demo.build"
        assert any(fnmatch.fnmatch(f"demo/pair/{d.name}/{MANIFEST}", g) for g in globs)  # installed with the package
        assert ckpt_inspect.main([str(d), "--verify"]) == 0
        out = capsys.readouterr()
        assert "file(s) match diffspec_manifest.json" in out.out and "no problems found" in out.out and not out.err


@pytest.mark.parametrize("what, damage, without_manifest", PAIR_DAMAGE, ids=[c[0] for c in PAIR_DAMAGE])
def test_damage_to_the_shipped_target_is_refused(tmp_path, what, damage, without_manifest, capsys):
    """Every damage is caught by the manifest the pair ships with; without it, what the headers or the values show
    is still refused (load and inspect), and value changes within range load (nothing can tell them)."""
    from diffspec_jax import demo

    d = fresh(demo.target_dir(), tmp_path)
    damage(d)
    with pytest.raises(IntegrityError, match=f"{SHARD} (has SHA-256|has \\d+ bytes, its manifest says)"):
        load_target(d, "float32")
    assert ckpt_inspect.main([str(d)]) == 1
    assert f"PROBLEM: {d}: {SHARD} has" in capsys.readouterr().err
    (d / MANIFEST).unlink()
    if without_manifest is None:
        load_target(d, "float32")
        assert ckpt_inspect.main([str(d)]) == 0
        return
    with pytest.raises(CheckpointError, match=without_manifest):
        load_target(d, "float32")
    assert ckpt_inspect.main([str(d)]) == 1
    err = capsys.readouterr().err
    assert re.search(without_manifest, err) and "Traceback" not in err


@pytest.mark.parametrize("what", ["dtype", "swap", "no fc.weight", "no d2t", "inf"])
def test_damage_to_the_shipped_draft_is_refused(pair_target, tmp_path, what, capsys):
    from diffspec_jax import demo

    d = fresh(demo.draft_dir(), tmp_path)
    file = d / "model.safetensors"
    if what == "dtype":
        edit_header(file, _set("fc.weight", "dtype", "F16"))
    elif what == "swap":
        edit_header(file, _swap("midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight"))
    elif what == "inf":
        edit_values(file, "fc.weight", lambda b: b.__setitem__(0, 0x7F80))
    else:
        rewrite_safetensors(d, lambda t: t.pop("fc.weight" if what == "no fc.weight" else "d2t"))
    with pytest.raises(IntegrityError, match="model.safetensors has (SHA-256|\\d+ bytes)"):
        load_draft(d, pair_target)
    (d / MANIFEST).unlink()
    needle = {"dtype": "one half-precision format", "swap": "look swapped", "inf": "NaN or infinite",
              "no fc.weight": "missing tensor 'fc.weight'", "no d2t": "the d2t table is missing"}[what]
    with pytest.raises(CheckpointError, match=needle):
        load_draft(d, pair_target)
    assert ckpt_inspect.main([str(d)]) == 1
    assert needle in capsys.readouterr().err


def test_inspect_reports_every_problem_with_its_real_cause(ckpts, tmp_path, capsys):
    """Issue 38: `inspect DIR` (no --verify) used to exit 0 on broken checkpoints."""
    from diffspec_jax import demo

    def problems(d):
        assert ckpt_inspect.main([str(d)]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return [line for line in err.splitlines() if line.startswith("PROBLEM: ")]

    d = fresh(demo.target_dir(), tmp_path)
    (d / MANIFEST).unlink()
    good = (d / "config.json").read_text()
    for text, needle in (("{not json", "not valid JSON"), ("", "config.json is empty"), ("[1, 2]", "got a JSON list"),
                         (json.dumps({**json.loads(good), "hidden_size": 128}), "but config.json implies")):
        (d / "config.json").write_text(text)
        found = problems(d)
        assert found and all(needle in p for p in found), found
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    assert problems(d) == [f"PROBLEM: config.json {d / 'config.json'} is a directory, not a file"]
    (d / "config.json").rmdir()
    (d / "config.json").write_text(good)
    # three problems at once, each reported: a tensor gone from its shard and the index, a NaN, a 1e7
    gone = "model.layers.1.mlp.up_proj.weight"
    rewrite_safetensors(d, lambda t: t.pop(gone), name=SHARD)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"][gone]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    edit_values(d / SHARD, K0, lambda b: b.__setitem__(0, 0x7FC0))
    edit_values(d / "model-00002-of-00002.safetensors", "model.norm.weight", lambda b: b.__setitem__(0, 0x4B18))
    found = problems(d)
    assert len(found) == 3
    assert f"missing tensors ['{gone}']" in found[0] and K0 in found[1] and "model.norm.weight" in found[2]
    # the real cause of an unreadable file
    d = fresh(ckpts["hf"], tmp_path, "single")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors: it is a directory, not a file"):
        load_target(d)
    assert "it is a directory, not a file" in problems(d)[0]
    from checkpoints_tools import hf

    denied = hf.unreadable(d / "x.safetensors", PermissionError(13, "Permission denied"))
    assert "x.safetensors: permission denied (make it readable" in str(denied)
    if os.geteuid() != 0:  # root reads any file
        f = fresh(demo.target_dir(), tmp_path) / SHARD
        f.chmod(0)
        with pytest.raises(CheckpointError, match="permission denied"):
            load_target(f.parent, verify=False)


def test_configs_that_silently_change_the_model_are_refused_at_load(tmp_path, capsys):
    """Issue 38: without rope parameters generation ran with a default RoPE; an EOS id outside the vocabulary only
    drew a transformers warning. Both are named errors when `generate` loads the target (exit 2, nothing run)."""
    from diffspec_jax import demo

    generate = importlib.import_module("diffspec_jax.generate")  # the module (the package's name is the function)
    d = fresh(demo.target_dir(), tmp_path)
    good = json.loads((d / "config.json").read_text())
    cases = [({k: v for k, v in good.items() if k != "rope_parameters"}, None, "config.json: no rope_theta"),
             ({**good, "eos_token_id": 4096}, None, "config.json: eos_token_id 4096 lies outside the vocabulary"),
             (good, {"eos_token_id": [0, 70000]}, "generation_config.json: eos_token_id 70000 lies outside")]
    for config, gen, needle in cases:
        (d / "config.json").write_text(json.dumps(config))
        if gen is not None:
            (d / "generation_config.json").write_text(json.dumps(gen))
        with pytest.raises(DiffspecError, match=needle):
            load_target(d)
        assert generate.main(["--target", str(d), "--no-draft", "--prompt-ids", "1,2", "--no-progress"]) == 2
        assert needle in capsys.readouterr().err


def test_no_verify_reaches_both_loads(monkeypatch):
    from diffspec_jax import serve
    from diffspec_jax.errors import InputError

    generate = importlib.import_module("diffspec_jax.generate")

    seen = []

    def fake_load(path, *args, **kwargs):
        seen.append(kwargs.get("verify"))
        raise InputError("stop here")

    monkeypatch.setattr(generate, "load_target", fake_load)
    for flags, verify in (([], True), (["--no-verify"], False)):
        assert generate.main(["--no-progress", *flags]) == 2
        assert seen.pop() is verify
    assert serve.build_parser().parse_args(["--no-verify"]).no_verify is True


def test_digests_of_unchanged_files_are_remembered(ckpts, tmp_path, monkeypatch):
    from diffspec_jax import outdir

    d = fresh(ckpts["orbax"], tmp_path)
    monkeypatch.setenv(outdir.DIGEST_CACHE_ENV, str(tmp_path / "digests"))
    monkeypatch.setattr(outdir, "_digests", {})
    hashed = []
    real = outdir.sha256_file
    monkeypatch.setattr(outdir, "sha256_file", lambda p, *a: hashed.append(p) or real(p, *a))
    listed = len(json.loads((d / MANIFEST).read_text())["files"])
    outdir.verify_manifest(d)
    assert len(hashed) == listed
    outdir.verify_manifest(d)
    monkeypatch.setattr(outdir, "_digests", {})  # a new process: the on-disk cache answers
    outdir.verify_manifest(d)
    assert len(hashed) == listed
    outdir.verify_manifest(d, cached=False)  # inspect --verify hashes afresh
    assert len(hashed) == 2 * listed
    # same size, mtime put back: the status-change time still differs, so the file is hashed again
    f = d / "config.json"
    st = f.stat()
    f.write_text(f.read_text().replace("4", "5", 1))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(IntegrityError, match="config.json has SHA-256"):
        outdir.verify_manifest(d)
    monkeypatch.setenv(outdir.DIGEST_CACHE_ENV, "off")
    assert outdir.digest_cache_dir() is None


def test_convert_refuses_a_damaged_source_and_records_the_source_digests(ckpts, tmp_path, capsys):
    from diffspec_jax import demo
    from diffspec_jax.outdir import sha256_file

    for kind, src, verified in (("orbax", ckpts["hf"], False), ("hf_manifest", ckpts["orbax"], True)):
        source = json.loads((ckpts[kind] / MANIFEST).read_text())["source"]
        files = {p.relative_to(src).as_posix(): p for p in src.rglob("*") if p.is_file() and p.name != MANIFEST}
        assert source["verified_manifest"] is verified and source["path"] == str(src.resolve())
        assert source["files"] == {k: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for k, p in files.items()}
    d = fresh(demo.target_dir(), tmp_path)
    edit_values(d / SHARD, "lm_head.weight", _mantissa_flips)
    assert convert.main(["--hf", str(d), "--out", str(tmp_path / "out")]) == 1
    assert f"{SHARD} has SHA-256" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
