"""``python -m checkpoints_tools.convert``: move checkpoints between formats.

* ``--hf DIR --out DIR [--dtype bfloat16|float32]``: Hugging Face target -> Orbax checkpoint;
* ``--orbax DIR --out DIR``: Orbax checkpoint -> Hugging Face directory (loadable by ``transformers``);
* ``--bin-to-safetensors DIR``: write ``model.safetensors`` (+ index) next to PyTorch ``*.bin`` weights
  (needs torch; run once, offline).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from checkpoints_tools import hf, orbax_io
from diffspec_jax.errors import CheckpointError, DiffspecError


def hf_to_orbax(src: str | Path, out: str | Path, dtype: str = "bfloat16") -> Path:
    from diffspec_jax.target import load_target

    model = load_target(src, dtype=dtype, fuse_projections=False)  # checkpoints keep the HF layout
    return orbax_io.save_orbax(out, model.config.to_hf_dict() | {"dtype": dtype}, model.params)


def orbax_to_hf(src: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    from diffspec_jax.target import load_target

    model = load_target(src, dtype="float32" if dtype in (None, "float32") else dtype, fuse_projections=False)
    return hf.save_hf(out, model.config, model.params, dtype=dtype or "float32")


def bin_to_safetensors(path: str | Path) -> list[Path]:
    """Convert ``pytorch_model.bin`` (or a sharded ``pytorch_model.bin.index.json`` set) to safetensors."""
    import torch

    path = hf.check_dir(path)
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise CheckpointError(f"no *.bin weight files in {path}")
    tensors = {}
    for b in bins:
        state = torch.load(b, map_location="cpu", weights_only=True)
        for k, v in state.items():
            t = v.detach().contiguous()
            tensors[k] = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
            if t.dtype == torch.bfloat16:
                import ml_dtypes

                tensors[k] = tensors[k].astype(ml_dtypes.bfloat16)
    return hf.write_safetensors(path, tensors, max_shard_bytes=5 << 30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpoints_tools.convert", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="Hugging Face target directory to convert to Orbax")
    src.add_argument("--orbax", help="Orbax checkpoint directory to export as Hugging Face safetensors")
    src.add_argument("--bin-to-safetensors", metavar="DIR", help="convert *.bin weights in DIR to safetensors")
    ap.add_argument("--out", help="output directory (for --hf / --orbax)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    try:
        if args.bin_to_safetensors:
            files = bin_to_safetensors(args.bin_to_safetensors)
            print(json.dumps({"written": [str(f) for f in files]}))
            return 0
        if not args.out:
            ap.error("--out is required with --hf / --orbax")
        if args.hf:
            out = hf_to_orbax(args.hf, args.out, args.dtype or "bfloat16")
        else:
            out = orbax_to_hf(args.orbax, args.out, args.dtype)
    except DiffspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
