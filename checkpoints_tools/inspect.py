"""``python -m checkpoints_tools.inspect DIR``: what a checkpoint holds, and whether its files are intact.

Prints the config summary, every tensor (name, shape, dtype), the parameter count and the sha256 of every
weight file. ``--expect-sha256 FILE=HEX`` (repeatable) compares a file against a publisher's hash and exits
with status 1 on a mismatch. ``--verify`` checks the directory against its ``diffspec_manifest.json`` (the
SHA-256 digests written by ``convert``, ``train_draft`` and the demo build; see :mod:`diffspec_jax.outdir`) and
reads every tensor to check that it is finite, exiting with status 1 on any problem. Works on Hugging Face
directories (safetensors, sharded or not) and on Orbax checkpoints written by ``checkpoints_tools.convert``.
Exit status: 0 = fine, 1 = a damaged checkpoint or a failed check, 2 = usage error (no such directory, ...).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import jax
import numpy as np

from checkpoints_tools import hf, orbax_io
from diffspec_jax.errors import CheckpointError, DiffspecError, IntegrityError
from diffspec_jax.outdir import verify_manifest
from diffspec_jax.target import MAX_ABS_WEIGHT, check_finite
from diffspec_jax.validation import ArgumentParser, one_line, read_json_object, report_error


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(path: Path, suffixes: tuple[str, ...] = (".safetensors", ".json")) -> dict[str, str]:
    """sha256 of the files of checkpoint directory ``path`` with these suffixes, by file name (sorted)."""
    return {p.name: sha256_file(p) for p in sorted(Path(path).iterdir()) if p.suffix in suffixes}


def describe(path: str | Path) -> dict:
    """A JSON-able description: config summary, tensors, parameter count, weight files with sha256."""
    path = hf.check_dir(path)
    info: dict = {"path": str(path)}
    cfg_file = path / "config.json"
    if cfg_file.exists():
        try:
            raw = read_json_object(cfg_file)
        except DiffspecError as exc:
            raw = {}
            info["config_error"] = str(exc)
        if isinstance(raw.get("text_config"), dict):  # multimodal wrappers (Qwen3.5-MoE): summarise the text model
            raw = {**raw["text_config"], **{k: raw[k] for k in ("architectures", "model_type") if k in raw}}
        info["config"] = {k: raw.get(k) for k in ("architectures", "model_type", "hidden_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                   "draft_vocab_size", "num_experts", "num_experts_per_tok")
                          if k in raw}
    tensors = []
    if orbax_io.is_orbax_dir(path):
        info["format"] = "orbax"
        tree = orbax_io.stored_tree(path)
        for keypath, m in jax.tree_util.tree_flatten_with_path(tree)[0]:
            tensors.append({"name": jax.tree_util.keystr(keypath), "shape": list(m.shape), "dtype": str(m.dtype)})
        files = sorted(p for p in (path / orbax_io.PARAMS_DIR).rglob("*") if p.is_file())
    else:
        with hf.WeightReader(path) as reader:
            info["format"] = "safetensors"
            for name in sorted(reader.keys()):
                tensors.append({"name": name, "shape": list(reader.shape(name)), "dtype": reader.dtype(name)})
            files = reader.files()
    info["tensors"] = tensors
    info["num_parameters"] = int(sum(math.prod(t["shape"]) for t in tensors))
    info["files"] = [{"file": str(f.relative_to(path)), "bytes": f.stat().st_size, "sha256": sha256_file(f)}
                     for f in files]
    return info


def verify(path: str | Path) -> dict:
    """``--verify``: the manifest's digests (required), then every floating tensor finite and of magnitude <=
    ``diffspec_jax.target.MAX_ABS_WEIGHT``. Returns ``{"manifest_files": n, "tensors_checked": m}``.

    Raises:
        IntegrityError: the first problem (a missing manifest, a digest mismatch, a bad tensor).
        CheckpointError: a file that cannot be read.
    """
    path = hf.check_dir(path)
    body = verify_manifest(path, required=True)
    checked = 0
    if orbax_io.is_orbax_dir(path):
        params = orbax_io.load_orbax(path)
        check_finite(params, str(path))
        checked = len(jax.tree_util.tree_leaves(params))
    elif (path / hf.SINGLE_FILE).exists() or (path / hf.INDEX_FILE).exists():
        with hf.WeightReader(path) as reader:
            for name in sorted(reader.keys()):  # one tensor at a time: host memory stays at one tensor
                arr = reader.get(name)
                if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
                    continue
                peak = float(np.max(np.abs(arr.astype(np.float32)), initial=0.0))
                if not math.isfinite(peak) or peak > MAX_ABS_WEIGHT:
                    what = "NaN or infinite values" if not math.isfinite(peak) else f"a value of magnitude {peak:.3g}"
                    raise IntegrityError(f"{path}: tensor {name!r} holds {what}; the checkpoint is damaged")
                checked += 1
    return {"manifest_files": len(body["files"]), "tensors_checked": checked}


def check_hashes(info: dict, expected: list[str]) -> list[str]:
    """Problems found comparing ``FILE=HEX`` expectations with the described files (empty list = all match)."""
    by_name = {f["file"]: f["sha256"] for f in info["files"]}
    problems = []
    for item in expected:
        if "=" not in item:
            problems.append(f"--expect-sha256 wants FILE=HEX, got {item!r}")
            continue
        name, hexdigest = item.split("=", 1)
        if name not in by_name:
            problems.append(f"{name}: no such weight file (files: {', '.join(by_name)})")
        elif by_name[name] != hexdigest.strip().lower():
            problems.append(f"{name}: sha256 mismatch: file has {by_name[name]}, expected {hexdigest.strip()}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m checkpoints_tools.inspect", description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--expect-sha256", action="append", default=[], metavar="FILE=HEX")
    ap.add_argument("--verify", action="store_true",
                    help="check the files against diffspec_manifest.json and every tensor for NaN / inf")
    args = ap.parse_args(argv)
    verified = None
    try:
        if args.verify:  # first: a damaged file is best reported by its digest
            verified = verify(args.path)
        info = describe(args.path)
    except (DiffspecError, OSError) as exc:
        if args.verify and isinstance(exc, CheckpointError) and exc.exit_code == 1:
            print(f"VERIFY FAILED: {one_line(str(exc))}", file=sys.stderr)
            return 1
        return report_error(exc)
    problems = check_hashes(info, args.expect_sha256)
    info["hash_check"] = {"expected": len(args.expect_sha256), "problems": problems}
    if verified is not None:
        info["verify"] = verified
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{info['path']} ({info['format']})")
        for k, v in info.get("config", {}).items():
            print(f"  {k}: {v}")
        for t in info["tensors"]:
            print(f"  {t['name']:<60} {str(t['shape']):<22} {t['dtype']}")
        print(f"parameters: {info['num_parameters']:,}")
        for f in info["files"]:
            print(f"  {f['sha256']}  {f['file']} ({f['bytes']:,} bytes)")
        for p in problems:
            print(f"HASH CHECK FAILED: {p}", file=sys.stderr)
        if args.expect_sha256 and not problems:
            print(f"hash check: {len(args.expect_sha256)} file(s) match")
        if verified is not None:
            print(f"verified: {verified['manifest_files']} file(s) match diffspec_manifest.json, "
                  f"{verified['tensors_checked']} tensor(s) finite")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
