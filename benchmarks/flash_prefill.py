"""Causal flash attention of a whole prompt over itself (a prefill's first chunk), implementation by implementation.

    python benchmarks/flash_prefill.py [--contexts 8192,32768,65536,131072] [--batches 1] [--out FILE] [--quick]

One layer of Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16), the prompt attending
causally to itself, timed on the device (calls chained inside one jitted loop, so host dispatch is excluded):

* ``cudnn_lse``: what prefill runs today (:func:`diffspec_jax.models.attention.flash_causal`: cuDNN through its
  lower-level call, returning the float32 log-sum-exp the chunk merge and chunk scoring read);
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, no statistics returned;
* ``mosaic_lse`` / ``mosaic``: JAX's Mosaic GPU (Hopper, warp-specialised) flash attention
  (``jax.experimental.pallas.ops.gpu.attention_mgpu``), with and without its residuals, on float16 copies of the
  operands (its shared-memory tiles are float16), the query pre-scaled;

each checked against ``cudnn_lse`` on the same inputs (relative error of the output), and reported as TFLOP/s
(``2 * B * Hq * D * T^2`` for causal attention) beside the fraction of the bf16 matmul peak measured in the same
run. Implementations a GPU cannot run (not Hopper, a compile failure) are reported with their error; off GPUs only
``cudnn_lse`` runs, as the dense stand-in of :func:`~diffspec_jax.models.attention.flash_causal`. ``--quick`` runs a
tiny shape (a smoke test; timings mean nothing there).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (add_output_arguments, claim_outputs, environment, matmul_peak, rel_err,  # noqa: E402
                               time_device, write_json)
from diffspec_jax.models.attention import flash_causal  # noqa: E402


def _mosaic(q, k, v, scale, *, lse, block_kv):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mg

    cfg = mg.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=True)
    f16 = jnp.float16
    res = mg.attention((q * scale).astype(f16), k.astype(f16), v.astype(f16), cfg, save_residuals=lse)
    if not lse:
        return res.astype(q.dtype)
    out, (lse2,) = res
    return out.astype(q.dtype), jnp.swapaxes(lse2, 1, 2) * np.float32(np.log(2.0))


def implementations(scale: float) -> dict:
    """name -> fn(q, k, v) returning ``out`` or ``(out, lse [B, T, Hq])``."""
    impls = {"cudnn_lse": lambda q, k, v: flash_causal(q, k, v, scale)}  # off GPUs: its dense stand-in
    if jax.default_backend() != "gpu":
        return impls
    impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                                  implementation="cudnn")
    for bkv in (128, 64):
        impls[f"mosaic_lse_kv{bkv}"] = functools.partial(_mosaic, scale=scale, lse=True, block_kv=bkv)
        impls[f"mosaic_kv{bkv}"] = functools.partial(_mosaic, scale=scale, lse=False, block_kv=bkv)
    return impls


def bench(b, t, hq, hkv, d, quick) -> list[dict]:
    key = jax.random.PRNGKey(t + b)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, t, hq, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, t, hkv, d), jnp.bfloat16)
    scale = d ** -0.5
    flops = 2 * b * hq * d * t * t
    rows, want = [], None
    for name, fn in implementations(scale).items():
        row = {"impl": name, "batch": b, "tokens": t, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "flops": flops}
        try:
            got = jax.jit(fn)(q, k, v)
            out = got[0] if isinstance(got, tuple) else got
            if want is None:
                want = got
            row["rel_err_out"] = rel_err(out, want[0])
            if isinstance(got, tuple):
                row["rel_err_lse"] = rel_err(got[1], want[1])

            def step(carry, fn=fn):
                q_, acc = carry
                r = fn(q_ + (acc * 0).astype(q_.dtype), k, v)
                o = r[0] if isinstance(r, tuple) else r
                return q_, acc + o[0, 0, 0, 0].astype(jnp.float32)
            # the timing loop donates its carry: a copy, so the next implementation still has q
            tm = time_device(step, (jnp.copy(q), jnp.zeros((), jnp.float32)), iters=2 if quick else 4,
                             repeats=2 if quick else 3)
            row.update(tm, tflops=flops / tm["median_s"] / 1e12)
        except Exception as e:  # noqa: BLE001 - an implementation this machine cannot run is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        rows.append(row)
        print(f"{name:<18} b={b} T={t:<7} " + (f"{row['median_s'] * 1e3:9.2f} ms {row['tflops']:7.1f} TFLOP/s "
                                               f"err {row['rel_err_out']:.1e}" if "median_s" in row
                                               else row.get("error", "")), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--batches", default="1")
    add_output_arguments(ap, "benchmarks/results/flash_prefill.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    out, = claim_outputs(ap, args, [args.out], __file__)
    env = environment(sys.argv)
    peak = matmul_peak(256, 2) if args.quick else matmul_peak()
    print(f"bf16 matmul peak {peak['flop_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    shapes = [(1, 128, 4, 2, 64)] if args.quick else [
        (b, t, 32, 8, 128) for b in (int(x) for x in args.batches.split(",")) for t in
        (int(x) for x in args.contexts.split(","))]
    for b, t, hq, hkv, d in shapes:  # the JSON is rewritten after every shape: a cut-off run keeps what it measured
        for r in bench(b, t, hq, hkv, d, args.quick):
            if "tflops" in r:
                r["fraction_of_matmul_peak"] = r["tflops"] * 1e12 / peak["flop_per_s"]
            rows.append(r)
        write_json(out, {"benchmark": "causal flash attention of a prompt over itself", "environment": env,
                         "matmul_peak": peak, "results": rows, "quick": args.quick})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
