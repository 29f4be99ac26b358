"""``python -m checkpoints_tools.inspect DIR``: what a checkpoint holds, and whether its files are intact.

Prints the config summary, every tensor (name, shape, dtype), the parameter count and the sha256 of every
weight file, then every problem found (:func:`audit`), each on its own line on stderr: files that differ from
the directory's ``diffspec_manifest.json`` (when it has one); an unreadable, empty or
invalid ``config.json``; damaged safetensors headers (byte lengths that do not fit the dtype and shape, data
offsets that overlap, leave gaps, run past the file or look swapped, F16 and BF16 mixed); tensors missing from the
files and the index, unexpected or of the wrong shape for the config (a changed hidden size); a draft without
``fc.weight`` or ``d2t``; weights holding NaN, infinite values or magnitudes above
``diffspec_jax.target.MAX_ABS_WEIGHT``. Every tensor is read once, one at a time.

``--expect-sha256 FILE=HEX`` (repeatable) compares a file against a publisher's hash. ``--verify`` also checks
the directory against its ``diffspec_manifest.json`` (the SHA-256 digests written by ``convert``, ``train_draft``
and the demo build; see :mod:`diffspec_jax.outdir`), hashing every file afresh. Works on Hugging Face directories
(safetensors, sharded or not) and on Orbax checkpoints written by ``checkpoints_tools.convert``.
Exit status: 0 = fine, 1 = a damaged checkpoint or a failed check, 2 = usage error (no such directory, ...).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np

from checkpoints_tools import hf, orbax_io
from diffspec_jax.config import DraftConfig, ModelConfig
from diffspec_jax.draft import draft_layout
from diffspec_jax.errors import CheckpointError, DiffspecError, IntegrityError
from diffspec_jax.outdir import manifest_mismatches, read_manifest, sha256_file, verify_manifest
from diffspec_jax.target import MAX_ABS_WEIGHT
from diffspec_jax.validation import ArgumentParser, one_line, read_json_object, report_error


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
        with hf.WeightReader(path, check_headers=False) as reader:  # audit() reports damaged headers
            info["format"] = "safetensors"
            for name in sorted(reader.keys()):
                tensors.append({"name": name, "shape": list(reader.shape(name)), "dtype": reader.dtype(name)})
            files = reader.files()
    info["tensors"] = tensors
    info["num_parameters"] = int(sum(math.prod(t["shape"]) for t in tensors))
    info["files"] = [{"file": str(f.relative_to(path)), "bytes": f.stat().st_size, "sha256": sha256_file(f)}
                     for f in files]
    return info


def value_problem(where: str, name: str, arr: Any) -> IntegrityError | None:
    """An :class:`IntegrityError` when the floating array ``arr`` holds NaN / inf or a magnitude above
    ``MAX_ABS_WEIGHT``, else ``None`` (integer tables and other non-float arrays pass)."""
    arr = np.asarray(arr)
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
        return None
    peak = float(np.max(np.abs(arr.astype(np.float32)), initial=0.0))
    if math.isfinite(peak) and peak <= MAX_ABS_WEIGHT:
        return None
    what = "NaN or infinite values" if not math.isfinite(peak) else (
        f"a value of magnitude {peak:.3g} > {MAX_ABS_WEIGHT:g}")
    return IntegrityError(f"{where}: tensor {name!r} holds {what}; the checkpoint is damaged")


def _stored_arrays(path: Path) -> Iterator[tuple[str, Any]]:
    """``(name, array)`` of every tensor, one at a time (Orbax: every leaf of the restored params)."""
    if orbax_io.is_orbax_dir(path):
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(orbax_io.load_orbax(path))[0]:
            yield f"params{jax.tree_util.keystr(keypath)}", leaf
        return
    with hf.WeightReader(path, check_headers=False) as reader:
        for name in sorted(reader.keys()):
            yield name, reader.get(name)


def verify(path: str | Path) -> dict:
    """``--verify``: the manifest's digests (required, every file hashed afresh), then every floating tensor finite
    and of magnitude <= ``diffspec_jax.target.MAX_ABS_WEIGHT``. Returns ``{"manifest_files": n,
    "tensors_checked": m}``.

    Raises:
        IntegrityError: the first problem (a missing manifest, a digest mismatch, a bad tensor).
        CheckpointError: a file that cannot be read.
    """
    path = hf.check_dir(path)
    body = verify_manifest(path, required=True, cached=False)
    checked = 0
    if orbax_io.is_orbax_dir(path) or (path / hf.SINGLE_FILE).exists() or (path / hf.INDEX_FILE).exists():
        for name, arr in _stored_arrays(path):
            problem = value_problem(str(path), name, arr)
            if problem is not None:
                raise problem
            checked += 1
    return {"manifest_files": len(body["files"]), "tensors_checked": checked}


def is_draft_config(raw: dict) -> bool:
    """``config.json`` of an EAGLE-3 draft (an ``*Eagle3`` architecture, ``draft_vocab_size`` or ``eagle_config``)."""
    archs = raw.get("architectures")
    return (any(isinstance(a, str) and "eagle" in a.lower() for a in archs) if isinstance(archs, list) else False) \
        or "draft_vocab_size" in raw or "eagle_config" in raw


def audit(path: str | Path) -> list[str]:
    """Every problem of the checkpoint directory ``path`` that shows without a manifest (see the module docstring),
    each once, as one-line messages naming the file and the cause; ``[]`` when none.

    Raises:
        PathNotFoundError: ``path`` does not exist or is not a directory.
    """
    path = hf.check_dir(path)
    found: list[DiffspecError] = []
    try:
        body = read_manifest(path)
        found += list(manifest_mismatches(path, body)) if body is not None else []
    except IntegrityError as exc:
        found.append(exc)
    cfg_file, raw, config = path / "config.json", None, None
    try:
        raw = read_json_object(cfg_file, error=CheckpointError)
        draft = is_draft_config(raw)
        config = (DraftConfig if draft else ModelConfig).from_dict(raw, source=str(cfg_file))
    except DiffspecError as exc:
        found.append(exc)
    if not orbax_io.is_orbax_dir(path):
        for file in sorted(path.glob("*.safetensors")):
            try:
                found += hf.header_problems(file)
            except CheckpointError as exc:
                found.append(exc)
        try:
            with hf.WeightReader(path, check_headers=False) as reader:
                if isinstance(config, DraftConfig):
                    layout = draft_layout(reader, config, path)
                    found += layout.layer_problems + layout.tensor_problems
                elif isinstance(config, ModelConfig):
                    source, table, ignore = hf.target_layout(reader, config)
                    found += hf.table_problems(source, table, ignore=ignore)
        except DiffspecError as exc:
            found.append(exc)
    try:
        for name, arr in _stored_arrays(path):
            problem = value_problem(str(path), name, arr)
            if problem is not None:
                found.append(problem)
    except (DiffspecError, OSError) as exc:
        found.append(exc)
    return list(dict.fromkeys(one_line(_message(exc)) for exc in found))


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, DiffspecError):
        return f"{exc.strerror or exc} ({exc.filename})" if getattr(exc, "filename", None) else str(exc)
    return str(exc)


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
                    help="also check the files against diffspec_manifest.json (hashing every file afresh)")
    args = ap.parse_args(argv)
    verified = None
    try:
        path = hf.check_dir(args.path)
        if args.verify:  # first: a damaged file is best reported by its digest
            verified = verify(path)
    except (DiffspecError, OSError) as exc:
        if args.verify and isinstance(exc, CheckpointError) and exc.exit_code == 1:
            print(f"VERIFY FAILED: {one_line(str(exc))}", file=sys.stderr)
            return 1
        return report_error(exc)
    problems = audit(path)
    try:
        info = describe(path)
    except (DiffspecError, OSError) as exc:
        info = {"path": str(path), "format": None, "tensors": [], "num_parameters": 0, "files": []}
        if one_line(_message(exc)) not in problems:
            problems.append(one_line(_message(exc)))
    hash_problems = check_hashes(info, args.expect_sha256)
    info["hash_check"] = {"expected": len(args.expect_sha256), "problems": hash_problems}
    info["problems"] = problems
    if verified is not None:
        info["verify"] = verified
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        if info["format"] is not None:
            print(f"{info['path']} ({info['format']})")
            for k, v in info.get("config", {}).items():
                print(f"  {k}: {v}")
            for t in info["tensors"]:
                print(f"  {t['name']:<60} {str(t['shape']):<22} {t['dtype']}")
            print(f"parameters: {info['num_parameters']:,}")
            for f in info["files"]:
                print(f"  {f['sha256']}  {f['file']} ({f['bytes']:,} bytes)")
        for p in hash_problems:
            print(f"HASH CHECK FAILED: {p}", file=sys.stderr)
        for p in problems:
            print(f"PROBLEM: {p}", file=sys.stderr)
        if args.expect_sha256 and not hash_problems:
            print(f"hash check: {len(args.expect_sha256)} file(s) match")
        if verified is not None:
            print(f"verified: {verified['manifest_files']} file(s) match diffspec_manifest.json, "
                  f"{verified['tensors_checked']} tensor(s) finite")
        if not problems:
            print("no problems found")
    return 1 if problems or hash_problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
