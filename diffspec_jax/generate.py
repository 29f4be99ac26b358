"""``python -m diffspec_jax.generate``: greedy generation from the command line.

This first version decodes with the target alone (no draft yet) through the fixed-capacity KV cache. With no
``--target`` it runs on an embedded default: a tiny **random** Llama written on the fly by
``checkpoints_tools.make_tiny`` (its output tokens are meaningless; it demonstrates the machinery).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from diffspec_jax import target as tgt
from diffspec_jax.cache import KVCache
from diffspec_jax.errors import DiffspecError, InputError


def default_model_dir() -> Path:
    """Create (once) and return the embedded default: a random tiny Llama in the user cache."""
    root = Path(os.environ.get("DIFFSPEC_CACHE", Path.home() / ".cache" / "diffspec_jax"))
    path = root / "random-tiny-llama-v1"
    if not (path / "config.json").exists():
        from checkpoints_tools.make_tiny import make_tiny

        make_tiny(path, "llama", backend="numpy", seed=0)
    return path


def greedy(model: tgt.TargetModel, prompt: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
    """Target-only greedy decoding of one prompt; returns the new tokens and timing stats."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache = KVCache.create(model.config, 1, len(prompt) + max_new_tokens, model.dtype)
    t0 = time.perf_counter()
    logits, cache = tgt.prefill(model, cache, [prompt])
    token = int(jnp.argmax(logits[0]))
    t1 = time.perf_counter()
    out = [token]
    for pos in range(len(prompt), len(prompt) + max_new_tokens - 1):
        if token in model.config.eos_token_ids:
            break
        logits, cache = tgt.decode(model, cache, [[token]], [pos])
        token = int(jnp.argmax(logits[0, -1]))
        out.append(token)
    t2 = time.perf_counter()
    return out, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "new_tokens": len(out),
                 "decode_tokens_per_s": (len(out) - 1) / (t2 - t1) if len(out) > 1 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffspec_jax.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="Hugging Face or Orbax target directory (default: embedded random tiny Llama)")
    ap.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=sorted(tgt.DTYPES))
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        path = Path(args.target) if args.target else default_model_dir()
        model = tgt.load_target(path, dtype=args.dtype)
        if args.prompt_ids:
            prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        else:
            prompt = [int(t) for t in np.random.default_rng(0).integers(3, model.config.vocab_size, 48)]
        tokens, stats = greedy(model, prompt, args.max_new_tokens)
    except (DiffspecError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    random = (path / "RANDOM_WEIGHTS.json").exists()
    if args.json:
        print(json.dumps({"model": str(path), "random_weights": random, "prompt_ids": [int(p) for p in prompt],
                          "ids": tokens, "stats": stats}))
    else:
        if random:
            print(f"[random weights: {path}; the tokens below are meaningless]", file=sys.stderr)
        print(f"model: {model}")
        print(f"prompt ({len(prompt)} tokens): {prompt}")
        print(f"generated ({len(tokens)} tokens): {tokens}")
        print(f"prefill {stats['prefill_s']:.3f}s, decode {stats['decode_s']:.3f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
