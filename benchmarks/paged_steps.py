"""Paged vs contiguous K/V: the target's decode and chain-verify steps and its prefill, side by side (issue 37).

    python benchmarks/paged_steps.py --cells 8192x1,65536x1,131072x1,8192x8,32768x8 --prefill-contexts 65536 \\
        --out benchmarks/results/paged_steps_h200.json
    python benchmarks/paged_steps.py --quick --out /tmp/paged_steps.json        # tiny shapes anywhere (smoke test)

The Llama-3.1-8B-shaped target of ``long_context.py`` with **random bfloat16 weights** (a step's cost does not
depend on the values). Per ``CONTEXTxBATCH`` cell, two caches of the same reach, both filled with random values:

* contiguous: :func:`diffspec_jax.cache.create_cache`, ``[B, Hkv, S, D]`` per layer;
* paged: :func:`diffspec_jax.cache.create_paged_cache`, one pool ``[1, Hkv, (N + 1) * P, D]`` per layer with exactly the
  pages the batch needs (``N = B x pages per sequence``, ``P = --page-size``) and a page table that is a random
  permutation of the pool's pages (no sequence's pages are adjacent or in order).

The target's step of 1 token (decode) and of K + 1 tokens (chain verify) runs against each at committed length
``CONTEXT`` (the calls dispatched back to back with the cache donated, one wait per repeat: ``long_context.py``'s
``pipelined``), in ``--rounds`` rounds in ABBA order (contiguous first in even rounds, paged first in odd ones);
the reported time is the median of the rounds' medians, and ``ratio`` = paged / contiguous.

Prefill (``--prefill-contexts``, batch 1): the library's chunked prefill (:func:`diffspec_jax.target.prefill`) of a
random prompt into a fresh contiguous cache and into a paged one (random page table), at each ``--prefill-widths``
(``auto``: the width ``generate()`` picks, one chunk up to the flash limit; a number: that many tokens per chunk,
2048 being the server's), a compiling call each, then ``--prefill-repeats`` timed calls per cache in alternation;
and ``generate()``'s own prefill of the same length (``long_context.prefill_case``: today's path, contiguous).

**8-bit K/V** (issue 41): ``--kv-cache-dtypes auto,fp8`` adds each layout's fp8 cache (``float8_e4m3fn`` rows
with a float32 scale per token and KV head, :mod:`diffspec_jax.kv_quant`) as more variants (``paged-fp8``,
``contiguous-fp8``), timed in the same rounds; ``--layouts`` picks the layouts (``paged`` alone: the server's, and
half the memory of both). A variant whose cache or step does not fit is recorded under the cell's ``errors`` and the
others still run (bf16 at 128K x 8 needs 137 GB of K/V). Each cell records its caches' bytes and the device's
peak memory so far (``peak_bytes_in_use``, where the device reports it). Issue 41's run on one H200::

    python benchmarks/paged_steps.py --layouts paged --kv-cache-dtypes auto,fp8 \
        --cells 131072x1,65536x1,32768x8,131072x8 --prefill-contexts '' --out benchmarks/results/kv_fp8_steps.json

The JSON (and PNG beside it) is rewritten after every cell; ``--time-budget-s`` starts nothing past the budget
(``not_run``). ``targets`` holds issue 37's lines: every step's ratio <= 1.05, the paged prefill <= 1.05 x
``generate()``'s; and, with fp8 variants, issue 41's: each fp8 decode step <= 0.75 x the bf16 decode step at 128K x 1
of the same layout, and 128K x 8 running in fp8.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import long_context as lc
from benchmarks.common import add_output_arguments, claim_outputs, environment, matmul_peak, save_figure, write_json

#: issue 37: paged steps and prefill within this factor of the contiguous ones
TARGET_RATIO = 1.05
#: issue 41: an fp8 decode step at most this times the bf16 one at 128K x 1, in these (context, batch) cells
TARGET_FP8_RATIO = 0.75
FP8_CELLS = ((65536, 1), (131072, 1), (32768, 8))
LAYOUTS = ("contiguous", "paged")
#: the default variants (issue 37's pair): a variant is a layout, with ``-fp8`` for an 8-bit cache
VARIANTS = LAYOUTS


def parse_cells(text: str) -> list[tuple[int, int]]:
    """``"8192x1,32768x8"`` -> ``[(8192, 1), (32768, 8)]`` (``""``: none, a prefill-only run)."""
    cells = []
    for item in filter(str.strip, text.split(",")):
        ctx, _, batch = item.strip().lower().partition("x")
        cells.append((int(ctx), int(batch or 1)))
    return cells


def random_pages(batch: int, max_pages: int, seed: int) -> np.ndarray:
    """A page table ``[batch, max_pages]`` over a pool of exactly ``batch x max_pages`` pages: a random
    permutation, so consecutive positions of a sequence land on scattered pages."""
    return np.random.default_rng(seed).permutation(batch * max_pages).reshape(batch, max_pages).astype(np.int32)


def reach(need: int, page_size: int) -> int:
    """Positions per sequence for both caches: ``need`` rounded up to whole pages and whole attention tiles (the
    contiguous cache's capacity rounding), so the two have the same reach."""
    from diffspec_jax.cache import ATTENTION_TILE

    unit = max(page_size, ATTENTION_TILE)  # both powers of two: the larger is a multiple of the smaller
    return -(-need // unit) * unit


def variants_of(layouts: str, kv_cache_dtypes: str) -> tuple[str, ...]:
    """``"contiguous,paged"``, ``"auto,fp8"`` -> ``("contiguous", "paged", "contiguous-fp8", "paged-fp8")``."""
    lay = [x.strip() for x in layouts.split(",") if x.strip()]
    kvd = [x.strip() for x in kv_cache_dtypes.split(",") if x.strip()]
    bad = [x for x in lay if x not in LAYOUTS] + [x for x in kvd if x not in ("auto", "fp8")]
    if bad or not lay or not kvd:
        raise ValueError(f"layouts are {LAYOUTS} and K/V dtypes auto / fp8, got {layouts!r} / {kv_cache_dtypes!r}")
    return tuple(layout + ("-fp8" if d == "fp8" else "") for d in kvd for layout in lay)


def make_cache(tc, variant: str, batch: int, capacity: int, page_size: int, seed: int):
    """The cache of one variant (``paged`` / ``contiguous``, ``-fp8``: 8-bit rows) of reach ``capacity`` (whole
    pages); a paged one has exactly the pages the batch needs and a random page table."""
    from diffspec_jax.cache import create_cache, create_paged_cache

    layout, _, kind = variant.partition("-")
    kv = "fp8" if kind == "fp8" else "auto"
    if layout == "contiguous":
        return create_cache(tc, batch, capacity, jnp.bfloat16, kv_cache_dtype=kv)
    max_pages = capacity // page_size
    paged = create_paged_cache(tc, batch, batch * max_pages, page_size, max_pages, jnp.bfloat16, kv_cache_dtype=kv)
    return paged.replace(pages=jnp.asarray(random_pages(batch, max_pages, seed)))


def make_caches(tc, batch: int, capacity: int, page_size: int, seed: int, variants=VARIANTS) -> dict:
    """``{variant: cache}`` of the same reach (``capacity``, whole pages) (:func:`make_cache`)."""
    return {v: make_cache(tc, v, batch, capacity, page_size, seed) for v in variants}


def _abba(rounds: int, variants=VARIANTS):
    """Variant order per round: as given in even rounds, reversed in odd ones."""
    return [tuple(variants) if r % 2 == 0 else tuple(variants)[::-1] for r in range(rounds)]


def _summary(per_round: dict[str, list[float]]) -> dict:
    """Median per variant; ``ratio`` paged / contiguous (issue 37; ``None`` unless both ran) and ``over_first``
    each variant over the first one that ran (the baseline: bf16 before fp8)."""
    ran = [v for v, ts in per_round.items() if ts]
    out = {v: statistics.median(per_round[v]) for v in ran}
    both = "paged" in out and "contiguous" in out
    out["ratio"] = out["paged"] / out["contiguous"] if both else None
    out["round_ratios"] = [p / c for p, c in zip(per_round["paged"], per_round["contiguous"])] if both else []
    out["over_first"] = {v: out[v] / out[ran[0]] for v in ran} if ran else {}
    return out


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:1000]


def step_cell(target, ctx: int, batch: int, args) -> dict:
    """Decode and chain-verify steps of one (context, batch) on every variant's cache, alternating; a variant that
    does not fit (its cache, or its first steps) is recorded in ``errors`` and left out of the rounds."""
    from diffspec_jax.engine.memory import tree_bytes

    tc, k = target.config, args.k
    ps = args.page_size
    variants = getattr(args, "variants", VARIANTS)
    capacity = reach(ctx + 64 * (k + 1) + 64, ps)  # long_context's capacity
    start = jnp.full((batch,), ctx, jnp.int32)
    names = {1: "decode", k + 1: "verify"}
    holders, calls, errors, cache_bytes = {}, {}, {}, {}
    for v in variants:
        try:
            holders[v] = {"cache": lc.fill_random(make_cache(tc, v, batch, capacity, ps, seed=ctx + batch))}
            cache_bytes[v] = tree_bytes(holders[v]["cache"])
            calls[v] = lc.step_calls(target, holders[v], start, batch, (1, k + 1))
            for call in calls[v].values():  # compile and run once here: a step that does not fit fails now
                jax.block_until_ready(call())
        except Exception as exc:  # noqa: BLE001 - recorded (out of memory, typically), the others still run
            errors[v] = _error(exc)
            holders.pop(v, None), calls.pop(v, None)
            gc.collect()
    ran = [v for v in variants if v in calls]
    raw = {n: {v: [] for v in ran} for n in names.values()}
    stats = {n: {v: [] for v in ran} for n in names.values()}
    for order in _abba(args.rounds, ran):
        for v in order:
            for n_tok, name in names.items():
                s = lc.pipelined(calls[v][n_tok], repeats=args.repeats, inner=args.inner)
                raw[name][v].append(s["median_s"])
                stats[name][v].append(s)
    pool_pages = {v: int(h["cache"].pages.size) for v, h in holders.items() if h["cache"].paged}
    del calls, holders
    gc.collect()
    row = {"context": ctx, "batch": batch, "capacity": capacity, "page_size": ps,
           "pool_pages": pool_pages.get("paged", next(iter(pool_pages.values()), None)),
           "tokens_per_verify": k + 1, "rounds": args.rounds, "variants": ran, "errors": errors,
           "cache_bytes": cache_bytes, "peak_bytes_in_use": _peak_bytes()}
    for name in names.values():
        row[f"{name}_step_s"] = _summary(raw[name])
    row["stats"] = stats
    return row


def _peak_bytes() -> int | None:
    """The device's peak bytes in use so far in this process (``None`` where it does not say)."""
    from diffspec_jax.engine.memory import device_memory

    mem = device_memory()
    return None if mem is None else mem.get("peak_bytes_in_use")


def prefill_cell(target, ctx: int, width: str, args) -> dict:
    """Batch-1 prefill of a random ``ctx``-token prompt into a contiguous and a paged cache, alternating."""
    from diffspec_jax.target import plan_prefill, prefill
    from pallas_kernels.common import use_kernels

    tc, ps = target.config, args.page_size
    chunk = None if width == "auto" else int(width)
    with use_kernels("auto"):
        w, n_chunks = plan_prefill([ctx], chunk)
    capacity = reach(ctx + 64, ps)
    variants = getattr(args, "variants", VARIANTS)
    caches = make_caches(tc, 1, capacity, ps, seed=ctx, variants=variants)
    prompt = [np.random.default_rng(ctx).integers(0, tc.vocab_size, ctx).tolist()]
    runs = {v: [] for v in variants}
    compile_call = {}

    def run(v):
        t0 = time.perf_counter()
        logits, caches[v] = prefill(target, caches[v], prompt, chunk=chunk)
        jax.block_until_ready(logits)
        return time.perf_counter() - t0, logits

    firsts = {}
    for v in variants:  # the compiling calls
        compile_call[v], firsts[v] = run(v)
    agree = {v: float(jnp.max(jnp.abs(firsts[v] - firsts[variants[0]]))) for v in variants[1:]}
    del firsts
    for order in _abba(args.prefill_repeats, variants):
        for v in order:
            runs[v].append(run(v)[0])
    del caches
    gc.collect()
    out = {"context": ctx, "batch": 1, "width": w, "chunks": n_chunks, "width_arg": width, "page_size": ps,
           "first_call_s": compile_call, "runs_s": runs,
           "max_abs_logit_difference": agree.get("paged") if variants == VARIANTS else agree}
    out.update(_summary(runs))
    return out


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def targets(payload: dict) -> dict:
    """Issue 37's lines from the measured rows, and issue 41's where fp8 variants ran."""
    out = {}
    for c in payload["cells"]:
        for name in ("decode", "verify"):
            r = c[f"{name}_step_s"].get("ratio")
            if r is None:
                continue
            out[f"paged_{name}_{_tokens(c['context'])}_b{c['batch']}_le_{TARGET_RATIO}x"] = {
                "value": r, "met": r <= TARGET_RATIO}
    out.update(fp8_targets(payload["cells"]))
    gen = {g["context"]: g for g in payload["generate_prefill"]}
    for p in payload["prefill"]:
        today = gen.get(p["context"])
        if today is None or "paged" not in p:
            continue
        r = p["paged"] / today["prefill_s"]
        p["paged_over_generate"] = r
        out[f"paged_prefill_{_tokens(p['context'])}_width_{p['width']}_le_{TARGET_RATIO}x_generate"] = {
            "value": r, "met": r <= TARGET_RATIO, "paged_s": p["paged"], "generate_prefill_s": today["prefill_s"],
            "paged_over_contiguous": p.get("ratio")}
    return out


def fp8_targets(cells: list[dict]) -> dict:
    """Issue 41: the fp8 decode step of each of :data:`FP8_CELLS` over the bf16 decode step at 128K x 1 of the same
    layout (<= 0.75), and whether 128K x 8 ran in fp8 (with the bf16 cache's error when it did not fit)."""
    out, base = {}, {}
    for c in cells:
        if (c["context"], c["batch"]) == (131072, 1):
            base = {v: c["decode_step_s"][v] for v in c.get("variants", []) if not v.endswith("-fp8")}
    for c in cells:
        for v in c.get("variants", []) if (c["context"], c["batch"]) in FP8_CELLS else ():
            layout, _, kind = v.partition("-")
            if kind != "fp8" or layout not in base:
                continue
            t = c["decode_step_s"][v]
            r = t / base[layout]
            out[f"{v}_decode_{_tokens(c['context'])}_b{c['batch']}_le_{TARGET_FP8_RATIO}x_bf16_128k_b1"] = {
                "value": r, "met": r <= TARGET_FP8_RATIO, "fp8_s": t, "bf16_128k_b1_s": base[layout]}
        if (c["context"], c["batch"]) == (131072, 8):
            for v in [x for x in c.get("variants", []) + list(c.get("errors", {})) if x.endswith("-fp8")]:
                out[f"{v}_runs_128k_b8"] = {"value": v in c.get("variants", []), "met": v in c.get("variants", []),
                                            "bf16_error": c.get("errors", {}).get(v.partition("-")[0])}
    return out


def plot(payload: dict, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cells, pre = payload["cells"], payload["prefill"]
    panels = [kind for kind, rows in (("steps", cells), ("prefill", pre)) if rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + 1, 4.2), squeeze=False)
    axes = dict(zip(panels, axes[0]))
    if cells:  # the decode step of each variant; the verify step's beside it, hollow
        a, x = axes["steps"], np.arange(len(cells))
        variants = list(dict.fromkeys(v for c in cells for v in c.get("variants", VARIANTS)))
        width = 0.8 / max(1, len(variants))
        for i, v in enumerate(variants):
            off = (i - (len(variants) - 1) / 2) * width
            a.bar(x + off, [1e3 * c["decode_step_s"].get(v, np.nan) for c in cells], width, label=f"{v} decode")
            a.bar(x + off, [1e3 * c["verify_step_s"].get(v, np.nan) for c in cells], width, fill=False,
                  edgecolor="gray", label=f"{v} verify" if i == 0 else None)
        for xi, c in zip(x, cells):
            for v, why in c.get("errors", {}).items():
                a.annotate(f"{v}: did not run", (xi, 0.0), textcoords="offset points", xytext=(0, 3), ha="center",
                           fontsize=7, rotation=90)
        a.set_xticks(x, [f"{_tokens(c['context'])} x {c['batch']}" for c in cells])
        a.set(title=f"target step time (page size {payload['settings']['page_size']})", ylabel="ms")
        a.legend(fontsize=7)
    if pre:  # each variant's chunked prefill, and generate()'s where it ran
        b, xp = axes["prefill"], np.arange(len(pre))
        pv = list(dict.fromkeys(v for p in pre for v in p.get("runs_s", {}) if p["runs_s"][v]))
        gen = {g["context"]: g["prefill_s"] for g in payload["generate_prefill"]}
        bars = [(f"{v} (target.prefill)", [p.get(v, np.nan) for p in pre]) for v in pv]
        if gen:
            bars.append(("generate() today", [gen.get(p["context"], np.nan) for p in pre]))
        w = 0.8 / len(bars)
        for i, (label, ys) in enumerate(bars):
            b.bar(xp + (i - (len(bars) - 1) / 2) * w, ys, w, label=label)
        b.set_xticks(xp, [f"{_tokens(p['context'])}, width {p['width']}" for p in pre])
        b.legend(fontsize=8)
        b.set(title="prefill, batch 1", ylabel="s")
    env = payload["environment"]
    shape = "tiny target (--quick)" if payload["settings"]["quick"] else "Llama-3.1-8B-shaped target"
    fig.suptitle(f"{shape}, random bf16 weights, {env['device']} (JAX "
                 f"{env['versions'].get('jax', '?')})", fontsize=10)
    return save_figure(fig, path)


def write(payload: dict, outs) -> None:
    payload["targets"] = targets(payload)
    payload["figure"] = plot(payload, outs[1]) if payload["cells"] or payload["prefill"] else None
    write_json(outs[0], payload)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="8192x1,65536x1,131072x1,8192x8,32768x8",
                    help="CONTEXTxBATCH cells, run in this order")
    ap.add_argument("--page-size", type=int, default=128,
                    help="tokens per page (the server's --block-size; 128 is its default on a GPU)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="K/V layouts to time: contiguous and/or paged")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="K/V storage per layout: auto (bf16) and/or fp8 (8-bit rows, issue 41), side by side")
    ap.add_argument("--k", type=int, default=4, help="draft tokens: the verify step runs K + 1")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds per cell")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--inner", type=int, default=10, help="calls dispatched back to back per timed repeat")
    ap.add_argument("--prefill-contexts", default="65536", help="batch-1 prefill lengths ('' for none)")
    ap.add_argument("--prefill-widths", default="auto,2048",
                    help="chunk widths: auto (generate()'s) and/or numbers (2048: the server's)")
    ap.add_argument("--prefill-repeats", type=int, default=2, help="timed prefill calls per cache")
    ap.add_argument("--no-generate", action="store_true", help="skip generate()'s prefill (today's reference)")
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="start nothing past this many seconds (0: none)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test; timings meaningless)")
    add_output_arguments(ap, "benchmarks/results/paged_steps.json")
    args = ap.parse_args(argv)
    if args.quick:  # small defaults for what the command line leaves at its defaults
        defaults = ap.parse_args([])
        for key, value in (("cells", "256x1,256x2"), ("prefill_contexts", "256"), ("prefill_widths", "auto,64"),
                           ("page_size", 16), ("repeats", 2), ("inner", 2), ("prefill_repeats", 1)):
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    try:
        cells = parse_cells(args.cells)
        prefill_contexts = [int(x) for x in args.prefill_contexts.split(",") if x.strip()]
        widths = [w.strip() for w in args.prefill_widths.split(",") if w.strip()]
        for w in widths:
            if w != "auto":
                int(w)
        args.variants = variants_of(args.layouts, args.kv_cache_dtypes)
    except ValueError as exc:
        ap.error(f"--cells / --prefill-contexts / --prefill-widths / --layouts / --kv-cache-dtypes: {exc}")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        ap.error(f"--page-size must be a power of two, got {args.page_size}")
    t_start = time.perf_counter()
    outs = claim_outputs(ap, args, [args.out, Path(args.out).with_suffix(".png")], __file__)
    tcfg, _ = lc.shapes(args.quick)
    env = environment(sys.argv if argv is None else ["benchmarks/paged_steps.py", *argv])
    env["script_sha256"] = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    payload = {"benchmark": "paged vs contiguous K/V (issue 37), bf16 vs fp8 K/V (issue 41): target steps and prefill",
               "note": lc.RANDOM_NOTE,
               "environment": env, "settings": vars(args), "target_config": tcfg.to_hf_dict(),
               "weights": "random bfloat16 (normal, std 0.02), seed 0",
               "timing": {"steps": "long_context.pipelined: calls dispatched back to back, cache donated, one wait "
                                   "per repeat; per variant the median over --rounds ABBA rounds of each round's "
                                   "median; ratio = paged / contiguous",
                          "prefill": "diffspec_jax.target.prefill into a fresh cache (wall, logits waited for), "
                                     "after one compiling call per cache; generate_prefill: long_context."
                                     "prefill_case (generate(), max_new_tokens=1, its stats.prefill_s)"},
               "cells": [], "prefill": [], "generate_prefill": [], "not_run": []}
    target = lc.random_target(tcfg)
    payload["weight_sha256"] = lc.weight_hashes(target.params)
    print(f"setup {time.perf_counter() - t_start:.1f} s", flush=True)
    # the steps, then per prefill length its first width (auto first), generate()'s prefill, its other widths
    widths.sort(key=lambda w: w != "auto")
    work = [("step", c, b) for c, b in cells]
    for c in prefill_contexts:
        work += [("prefill", c, w) for w in widths[:1]] + ([] if args.no_generate else [("generate", c, None)])
        work += [("prefill", c, w) for w in widths[1:]]
    measured = 0
    for kind, ctx, extra in work:
        if args.time_budget_s and time.perf_counter() - t_start > args.time_budget_s:
            payload["not_run"].append({"kind": kind, "context": ctx, "batch_or_width": extra,
                                       "why": "--time-budget-s reached"})
            continue
        t0 = time.perf_counter()
        try:
            if kind == "step":
                row = step_cell(target, ctx, extra, args)
                payload["cells"].append(row)
            elif kind == "prefill":
                row = prefill_cell(target, ctx, extra, args)
                payload["prefill"].append(row)
            else:
                if "matmul_peak" not in payload:
                    payload["matmul_peak"] = matmul_peak(256 if args.quick else 8192)
                pre_args = argparse.Namespace(prefill_repeats=args.prefill_repeats)
                row = lc.prefill_case(target, ctx, 1, payload["matmul_peak"]["flop_per_s"], pre_args)
                payload["generate_prefill"].append(row)
        except Exception as exc:  # recorded; a failure before anything succeeded ends the run (fail fast)
            payload["not_run"].append({"kind": kind, "context": ctx, "batch_or_width": extra,
                                       "error": f"{type(exc).__name__}: {exc}"[:2000]})
            write(payload, outs)
            if not measured:
                raise
            gc.collect()
            continue
        measured += 1
        row["wall_seconds"] = time.perf_counter() - t0
        write(payload, outs)
        print({k: v for k, v in row.items() if k not in ("stats", "runs", "flops")}, flush=True)
        gc.collect()
    write(payload, outs)
    for name, t in payload["targets"].items():
        print(f"{name}: {t['value']:.3f} ({'met' if t['met'] else 'NOT met'})")
    print(f"wrote {args.out} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
