"""Paged against contiguous cache attention, per kernel tiling (Llama-3.1-8B head shapes, bf16, GPU).

Each variant is timed as 20 back-to-back calls inside one jitted loop, the variants in turn, 7 rounds, medians;
pages placed at random in the pool. Environment: ``OUT`` (directory of paged_kernel_sweep.json), ``SWEEP_S``
(time budget, default 150), ``CELLS`` (``CTXxBATCH,...``), ``TINY=1`` (small head shapes: a CPU smoke run).
Results of issue 37: benchmarks/results/paged_h200/kernel_sweep/ (docs/serving.md).

    OUT=out python3 benchmarks/paged_kernel_sweep.py
"""
import json, os, time
import jax, jax.numpy as jnp, numpy as np
from benchmarks.common import chained, per_call_s
from pallas_kernels.cache_attention import cache_attention

OUT = os.environ.get("OUT", "."); BUDGET = float(os.environ.get("SWEEP_S", "150")); t0 = time.perf_counter()
out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "cells": []}

rng = np.random.default_rng(0)
hq, hkv, d = (32, 8, 128) if not os.environ.get("TINY") else (4, 2, 16)
CELLS = [tuple(map(int, c.split("x"))) for c in os.environ.get("CELLS", "32768x8,8192x8,65536x1,131072x1").split(",")]
for ctx, b in CELLS:
    k = jax.random.normal(jax.random.PRNGKey(1), (b, hkv, ctx, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(2), (b, hkv, ctx, d), jnp.bfloat16)
    lengths = jnp.full((b,), ctx - 8, jnp.int32)
    for P in (64, 128):
        maxp = ctx // P
        perm = rng.permutation(b * maxp).astype(np.int32)
        inv = np.empty_like(perm); inv[perm] = np.arange(perm.size)
        tr = lambda x: jnp.transpose(x.reshape(b, hkv, maxp, P, d), (1, 0, 2, 3, 4)).reshape(hkv, b * maxp, P, d)[:, jnp.asarray(inv)].reshape(1, hkv, b * maxp * P, d)
        kp, vp, pages = tr(k), tr(v), jnp.asarray(perm.reshape(b, maxp))
        for t in (1, 5):
            if time.perf_counter() - t0 > BUDGET:
                break
            q = jax.random.normal(jax.random.PRNGKey(3), (b, t, hq, d), jnp.bfloat16)
            variants = {"contiguous": (chained(lambda q, k, v, l: cache_attention(q, k, v, l, scale=0.088, causal=True)), (k, v, lengths))}
            tilings = [(None, None)] + ([(64, 3), (64, 4), (128, 2), (128, 3)] if t == 5 else [(64, 3), (128, 2)])
            for blk, st in tilings:
                variants[f"paged b{blk} s{st}"] = (chained(lambda q, k, v, l, pg, blk=blk, st=st: cache_attention(
                    q, k, v, l, scale=0.088, causal=True, pages=pg, page_size=P, block=blk, num_stages=st)),
                    (kp, vp, lengths, pages))
            times = {n: [] for n in variants}
            for n, (f, a) in variants.items():
                jax.block_until_ready(f(q, *a))
            for rep in range(7):
                for n, (f, a) in variants.items():
                    times[n].append(per_call_s(f, q, *a))
            base = float(np.median(times["contiguous"]))
            cell = {"context": ctx, "batch": b, "t": t, "page": P, "contiguous_us": base * 1e6,
                    "ratios": {n: float(np.median(x)) / base for n, x in times.items() if n != "contiguous"}}
            out["cells"].append(cell); print(json.dumps(cell), flush=True)
        del kp, vp
    del k, v
json.dump(out, open(os.path.join(OUT, "paged_kernel_sweep.json"), "w"), indent=1)
print("sweep", time.perf_counter() - t0, "s")
