"""The 8-bit K/V attention kernel against the bf16 one, per tiling and upcast dtype (issue 41; GPU).

One layer of ``pallas_kernels.cache_attention`` at Llama-3.1-8B head shapes (32 query heads, 8 KV heads, D = 128)
over a paged pool (pages of ``--page-size`` placed at random), the cache filled to its length with random rows: the
bf16 pool at its default tiling, and the same rows quantized by ``diffspec_jax.kv_quant.quantize`` read by each
fp8 variant (``fp8_upcast``: the dtype the e4m3 rows are upcast to in registers, bfloat16 = the query's, or
float16; ``block``,
``num_stages``, ``num_warps``). Each variant is timed as 20 back-to-back calls inside one jitted loop, the
variants in turn, 7 rounds, medians; the JSON gives each variant's time over the bf16 kernel's, the HBM bytes each
reads (K/V rows, scales), and how far each fp8 variant's output is from the first one's (they read the same rows:
only rounding differs).

    python3 -m benchmarks.kv_fp8_kernel_sweep --out OUT/kv_fp8_kernel_sweep.json [--cells 131072x1x1,32768x8x1]
        [--time-budget 200] [--variants all|short]           # cells: CONTEXTxBATCHxSTEPS; a PNG beside the JSON
    TINY=1 JAX_PLATFORMS=cpu python3 -m benchmarks.kv_fp8_kernel_sweep --cells 256x2x1 --out /tmp/s.json  # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (add_output_arguments, add_plot_only_argument, chained, claim_outputs, environment,
                               per_call_s, redraw, save_figure, write_json)
from diffspec_jax.kv_quant import quantize
from pallas_kernels.cache_attention import cache_attention

ROUNDS, INNER = 7, 20
#: fp8 variants: (upcast dtype, block, num_stages, num_warps); None = the kernel's default
VARIANTS = [(u, *t) for u in ("bfloat16", "float16") for t in
            [(None, None, None), (128, 2, 4), (128, 3, 4), (128, 2, 8), (256, 2, 4), (256, 2, 8), (256, 3, 8),
             (64, 3, 4)]]
#: ``--variants short``: the first sweep's (H100) best tilings, each upcast
SHORT = [("bfloat16", None, None, None), ("bfloat16", 128, 3, 4), ("float16", None, None, None),
         ("float16", 128, 3, 4), ("float16", 128, 2, 4), ("float16", 64, 3, 4), ("float16", 64, 2, 4)]


def name(v) -> str:
    u, blk, st, w = v
    return f"fp8 {u} b{blk} s{st} w{w}"


def plot(payload: dict, path) -> str | None:
    """Each variant's time over the bf16 kernel's, per cell (the bytes ratio, 8-bit over bf16, dashed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cells = [c for c in payload["cells"] if c.get("over_bf16")]
    if not cells:
        return None
    names = list(dict.fromkeys(n for c in cells for n in c["over_bf16"] if n != "bf16"))
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(cells) + 4), 4.5))
    x = np.arange(len(cells))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar(x + (i - (len(names) - 1) / 2) * w, [c["over_bf16"].get(n, np.nan) for c in cells], w,
               label=n.replace("fp8 ", ""), color=plt.cm.tab20(i % 20))
    ax.axhline(1.0, color="k", lw=0.8)
    bytes_ratio = cells[0]["bytes"]["fp8"] / cells[0]["bytes"]["bf16"]
    ax.axhline(bytes_ratio, color="gray", ls="--", lw=0.8, label=f"bytes read, fp8 / bf16 ({bytes_ratio:.2f})")
    ax.set_xticks(x, [f"{c['context'] // 1024}K x {c['batch']}, T={c['steps']}" for c in cells])
    ax.set(ylabel="time / bf16 kernel's", title="fp8 cache_attention (upcast, block, stages, warps) / bf16, paged")
    ax.legend(fontsize=6, ncol=2)
    env = payload["environment"]
    fig.suptitle(f"one layer, Llama-3.1-8B heads, {env['device']} (JAX {env['versions'].get('jax', '?')})",
                 fontsize=9)
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="131072x1x1,131072x1x5,32768x8x1,65536x1x1")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--time-budget", type=float, default=200.0)
    ap.add_argument("--variants", choices=("all", "short"), default="all")
    add_plot_only_argument(ap)
    add_output_arguments(ap, "kv_fp8_kernel_sweep.json")
    args = ap.parse_args(argv)
    if redraw(ap, args, plot, __file__):
        return 0
    outs = claim_outputs(ap, args, [args.out, Path(args.out).with_suffix(".png")], __file__)
    t0 = time.perf_counter()
    hq, hkv, d = (4, 2, 16) if os.environ.get("TINY") else (32, 8, 128)
    rng = np.random.default_rng(0)
    out = {"benchmark": "fp8 vs bf16 cache_attention kernel, per tiling and upcast (issue 41)",
           "environment": environment(sys.argv if argv is None else ["benchmarks/kv_fp8_kernel_sweep.py", *argv]),
           "heads": [hq, hkv, d], "page_size": args.page_size, "cells": []}
    for cell in args.cells.split(","):
        ctx, b, t = map(int, cell.split("x"))
        P = args.page_size
        maxp = ctx // P
        perm = rng.permutation(b * maxp).astype(np.int32)      # sequence b's page j lives at pool page perm[b, j]
        pages = jnp.asarray(perm.reshape(b, maxp))
        pool = lambda key: jax.random.normal(jax.random.PRNGKey(key), (1, hkv, b * maxp * P, d), jnp.bfloat16)
        k, v = pool(1), pool(2)
        k8, v8 = quantize(k), quantize(v)
        q = jax.random.normal(jax.random.PRNGKey(3), (b, t, hq, d), jnp.bfloat16)
        lengths = jnp.full((b,), ctx - t - 3, jnp.int32)
        common = dict(scale=d ** -0.5, causal=True, pages=pages, page_size=P)
        variants = {"bf16": (lambda q, k, v, l: cache_attention(q, k, v, l, **common), (k, v, lengths))}
        for var in (VARIANTS if args.variants == "all" else SHORT):
            u, blk, st, w = var
            variants[name(var)] = (lambda q, k, v, ks, vs, l, u=u, blk=blk, st=st, w=w: cache_attention(
                q, k, v, l, k_scale=ks, v_scale=vs, fp8_upcast=u, block=blk, num_stages=st, num_warps=w, **common),
                (k8.values, v8.values, k8.scale, v8.scale, lengths))
        errors, ready, outputs = {}, {}, {}
        for n, (f, a) in variants.items():
            if time.perf_counter() - t0 > args.time_budget:
                errors[n] = "time budget"
                continue
            try:
                timed_fn = chained(f, INNER)
                jax.block_until_ready(timed_fn(q, *a))
                outputs[n] = np.asarray(jax.jit(f)(q, *a)[0], np.float32) if n != "bf16" else None
                ready[n] = (timed_fn, a)
            except Exception as e:  # a tiling that does not fit (shared memory) is reported, not fatal
                errors[n] = f"{type(e).__name__}: {str(e)[:300]}"
        first = next((o for o in outputs.values() if o is not None), None)
        agree = {n: float(np.abs(o - first).max() / max(1e-30, np.abs(first).max()))
                 for n, o in outputs.items() if o is not None}
        times = {n: [] for n in ready}
        for _ in range(ROUNDS):
            for n, (f, a) in ready.items():
                times[n].append(per_call_s(f, q, *a, inner=INNER))
        med = {n: float(np.median(x)) for n, x in times.items()}
        base = med.get("bf16")
        rows = b * hkv * ctx
        res = {"context": ctx, "batch": b, "steps": t, "us": {n: x * 1e6 for n, x in med.items()},
               "over_bf16": {n: x / base for n, x in med.items()} if base else {},
               "bytes": {"bf16": rows * d * 2 * 2, "fp8": rows * (d + 4) * 2},
               "errors": errors,
               "max_diff_vs_first_fp8": agree}   # each fp8 variant's output against the first's, over its max
        if med:
            best = min((n for n in med if n != "bf16"), key=med.get, default=None)
            res["best_fp8"] = best
        out["cells"].append(res)
        print(json.dumps({k: res[k] for k in ("context", "batch", "steps", "best_fp8") if k in res}),
              json.dumps({n: round(x, 3) for n, x in res["over_bf16"].items()}), flush=True)
        del k, v, k8, v8
    out["elapsed_s"] = time.perf_counter() - t0
    out["figure"] = plot(out, outs[1])
    write_json(outs[0], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
