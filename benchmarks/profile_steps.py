"""Where a target step's device time goes: kernel-by-kernel GPU time of prefill, decode and verify steps.

Runs each case under ``jax.profiler.trace`` and reads the trace back with ``jax.profiler.ProfileData`` (no
TensorBoard needed): per kernel name, its total device time and call count, and per case the sum of kernel time
against the span from the first kernel's start to the last one's end (the gap is launch latency and idle time).

Cases (Llama-3.1-8B shapes, random bf16 weights, as ``benchmarks/long_context.py``):
    ``prefill:CTX``  one ``generate()`` of a CTX-token prompt, ``max_new_tokens=1`` (second call; the first compiles)
    ``decode:CTX:B`` / ``verify:CTX:B``  ``--iters`` target steps of 1 / K + 1 tokens over a CTX-row cache

    python benchmarks/profile_steps.py --cases prefill:65536,decode:8192:1,verify:8192:8 --out OUT.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import glob
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402


def kernel_table(trace_dir: str, top: int) -> dict:
    """Per-kernel device time from the trace under ``trace_dir`` (every GPU plane, every stream line)."""
    from jax.profiler import ProfileData

    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    data = ProfileData.from_file(path)
    total, count = collections.Counter(), collections.Counter()
    first, last, n = None, None, 0
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for ev in line.events:
                total[ev.name] += ev.duration_ns
                count[ev.name] += 1
                n += 1
                end = ev.start_ns + ev.duration_ns
                first = ev.start_ns if first is None else min(first, ev.start_ns)
                last = end if last is None else max(last, end)
    busy = sum(total.values())
    span = (last - first) if n else 0
    rows = [{"kernel": k[:160], "ms": v / 1e6, "calls": count[k], "share": v / busy if busy else 0.0}
            for k, v in total.most_common(top)]
    return {"kernels": n, "busy_ms": busy / 1e6, "span_ms": span / 1e6, "busy_fraction": busy / span if span else None,
            "top": rows}


def _traced(fn, top: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
        out = kernel_table(d, top)
    return {"wall_ms": wall * 1e3, **out}


def prefill_case(target, ctx: int, top: int) -> dict:
    from diffspec_jax import generate

    prompt = np.random.default_rng(ctx).integers(0, target.config.vocab_size, ctx).tolist()
    run = lambda: generate(target, None, [prompt], max_new_tokens=1, stop_token_ids=())  # noqa: E731
    res = run()
    return {"compile_s": res.stats.compile_s, **_traced(run, top)}


def step_case(target, dcfg, ctx: int, batch: int, n_tok: int, iters: int, top: int) -> dict:
    from benchmarks.long_context import _filled_state, _plans
    from diffspec_jax.models import llama

    args = argparse.Namespace(k=max(1, n_tok - 1), budget=2048, chunk=64, interval=4)
    plan = _plans(target.config, dcfg, ctx, args)["full"]
    st = _filled_state(plan, batch, ctx)
    step = jax.jit(functools.partial(llama.step, target.config), donate_argnums=(1,))
    toks = jnp.ones((batch, n_tok), jnp.int32)
    rows = jnp.broadcast_to(jnp.arange(n_tok, dtype=jnp.int32), (batch, n_tok))
    holder = {"cache": st.target_cache}
    start = st.length
    del st

    def run():
        for _ in range(iters):
            o, holder["cache"] = step(target.params, holder["cache"], toks, start, rows)
        o.logits.block_until_ready()

    run()
    out = _traced(run, top)
    out["per_step_ms"] = out["span_ms"] / iters
    del holder
    gc.collect()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="prefill:65536,decode:8192:1,verify:8192:8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    common.add_output_arguments(ap, "benchmarks/results/profile_steps.json")
    args = ap.parse_args(argv)
    out, = common.claim_outputs(ap, args, [args.out], __file__)
    from benchmarks.long_context import random_target, shapes

    tcfg, dcfg = shapes(args.quick)
    target = random_target(tcfg)
    cases = {}
    for case in args.cases.split(","):
        kind, *nums = case.split(":")
        nums = [int(x) for x in nums]
        if kind == "prefill":
            cases[case] = prefill_case(target, nums[0], args.top)
        else:
            cases[case] = step_case(target, dcfg, nums[0], nums[1], 1 if kind == "decode" else args.k + 1, args.iters,
                                    args.top)
        c = cases[case]
        print(f"{case}: span {c['span_ms']:.2f} ms, kernels {c['kernels']}, busy {c['busy_fraction']}", flush=True)
        for r in c["top"][:12]:
            print(f"   {r['ms']:9.3f} ms {r['calls']:6d}  {r['kernel'][:110]}", flush=True)
    common.write_json(out, {"environment": common.environment(sys.argv), "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
