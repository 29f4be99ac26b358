"""``python -m checkpoints_tools.inspect DIR``: what a checkpoint holds, and whether its files are intact.

Prints the config summary, every tensor (name, shape, dtype), the parameter count and the sha256 of every
weight file. ``--expect-sha256 FILE=HEX`` (repeatable) compares a file against a publisher's hash and exits
with status 1 on a mismatch. Works on Hugging Face directories (safetensors, sharded or not) and on Orbax
checkpoints written by ``checkpoints_tools.convert``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

from checkpoints_tools import hf, orbax_io
from diffspec_jax.errors import DiffspecError


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
        raw = json.loads(cfg_file.read_text())
        if isinstance(raw.get("text_config"), dict):  # multimodal wrappers (Qwen3.5-MoE): summarise the text model
            raw = {**raw["text_config"], **{k: raw[k] for k in ("architectures", "model_type") if k in raw}}
        info["config"] = {k: raw.get(k) for k in ("architectures", "model_type", "hidden_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                   "draft_vocab_size", "num_experts", "num_experts_per_tok")
                          if k in raw}
    tensors = []
    if orbax_io.is_orbax_dir(path):
        import orbax.checkpoint as ocp

        info["format"] = "orbax"
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata((path / orbax_io.PARAMS_DIR).absolute())
        tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        import jax

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
    ap = argparse.ArgumentParser(prog="python -m checkpoints_tools.inspect", description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--expect-sha256", action="append", default=[], metavar="FILE=HEX")
    args = ap.parse_args(argv)
    try:
        info = describe(args.path)
    except DiffspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = check_hashes(info, args.expect_sha256)
    info["hash_check"] = {"expected": len(args.expect_sha256), "problems": problems}
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
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
