"""The cost of bit-exact speculation (``SpecConfig.deterministic``, issue 40): the target's decode and chain-verify
steps in the default form and in the deterministic one, side by side in one run.

    python -m benchmarks.deterministic_steps --cells 8192x1,32768x1,65536x1,131072x1,8192x8,32768x8 \\
        --out benchmarks/results/deterministic_steps_h200.json
    python -m benchmarks.deterministic_steps --quick --out /tmp/det_steps.json      # tiny shapes (smoke test)

The Llama-3.1-8B-shaped target of ``long_context.py`` with **random bfloat16 weights**, a cache filled with random
values at committed length ``CONTEXT`` (contiguous, ``generate()``'s default, or paged with ``--page-size``, the
server's). Per cell and form:

* **decode**: what one target-only token costs. Default: a step of 1 row. Deterministic: a step of K + 1 rows, of
  which one is used (``engine.verify._target_cycle``: target-only decoding runs verify-shaped blocks so that its
  matrix products round as a verify row's do).
* **verify**: a chain verify step of K + 1 rows in each form.

Deterministic steps are traced under :func:`pallas_kernels.common.use_deterministic` (fixed-tile attention, float32
residual adds) and compiled with :func:`diffspec_jax.engine.compile.compiler_options` of a deterministic plan
(``xla_allow_excess_precision`` off), exactly as the engine does. Timing: ``long_context.pipelined`` (calls
dispatched back to back, cache donated), ``--rounds`` ABBA rounds, the median of the rounds' medians; ``ratio`` =
deterministic / default. Issue 40's line: the deterministic form becomes the GPU default if every ratio is <= 1.03.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import long_context as lc
from benchmarks.common import add_output_arguments, claim_outputs, environment, reference_line, save_figure, write_json
from benchmarks.paged_steps import make_caches, parse_cells, reach

#: issue 40: the deterministic form is the GPU default if it costs at most this factor of the default step
DEFAULT_IF_RATIO = 1.03
FORMS = ("default", "deterministic")


def _jitted(tc, det: bool):
    """The target's step, traced in the given form (the cache donated)."""
    from diffspec_jax.engine.compile import DETERMINISTIC_COMPILER_OPTIONS
    from diffspec_jax.models import llama
    from pallas_kernels.common import use_deterministic

    def step(params, cache, toks, start, rows):
        with use_deterministic(det):
            return llama.step(tc, params, cache, toks, start, rows)

    opts = dict(DETERMINISTIC_COMPILER_OPTIONS) if det else None
    return jax.jit(step, donate_argnums=(1,), compiler_options=opts)


def step_cell(target, ctx: int, batch: int, args) -> dict:
    """Decode and verify steps of one (context, batch) in both forms, alternating."""
    tc, k = target.config, args.k
    capacity = reach(ctx + 64 * (k + 1) + 64, args.page_size)
    kind = "paged" if args.paged else "contiguous"
    start = jnp.full((batch,), ctx, jnp.int32)
    holders, calls = {}, {}
    for f in FORMS:
        holders[f] = {"cache": lc.fill_random(make_caches(tc, batch, capacity, args.page_size, seed=ctx)[kind])}
        step = _jitted(tc, f == "deterministic")
        calls[f] = {}
        for name, n_tok in (("decode", 1 if f == "default" else k + 1), ("verify", k + 1)):
            toks = jnp.ones((batch, n_tok), jnp.int32)
            rows = jnp.broadcast_to(jnp.arange(n_tok, dtype=jnp.int32), (batch, n_tok))

            def call(step=step, h=holders[f], toks=toks, rows=rows):
                o, h["cache"] = step(target.params, h["cache"], toks, start, rows)
                return o.logits

            calls[f][name] = call
    raw = {n: {f: [] for f in FORMS} for n in ("decode", "verify")}
    for r in range(args.rounds):
        for f in (FORMS if r % 2 == 0 else FORMS[::-1]):
            for name in raw:
                raw[name][f].append(lc.pipelined(calls[f][name], repeats=args.repeats, inner=args.inner)["median_s"])
    del calls, holders
    gc.collect()
    row = {"context": ctx, "batch": batch, "cache": kind, "capacity": capacity, "tokens_per_verify": k + 1,
           "rounds": args.rounds}
    for name, per in raw.items():
        s = {f: statistics.median(per[f]) for f in FORMS}
        s["ratio"] = s["deterministic"] / s["default"]
        s["round_ratios"] = [d / a for a, d in zip(per["default"], per["deterministic"])]
        row[f"{name}_step_s"] = s
    return row


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def plot(payload: dict, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cells = payload["cells"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for i, name in enumerate(("decode", "verify")):
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(cells))], [c[f"{name}_step_s"]["ratio"] for c in cells], 0.4,
               label=f"{name} step")
    reference_line(ax, "1.0x")
    reference_line(ax, f"default-on line {DEFAULT_IF_RATIO}x", DEFAULT_IF_RATIO)
    ax.set_xticks(range(len(cells)), [f"{_tokens(c['context'])} x {c['batch']}" for c in cells])
    ax.set(title="deterministic / default target step time", ylabel="ratio")
    ax.set_ylim(0.0, max([1.2] + [c[f"{n}_step_s"]["ratio"] * 1.1 for c in cells for n in ("decode", "verify")]))
    ax.legend(fontsize=8)
    env = payload["environment"]
    fig.suptitle(f"Llama-3.1-8B-shaped target, random bf16 weights, {env['device']} "
                 f"(JAX {env['versions'].get('jax', '?')})", fontsize=9)
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="8192x1,32768x1,65536x1,131072x1,8192x8,32768x8",
                    help="CONTEXTxBATCH cells, run in this order")
    ap.add_argument("--k", type=int, default=4, help="draft tokens: the verify step runs K + 1")
    ap.add_argument("--paged", action="store_true", help="a paged cache (the server's) instead of contiguous")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds per cell")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--inner", type=int, default=10, help="calls dispatched back to back per timed repeat")
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="start nothing past this many seconds (0: none)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test; timings meaningless)")
    add_output_arguments(ap, "benchmarks/results/deterministic_steps.json")
    args = ap.parse_args(argv)
    if args.quick and args.cells == ap.get_default("cells"):
        args.cells, args.page_size, args.repeats, args.inner = "256x1,256x2", 16, 2, 2
    try:
        cells = parse_cells(args.cells)
    except ValueError as exc:
        ap.error(f"--cells: {exc}")
    t0 = time.perf_counter()
    outs = claim_outputs(ap, args, [args.out, Path(args.out).with_suffix(".png")], __file__)
    tcfg, _ = lc.shapes(args.quick)
    payload = {"benchmark": "deterministic vs default target steps (issue 40)", "note": lc.RANDOM_NOTE,
               "environment": environment(sys.argv if argv is None else ["benchmarks/deterministic_steps.py", *argv]),
               "settings": vars(args), "target_config": tcfg.to_hf_dict(),
               "weights": "random bfloat16 (normal, std 0.02), seed 0", "cells": [], "not_run": []}
    target = lc.random_target(tcfg)
    for ctx, batch in cells:
        if args.time_budget_s and time.perf_counter() - t0 > args.time_budget_s:
            payload["not_run"].append({"context": ctx, "batch": batch, "why": "--time-budget-s reached"})
            continue
        try:
            row = step_cell(target, ctx, batch, args)
        except Exception as exc:  # recorded (e.g. out of memory); the other cells go on
            payload["not_run"].append({"context": ctx, "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            gc.collect()
            continue
        payload["cells"].append(row)
        print({k: v for k, v in row.items()}, flush=True)
        worst = max(c[f"{n}_step_s"]["ratio"] for c in payload["cells"] for n in ("decode", "verify"))
        payload["worst_ratio"] = worst
        payload["default_on"] = worst <= DEFAULT_IF_RATIO
        payload["figure"] = plot(payload, outs[1])
        write_json(outs[0], payload)
    write_json(outs[0], payload)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s; worst ratio {payload.get('worst_ratio')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
