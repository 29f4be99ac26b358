"""``python -m checkpoints_tools.convert``: move checkpoints between formats.

* ``--hf DIR --out DIR [--dtype bfloat16|float32]``: Hugging Face target -> Orbax checkpoint;
* ``--orbax DIR --out DIR``: Orbax checkpoint -> Hugging Face directory (loadable by ``transformers``);
* ``--bin-to-safetensors DIR``: write ``model.safetensors`` (+ index) next to PyTorch ``*.bin`` weights
  (needs torch; run once, offline; refused when safetensors weights are already there).

The source is loaded with every integrity check (:func:`diffspec_jax.load_target`): a source whose
``diffspec_manifest.json`` does not match its files, or whose headers or weights are damaged, is refused before
anything is written. ``--out`` is written safely (:class:`diffspec_jax.outdir.OutputDir`): into ``OUT.partial``
first, renamed into place at the end, with a ``diffspec_manifest.json`` of SHA-256 digests that loading verifies;
its ``"source"`` field records the source directory and the size and SHA-256 of each of its files (and whether
they were verified against a manifest of its own), so the output's provenance can be checked later. A non-empty
``--out`` is refused unless an earlier diffspec tool wrote it, or ``--overwrite`` is given (the old contents are
then moved to ``OUT.replaced-<time>``, never deleted); an ``--out`` equal to, inside or around the source is
refused. Exit status: 0 = done, 2 = usage error, 1 = other error (a damaged source, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import ml_dtypes

from checkpoints_tools import hf, orbax_io
from diffspec_jax.errors import CheckpointError, DiffspecError, OutputDirError
from diffspec_jax.outdir import MANIFEST, OutputDir, file_digest, read_manifest
from diffspec_jax.target import load_target
from diffspec_jax.validation import ArgumentParser, report_error

TOOL = "checkpoints_tools.convert"


def source_record(src: str | Path) -> dict:
    """The ``"source"`` field of a converted checkpoint's manifest: the source directory, the size and SHA-256 of
    each of its files, and whether they were verified against the source's own manifest."""
    src = Path(src)
    files = {p.relative_to(src).as_posix(): {"bytes": p.stat().st_size, "sha256": file_digest(p)}
             for p in sorted(src.rglob("*")) if p.is_file() and p.name != MANIFEST}
    return {"path": str(src.resolve()), "verified_manifest": read_manifest(src) is not None, "files": files}


def hf_to_orbax(src: str | Path, out: str | Path, dtype: str = "bfloat16", *, overwrite: bool = False) -> Path:
    """Convert a Hugging Face target directory to an Orbax checkpoint at ``out`` (written safely)."""
    hf.check_dir(src)
    output = OutputDir(out, tool=TOOL, inputs=[src], overwrite=overwrite)
    with output as work:
        model = load_target(src, dtype=dtype, fuse_projections=False)  # checkpoints keep the HF layout
        orbax_io.save_orbax(work, model.config.to_hf_dict() | {"dtype": dtype}, model.params)
        output.extra["source"] = source_record(src)
    return Path(out)


def orbax_to_hf(src: str | Path, out: str | Path, dtype: str | None = None, *, overwrite: bool = False) -> Path:
    """Export an Orbax checkpoint as a Hugging Face directory at ``out`` (written safely)."""
    hf.check_dir(src)
    output = OutputDir(out, tool=TOOL, inputs=[src], overwrite=overwrite)
    with output as work:
        model = load_target(src, dtype="float32" if dtype in (None, "float32") else dtype, fuse_projections=False)
        hf.save_hf(work, model.config, model.params, dtype=dtype or "float32")
        output.extra["source"] = source_record(src)
    return Path(out)


def bin_to_safetensors(path: str | Path) -> list[Path]:
    """Convert ``pytorch_model.bin`` (or a sharded ``pytorch_model.bin.index.json`` set) to safetensors.

    The files are written beside the ``*.bin`` weights, each through a temporary name; existing safetensors
    weights are never replaced (:class:`~diffspec_jax.errors.OutputDirError`).
    """
    path = hf.check_dir(path)
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise CheckpointError(f"no *.bin weight files in {path}")
    existing = sorted(p.name for p in path.iterdir() if p.suffix == ".safetensors" or p.name == hf.INDEX_FILE)
    if existing:
        raise OutputDirError(f"{path} already holds safetensors weights {existing[:3]}; nothing was converted "
                             f"(remove them first if they should be replaced)")
    import torch

    tensors = {}
    for b in bins:
        try:
            state = torch.load(b, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for damaged pickles / zip files
            raise CheckpointError(f"cannot read PyTorch weights {b}: {exc}") from exc
        for k, v in state.items():
            t = v.detach().contiguous()
            tensors[k] = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
            if t.dtype == torch.bfloat16:
                tensors[k] = tensors[k].astype(ml_dtypes.bfloat16)
    staging = path / f".safetensors.partial-{os.getpid()}"
    staging.mkdir()
    try:
        written = hf.write_safetensors(staging, tensors, max_shard_bytes=5 << 30)
        extra = [staging / hf.INDEX_FILE] if (staging / hf.INDEX_FILE).exists() else []
        out = []
        for f in written + extra:
            os.rename(f, path / f.name)
            out.append(path / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [f for f in out if f.suffix == ".safetensors"]


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m checkpoints_tools.convert", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="Hugging Face target directory to convert to Orbax")
    src.add_argument("--orbax", help="Orbax checkpoint directory to export as Hugging Face safetensors")
    src.add_argument("--bin-to-safetensors", metavar="DIR", help="convert *.bin weights in DIR to safetensors")
    ap.add_argument("--out", help="output directory (for --hf / --orbax); written to OUT.partial, then renamed")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a non-empty --out that no diffspec tool wrote (its contents are moved to "
                         "OUT.replaced-<time>, nothing is deleted)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        if args.bin_to_safetensors:
            if args.out:
                ap.error("--out is not used with --bin-to-safetensors (the files are written beside the *.bin)")
            files = bin_to_safetensors(args.bin_to_safetensors)
            print(json.dumps({"written": [str(f) for f in files]}))
            return 0
        if not args.out:
            ap.error("--out is required with --hf / --orbax")
        if args.hf:
            out = hf_to_orbax(args.hf, args.out, args.dtype or "bfloat16", overwrite=args.overwrite)
        else:
            out = orbax_to_hf(args.orbax, args.out, args.dtype, overwrite=args.overwrite)
    except (DiffspecError, OSError) as exc:
        return report_error(exc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
