"""Target decode-step ablation: KV cache layout x fused projections, side by side on the same weights.

Why the target cache is ``[B, Hkv, S, D]`` and why :func:`diffspec_jax.load_target` fuses q/k/v and gate/up
(issue 8's HBM-floor target). Variants of one Llama-3.1-8B-shaped step (random bf16, one GPU):

* ``library``: :func:`diffspec_jax.models.llama.step` with the serving (fused) params, the shipped path;
* ``library-checkpoint-layout``: the same step with the checkpoint layout (separate q/k/v, gate/up);
* ``positions-first`` / ``heads-first``, each with or without ``+fused``: a self-contained step written here
  with the cache as ``[B, S, Hkv, D]`` (the layout before this change) or ``[B, Hkv, S, D]``.

For each (context, batch): pipelined step times at T = 1 (decode) and T = K + 1 (verify), compiled memory
(temporaries) and, for chosen cases, a device trace summarised per kernel (count, time per step). Writes one JSON
(rewritten after every measurement). Usage on a GPU machine from the repository root::

    PYTHONPATH=. JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        python3 benchmarks/decode_ablation.py --out benchmarks/results/decode_ablation_h200.json

``--quick`` runs tiny shapes (the CPU smoke test). Random weights: timings are valid, logits meaningless.
"""

from __future__ import annotations

import argparse
import functools
import gc
import glob
import json
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import long_context as lc  # noqa: E402
from benchmarks.common import add_output_arguments, claim_outputs, copy_bandwidth, environment, write_json  # noqa: E402
from diffspec_jax.cache import KVCache, round_capacity  # noqa: E402
from diffspec_jax.models import llama  # noqa: E402
from diffspec_jax.models.layers import (NEG_INF, _dot_operands, apply_rope, causal_mask, embed_lookup,  # noqa: E402
                                        rms_norm, rope_cos_sin)

VARIANTS = ("library", "library-checkpoint-layout", "positions-first", "positions-first+fused", "heads-first",
            "heads-first+fused")


def ablation_step(cfg, params, ck, cv, tokens, start, *, heads_first: bool):
    """One cached step written out in full (no aux / scoring outputs): projections fused or not (whatever
    ``params`` holds), the cache ``[B, Hkv, S, D]`` (``heads_first``) or ``[B, S, Hkv, D]``. Returns the last
    row's logits and the updated buffers."""
    b, t = tokens.shape
    nkv, d = cfg.num_key_value_heads, cfg.head_dim
    g = cfg.num_attention_heads // nkv
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    cos, sin = rope_cos_sin(pos, cfg.rope.inv_freq(d))
    mask = causal_mask(pos, ck[0].shape[2 if heads_first else 1])
    bidx = jnp.broadcast_to(jnp.arange(b)[:, None], pos.shape)
    kv_eq = "bksd" if heads_first else "bskd"
    x = embed_lookup(params["embed"], tokens)
    new_k, new_v = [], []
    for i, lp in enumerate(params["layers"]):
        q, k, v = llama._project_qkv(lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if heads_first:
            idx = (bidx[:, :, None], jnp.arange(nkv)[None, None, :], pos[:, :, None])
        else:
            idx = (bidx, pos)
        kb, vb = ck[i].at[idx].set(k, mode="drop"), cv[i].at[idx].set(v, mode="drop")
        s = jnp.einsum(f"btkgd,{kv_eq}->bkgts", *_dot_operands(q.reshape(b, t, nkv, g, d), kb),
                       preferred_element_type=jnp.float32) * d ** -0.5
        s = jnp.where(mask[:, None, None], s, NEG_INF)
        p = jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True)).astype(vb.dtype)
        o = jnp.einsum(f"bkgts,{kv_eq}->btkgd", *_dot_operands(p, vb), preferred_element_type=jnp.float32)
        o = o.astype(x.dtype)
        x = x + jnp.einsum("btnd,ndh->bth", o.reshape(b, t, -1, d), lp["wo"])
        x = x + llama.mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps))
        new_k.append(kb)
        new_v.append(vb)
    x = rms_norm(x[:, -1:], params["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("bth,hv->btv", x, params["lm_head"], preferred_element_type=jnp.float32)
    return logits, tuple(new_k), tuple(new_v)


def _layout(variant: str) -> tuple[bool, bool]:
    """(heads_first, fused) of a variant."""
    if variant.startswith("library"):
        return True, variant == "library"
    return variant.startswith("heads-first"), variant.endswith("+fused")


def _step_fn(cfg, variant):
    if variant.startswith("library"):
        return jax.jit(functools.partial(llama.step, cfg), donate_argnums=(1,))
    return jax.jit(functools.partial(ablation_step, cfg, heads_first=_layout(variant)[0]), donate_argnums=(1, 2))


def _buffer_shape(cfg, batch, cap, heads_first):
    return ((batch, cfg.num_key_value_heads, cap, cfg.head_dim) if heads_first
            else (batch, cap, cfg.num_key_value_heads, cfg.head_dim))


def random_buffers(cfg, batch, cap, heads_first):
    """Random bf16 K and V buffers per layer; the same values in either layout."""
    shape = _buffer_shape(cfg, batch, cap, True)
    swap = (lambda x: x) if heads_first else (lambda x: jnp.swapaxes(x, 1, 2))
    fill = jax.jit(lambda key: swap((jax.random.normal(key, shape, jnp.float32) * 0.5).astype(jnp.bfloat16)))
    keys = jax.random.split(jax.random.PRNGKey(3), 2 * cfg.num_hidden_layers)
    n = cfg.num_hidden_layers
    return tuple(fill(keys[i]) for i in range(n)), tuple(fill(keys[n + i]) for i in range(n))


def variant_call(cfg, variant, params, batch, cap):
    """``(call, holder)``: ``call(tokens, start)`` runs one step of ``variant`` on fresh random buffers (held and
    updated in ``holder``) and returns the last row's float32 logits ``[B, 1, V]``. ``params``: the fused params
    (variants without ``fused`` get the checkpoint layout)."""
    heads_first, fused = _layout(variant)
    p = params if fused else llama.split_projections(cfg, params)
    k, v = random_buffers(cfg, batch, cap, heads_first)
    holder = {"k": k, "v": v}
    return functools.partial(_call, _step_fn(cfg, variant), variant, p, holder), holder


def _call(fn, variant, params, holder, toks, start):
    if variant.startswith("library"):
        rows = jnp.full((toks.shape[0], 1), toks.shape[1] - 1, jnp.int32)
        out, cache = fn(params, KVCache(k=holder["k"], v=holder["v"]), toks, start, rows)
        holder["k"], holder["v"] = cache.k, cache.v
        return out.logits
    logits, holder["k"], holder["v"] = fn(params, holder["k"], holder["v"], toks, start)
    return logits


def kernel_summary(trace_dir: str, steps: int, top: int = 25) -> dict:
    """Per-kernel counts and device microseconds per step from a ``jax.profiler`` trace (GPU planes only)."""
    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        return {}
    out = {}
    for plane in ProfileData.from_file(files[0]).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            events = list(line.events)
            if not events:
                continue
            agg = defaultdict(lambda: [0, 0.0])
            for e in events:
                agg[e.name][0] += 1
                agg[e.name][1] += e.duration_ns
            span = max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events)
            out[f"{plane.name} {line.name}"] = {
                "kernels_per_step": len(events) / steps, "span_ms_per_step": span / 1e6 / steps,
                "busy_ms_per_step": sum(a[1] for a in agg.values()) / 1e6 / steps,
                "top": [{"kernel": k, "calls_per_step": c / steps, "us_per_step": ns / 1e3 / steps}
                        for k, (c, ns) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(ap, "benchmarks/results/decode_ablation_h200.json")
    ap.add_argument("--cases", default="8192x1,65536x1,32768x8", help="CTXxBATCH,...")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tokens", default="1,5", help="new tokens per step (decode, verify)")
    ap.add_argument("--trace", default="8192x1,32768x8", help="cases whose T=1 steps are traced per kernel")
    ap.add_argument("--memory", default="65536x8", help="cases compiled (not run) for the memory report")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    args = ap.parse_args(argv)
    out, = claim_outputs(ap, args, [args.out], __file__)
    variants = args.variants.split(",")
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}")
    tcfg, _ = lc.shapes(args.quick)
    params = {"fused": lc.random_target(tcfg).params}
    params["checkpoint"] = jax.eval_shape(lambda p: llama.split_projections(tcfg, p), params["fused"])
    payload = {"benchmark": "target decode step: cache layout x fused projections", "environment": environment(
        sys.argv), "settings": vars(args), "target_config": tcfg.to_hf_dict(), "note": lc.RANDOM_NOTE,
        "copy_bandwidth": copy_bandwidth(16 << 20 if args.quick else 2 << 30), "memory": [], "times": [],
        "traces": []}
    kv_per_token = 2 * tcfg.num_hidden_layers * tcfg.num_key_value_heads * tcfg.head_dim * 2
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params["fused"])) - params["fused"]["embed"].nbytes

    for case in filter(None, args.memory.split(",")):
        ctx, batch = map(int, case.split("x"))
        cap = round_capacity(ctx + 384)
        for variant in variants:
            heads_first, fused = _layout(variant)
            p = jax.eval_shape(lambda x: x, params["fused" if fused else "checkpoint"])
            bufs = tuple(jax.ShapeDtypeStruct(_buffer_shape(tcfg, batch, cap, heads_first), jnp.bfloat16)
                         for _ in range(tcfg.num_hidden_layers))
            toks, start = jax.ShapeDtypeStruct((batch, 1), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)
            fn = _step_fn(tcfg, variant)
            args_ = ((p, KVCache(k=bufs, v=bufs), toks, start, jax.ShapeDtypeStruct((batch, 1), jnp.int32))
                     if variant.startswith("library") else (p, bufs, bufs, toks, start))
            ma = fn.lower(*args_).compile().memory_analysis()
            rec = {"case": case, "variant": variant, **{k: getattr(ma, k) / 2 ** 30 for k in (
                "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")}}
            payload["memory"].append(rec)
            print(json.dumps(rec), flush=True)
        write_json(out, payload)

    traced = set(filter(None, args.trace.split(",")))
    for case in filter(None, args.cases.split(",")):
        ctx, batch = map(int, case.split("x"))
        cap = round_capacity(ctx + 384)
        floor_s = (weight_bytes + batch * ctx * kv_per_token) / payload["copy_bandwidth"]["bytes_per_s"]
        for variant in variants:
            step, holder = variant_call(tcfg, variant, params["fused"], batch, cap)
            start = jnp.full((batch,), ctx, jnp.int32)
            for t in map(int, args.tokens.split(",")):
                call = functools.partial(step, jnp.ones((batch, t), jnp.int32), start)
                try:
                    st = lc.pipelined(call, repeats=args.repeats, inner=args.inner)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it, go on
                    rec = {"case": case, "variant": variant, "tokens": t, "error": repr(e)[:400]}
                else:
                    rec = {"case": case, "variant": variant, "tokens": t, "ms": st["median_s"] * 1e3, "cv": st["cv"],
                           "hbm_floor_ms": floor_s * 1e3, "over_floor": st["median_s"] / floor_s}
                    if t == 1 and case in traced:
                        tdir = tempfile.mkdtemp(prefix="decode_trace_")
                        with jax.profiler.trace(tdir):
                            for _ in range(5):
                                o = call()
                            jax.block_until_ready(o)
                        payload["traces"].append({"case": case, "variant": variant, "tokens": t,
                                                  "per_line": kernel_summary(tdir, 5)})
                        shutil.rmtree(tdir, ignore_errors=True)
                payload["times"].append(rec)
                print(json.dumps(rec), flush=True)
                write_json(out, payload)
            del holder, call, step
            gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
