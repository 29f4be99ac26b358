"""What a user runs, end to end: the public ``generate()`` beside transformers, on the same weights, in one run.

    python benchmarks/e2e.py --contexts 8192,65536 --batches 1 --new-tokens 256 \\
        --methods target,recent,diffspec --peer --peer-compiled --out benchmarks/results/e2e_h200.json

A Llama-3.1-8B-shaped target and an EAGLE-3-shaped draft with **random bfloat16 weights** (long_context.py's
models): every time is valid; acceptance is meaningless (a random draft accepts nothing), so DiffSpec's decode is
reported as its measured cycle time and *projected* to tokens per second at the demo pair's measured acceptance
(``paired.py`` on the H200).

Per (context, batch) and method (``target`` = target-only, ``recent`` / ``diffspec`` = EAGLE-3 with that draft
context policy; K = 4, budget 2048), ``generate()`` runs twice on the same prompts: the first call compiles
(``stats.compile_s``, its wall time), the second is timed: time to first token (``stats.ttft_s``), prefill, decode
ms per token (``decode_s`` over the tokens after the first), the cycle time (``decode_s / cycles``), host syncs
and the whole call's wall time (prompt + N new tokens). Beside them, in the same process, the device steps of
long_context.py (``anatomy``: the target's decode step, and with ``--device-cycles`` the pipelined cycles of
each policy, dispatched back to back with the state donated) are the yardsticks ``generate()`` is held to, and
the HBM floor of a decode step.

Memory: each method's row holds ``memory``, the memory model's figures of the call (``GenerateStats.memory``:
weights, K/V, the rest of the state, one prefill chunk's temporaries and its width) beside the device's measured
peak (``peak_bytes_in_use``, the process's high-water mark after the calls; ``peak_is_this_method`` says whether
the calls raised it) and ``peak_over_weights_plus_kv``. ``--no-device-steps`` skips the device steps, whose own
caches would otherwise set the peak first. Issue 37's case, 64K prompts x batch 8 on one H200::

    python benchmarks/e2e.py --contexts 65536 --batches 8 --methods target --no-device-steps \
        --out benchmarks/results/e2e_64k_b8_h200.json

``--peer`` runs transformers (torch, sdpa) in a child process (long_context.py's peer): warm eager prefill, eager
decode with the dynamic cache and, with ``--peer-compiled``, StaticCache + ``torch.compile`` decode (its prefill
is the eager one). Its end-to-end latency is prefill + N x its per-token time (batch 1).

``--kv-cache-dtype fp8`` runs every ``generate()`` call on the 8-bit K/V cache (issue 41), e.g. 128K x 8, which does
not fit in bf16 on one H200::

    python benchmarks/e2e.py --contexts 131072 --batches 8 --new-tokens 64 --methods target --no-device-steps \
        --kv-cache-dtype fp8 --out OUT/e2e_128k_b8_fp8.json

``--deterministic`` passes ``SpecConfig(deterministic=True)`` to every call (target-only included), to set the
user-facing cost of the deterministic form (issue 40) beside a default run.

``--quick`` runs tiny shapes anywhere (the test suite's smoke test; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import long_context as lc  # noqa: E402
from benchmarks.common import (add_output_arguments, add_plot_only_argument, claim_outputs, copy_bandwidth,  # noqa: E402
                               environment, redraw, save_figure, write_json)

METHODS = ("target", "recent", "diffspec")
#: issue 23's targets
TARGET_LOOP_OVER_STEP, TARGET_FLOOR_RATIO = 1.05, 1.3
#: issue 37: generate()'s peak device memory at most this times its weights + the K/V it needs
PEAK_OVER_HELD = 1.1


def _spec(method: str, args):
    from diffspec_jax.config import SpecConfig

    return SpecConfig.from_flat(dict(num_speculative_tokens=args.k, draft_context_policy=method,
                                     diffspec_token_budget=args.budget, diffspec_chunk_size=args.chunk,
                                     diffspec_retrieval_interval=args.interval,
                                     deterministic=getattr(args, "deterministic", False)))


def run_method(target, draft, prompts, method: str, args) -> dict:
    """Two ``generate()`` calls (compile, then timed); what a user sees of the second."""
    from diffspec_jax import generate

    kw = dict(max_new_tokens=args.new_tokens, stop_token_ids=(), kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    if method != "target" or getattr(args, "deterministic", False):  # target-only: its steps' deterministic form
        kw["spec"] = _spec("recent" if method == "target" else method, args)
    calls = []
    peak_before = peak_memory()
    for _ in range(2):
        t0 = time.perf_counter()
        res = generate(target, None if method == "target" else draft, prompts, **kw)
        wall = time.perf_counter() - t0
        calls.append((wall, res.stats))
        del res
    (wall0, first), (wall, st) = calls
    per_seq = st.new_tokens / st.num_sequences
    out = {"method": method, "compile_call": {"wall_s": wall0, "compile_s": first.compile_s},
           "wall_s": wall, "compile_s": st.compile_s, "ttft_s": st.ttft_s, "prefill_s": st.prefill_s,
           "decode_s": st.decode_s, "new_tokens_per_sequence": per_seq, "cycles": st.cycles,
           "host_syncs": st.host_syncs, "blocks": st.blocks, "block_cycles": st.block_cycles,
           "mean_acceptance_length": st.mean_acceptance_length,
           "decode_s_per_token": st.decode_s / max(1, per_seq - 1),
           "cycle_s": st.decode_s / max(1, st.cycles), "memory": memory_row(first, st, peak_before)}
    demo = lc.demo_acceptance()
    if method != "target" and demo:
        acc = demo["diffspec"] if method == "diffspec" else demo.get("eagle3-recent", demo["diffspec"])
        out["projected"] = {"acceptance": acc, "s_per_token": out["cycle_s"] / acc,
                            "wall_s": st.ttft_s + (args.new_tokens - 1) * out["cycle_s"] / acc}
    return out


def peak_memory() -> int | None:
    """The device's peak bytes in use so far in this process (``None`` where it does not say, e.g. a CPU)."""
    from diffspec_jax.engine.memory import device_memory

    stats = device_memory()
    return None if stats is None else stats.get("peak_bytes_in_use")


def memory_row(first, st, peak_before: int | None) -> dict:
    """The memory model's figures of the timed call (``stats.memory``) beside the device's measured peak: the
    process's high-water mark after each call (``peak_bytes_in_use``; it is this method's own peak when it rose
    above ``peak_before``, the mark before its first call) and its ratio to weights + K/V (target and draft)."""
    m = st.memory or {}
    row = {k: m.get(k) for k in ("weights_bytes", "kv_bytes", "draft_bytes", "state_bytes", "prefill_temp_bytes",
                                 "prefill_width", "prefill_chunks", "bytes_limit", "bytes_in_use")}
    peak = max((p for p in (first.peak_bytes_in_use, st.peak_bytes_in_use) if p is not None), default=None)
    row.update(peak_bytes_in_use=peak, compile_call_peak_bytes_in_use=first.peak_bytes_in_use,
               timed_call_peak_bytes_in_use=st.peak_bytes_in_use, peak_before_bytes=peak_before,
               peak_is_this_method=None if peak is None else peak_before is None or peak > peak_before)
    held = (m.get("weights_bytes") or 0) + (m.get("kv_bytes") or 0) + (m.get("draft_bytes") or 0)
    row["peak_over_weights_plus_kv"] = peak / held if peak and held else None
    return row


def device_steps(target, dcfg, dparams, ctx, batch, bw, args) -> dict:
    """long_context.py's anatomy at this case (``--device-cycles``: with the draft and the cycles)."""
    ns = SimpleNamespace(k=args.k, budget=args.budget, chunk=args.chunk, interval=args.interval,
                         repeats=args.repeats, inner=args.inner, iters=args.iters, steps_only=not args.device_cycles)
    row = lc.anatomy(target, dcfg, dparams, ctx, batch, ns)
    row["hbm_floor_s"] = row["decode_step_bytes"] / bw["bytes_per_s"]
    keep = ("target_decode_step_s", "target_verify_step_s", "hbm_floor_s", "cycle_full_s", "cycle_diffspec_s",
            "cycle_diffspec_with_retrieval_s", "verify_over_decode")
    return {k: row[k] for k in keep if k in row}


def finalize(payload: dict, args) -> dict:
    """Ratios to the device steps and to transformers, and issue 23's targets."""
    peer = {p["context"]: p for p in payload["peer"] if "error" not in p}
    targets = {}
    n = args.new_tokens
    for case in payload["cases"]:
        dev, m = case.get("device", {}), {r["method"]: r for r in case["methods"]}
        tgt = m.get("target")
        key = f"{case['context']}x{case['batch']}"
        if tgt and "target_decode_step_s" in dev:
            r = tgt["decode_s_per_token"] / dev["target_decode_step_s"]
            tgt["over_device_step"] = r
            tgt["over_hbm_floor"] = tgt["decode_s_per_token"] / dev["hbm_floor_s"]
            targets[f"target_only_{key}_within_{TARGET_LOOP_OVER_STEP}x_device_step"] = {
                "value": r, "met": r <= TARGET_LOOP_OVER_STEP}
            targets[f"target_only_{key}_le_{TARGET_FLOOR_RATIO}x_hbm_floor"] = {
                "value": tgt["over_hbm_floor"], "ms_per_token": tgt["decode_s_per_token"] * 1e3,
                "met": tgt["over_hbm_floor"] <= TARGET_FLOOR_RATIO}
        for meth, dkey in (("diffspec", "cycle_diffspec_with_retrieval_s"), ("recent", None)):
            row = m.get(meth)
            if row and dkey and dkey in dev:
                r = row["cycle_s"] / dev[dkey]
                row["cycle_over_device_cycle"] = r
                targets[f"{meth}_{key}_cycle_within_{TARGET_LOOP_OVER_STEP}x_device_cycle"] = {
                    "value": r, "met": r <= TARGET_LOOP_OVER_STEP}
            if row and tgt and "projected" in row:
                row["projected"]["speedup_over_target_only"] = tgt["wall_s"] / row["projected"]["wall_s"]
        for meth, row in m.items():
            mem = row.get("memory") or {}
            if mem.get("peak_over_weights_plus_kv") is not None and mem.get("peak_is_this_method"):
                targets[f"generate_{key}_{meth}_peak_within_{PEAK_OVER_HELD}x_weights_plus_kv"] = {
                    "value": mem["peak_over_weights_plus_kv"], "peak_bytes": mem["peak_bytes_in_use"],
                    "met": mem["peak_over_weights_plus_kv"] <= PEAK_OVER_HELD}
        p = peer.get(case["context"]) if case["batch"] == 1 else None
        if p:
            pre = p.get("eager_prefill_warm_s", p.get("eager_prefill_s"))
            case["transformers"] = {"prefill_s": pre}
            for kind in ("eager", "compiled"):
                if f"{kind}_s_per_token" in p:
                    case["transformers"][f"{kind}_s_per_token"] = p[f"{kind}_s_per_token"]
                    case["transformers"][f"{kind}_wall_s"] = pre + n * p[f"{kind}_s_per_token"]
            if tgt and "compiled_wall_s" in case["transformers"]:
                theirs = case["transformers"]["compiled_wall_s"]
                targets[f"e2e_{key}_target_only_faster_than_transformers_compiled"] = {
                    "ours_s": tgt["wall_s"], "theirs_s": theirs, "ratio": theirs / tgt["wall_s"],
                    "met": tgt["wall_s"] < theirs}
            ds = m.get("diffspec")
            if ds and "projected" in ds and tgt:
                targets[f"e2e_{key}_diffspec_projected_speedup_over_target_only"] = {
                    "value": ds["projected"]["speedup_over_target_only"],
                    "at_acceptance": ds["projected"]["acceptance"],
                    "met": ds["projected"]["speedup_over_target_only"] > 1}
    payload["targets"] = targets
    return payload


def plot(payload: dict, path: Path) -> str | None:
    """End-to-end latency per method and peer (left) and decode ms per token against the device step (right)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cases = sorted((c for c in payload["cases"] if c["batch"] == 1), key=lambda c: c["context"])  # device: optional
    if not cases:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{c['context'] // 1024}K" for c in cases]
    series = [("target-only", lambda c, m: m.get("target", {}).get("wall_s")),
              ("DiffSpec, projected*", lambda c, m: m.get("diffspec", {}).get("projected", {}).get("wall_s")),
              ("transformers eager", lambda c, m: c.get("transformers", {}).get("eager_wall_s")),
              ("transformers compiled", lambda c, m: c.get("transformers", {}).get("compiled_wall_s"))]
    values = [(name, f"C{i}", [get(c, {r["method"]: r for r in c["methods"]}) for c in cases])
              for i, (name, get) in enumerate(series)]
    values = [v for v in values if any(y is not None for y in v[2])]  # a series this run did not measure: no bar
    series = values
    width = 0.8 / len(series)
    for i, (name, color, ys) in enumerate(values):
        xs = [j + i * width for j, y in enumerate(ys) if y is not None]
        ax[0].bar(xs, [y for y in ys if y is not None], width, label=name, color=color)
    ax[0].set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(cases))], labels)
    ax[0].set(title=f"Prompt + {payload['settings']['new_tokens']} new tokens, batch 1", ylabel="seconds",
              xlabel="prompt length")
    ax[0].legend(fontsize=8)
    x = np.arange(len(cases))
    get = lambda key, c, meth="target": next((r.get(key) for r in c["methods"] if r["method"] == meth), None)  # noqa
    ax[1].plot(x, [1e3 * (get("decode_s_per_token", c) or np.nan) for c in cases], "o-", label="generate() target-only")
    ax[1].plot(x, [1e3 * c.get("device", {}).get("target_decode_step_s", np.nan) for c in cases], "s--",
               label="device decode step (benchmark)")
    ax[1].plot(x, [1e3 * c.get("device", {}).get("hbm_floor_s", np.nan) for c in cases], ":", label="HBM floor")
    ax[1].plot(x, [1e3 * (get("cycle_s", c, "diffspec") or np.nan) for c in cases], "^-",
               label="generate() DiffSpec cycle")
    dev_cycle = [1e3 * c.get("device", {}).get("cycle_diffspec_with_retrieval_s", np.nan) for c in cases]
    if not np.isnan(dev_cycle).all():
        ax[1].plot(x, dev_cycle, "v--", label="device DiffSpec cycle (benchmark)")
    ax[1].set_xticks(x, labels)
    ax[1].set(title="Decode: what generate() sustains vs the device step", ylabel="ms", xlabel="prompt length")
    ax[1].legend(fontsize=8)
    for a in ax:
        a.grid(alpha=0.3)
    env = payload["environment"]
    fig.suptitle(f"Llama-3.1-8B shapes, random bf16 weights, {env['device']} (JAX {env['versions'].get('jax', '?')}); "
                 "*DiffSpec at the demo pair's measured acceptance", fontsize=9)
    return save_figure(fig, path, dpi=110)


def write(payload: dict, outs, args) -> None:
    """The figure and the JSON (``outs``: their claimed output files)."""
    finalize(payload, args)
    payload["figure"] = plot(payload, outs[1])
    write_json(outs[0], payload)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"of {METHODS}")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device-cycles", action="store_true", help="also time the pipelined device cycles")
    ap.add_argument("--no-device-steps", action="store_true",
                    help="skip the device steps (their caches would set the process's peak memory before generate())")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="generate()'s K/V storage (fp8: issue 41; the device steps keep bf16 caches)")
    ap.add_argument("--deterministic", action="store_true",
                    help="every generate() call with SpecConfig(deterministic=True) (issue 40; the device steps keep "
                         "the default form)")
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--peer-compiled", action="store_true")
    ap.add_argument("--peer-tokens", type=int, default=24)
    ap.add_argument("--peer-timeout-s", type=float, default=400.0)
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="start no case after this many seconds")
    ap.add_argument("--quick", action="store_true")
    add_output_arguments(ap, "benchmarks/results/e2e.json")
    add_plot_only_argument(ap)
    args = ap.parse_args(argv)
    if redraw(ap, args, plot, __file__):
        return 0
    methods = [m for m in args.methods.split(",") if m]
    if set(methods) - set(METHODS):
        ap.error(f"--methods takes names of {METHODS}, got {args.methods!r}")
    t_start = time.perf_counter()
    out = claim_outputs(ap, args, [args.out, Path(args.out).with_suffix(".png")], __file__)
    tcfg, dcfg = lc.shapes(args.quick)
    target = lc.random_target(tcfg)
    dparams = lc.random_draft(dcfg, target)
    from diffspec_jax.draft import DraftModel

    draft = DraftModel(config=dcfg, params=dparams, aux_layers=dcfg.resolve_aux_layers(tcfg))
    bw = copy_bandwidth(16 << 20 if args.quick else 2 << 30)
    payload = {"benchmark": "end to end: generate() vs transformers", "note": lc.RANDOM_NOTE,
               "environment": environment(sys.argv), "settings": vars(args), "copy_bandwidth": bw,
               "target_config": tcfg.to_hf_dict(), "draft_config": dcfg.to_hf_dict(),
               "weight_sha256": lc.weight_hashes(target.params), "cases": [], "peer": [], "not_run": [],
               "timing": {"generate": "the second of two identical calls (the first compiles); decode_s_per_token = "
                                      "decode_s / (new tokens per sequence - 1)",
                          "transformers": "wall = warm eager prefill + N x per-token time (batch 1)",
                          "projected": "DiffSpec: ttft + (N - 1) x cycle time / the demo pair's acceptance"}}
    contexts = [int(x) for x in args.contexts.split(",")]
    for b in sorted((int(x) for x in args.batches.split(",")), key=lambda b: b != 1):
        for ctx in contexts:
            if args.time_budget_s and time.perf_counter() - t_start > args.time_budget_s:
                payload["not_run"].append({"context": ctx, "batch": b, "why": "--time-budget-s reached"})
                continue
            rng = np.random.default_rng(ctx * 31 + b)
            prompts = [rng.integers(0, tcfg.vocab_size, ctx).tolist() for _ in range(b)]
            case = {"context": ctx, "batch": b, "methods": []}
            try:
                if not args.no_device_steps:
                    case["device"] = device_steps(target, dcfg, dparams, ctx, b, bw, args)
                    gc.collect()
                for meth in methods:
                    case["methods"].append(run_method(target, draft, prompts, meth, args))
                    gc.collect()
                    row = case["methods"][-1]
                    print({k: v for k, v in row.items() if not isinstance(v, dict)},
                          {k: row["memory"][k] for k in ("peak_bytes_in_use", "peak_over_weights_plus_kv",
                                                         "prefill_width", "prefill_chunks")}, flush=True)
            except Exception as e:  # noqa: BLE001 - recorded; the next case may still fit
                case["error"] = f"{type(e).__name__}: {e}"[:2000]
                print("error:", case["error"], flush=True)
                if not payload["cases"] and not case["methods"]:
                    write(payload, out, args)
                    raise
            payload["cases"].append(case)
            write(payload, out, args)
            gc.collect()
    if args.peer:
        todo = [c for c in contexts if c <= 131072]
        del target, draft, dparams
        gc.collect()
        rows, info = lc.run_peer(todo, SimpleNamespace(peer_tokens=args.peer_tokens, peer_compiled=args.peer_compiled,
                                                        quick=args.quick, peer_timeout_s=args.peer_timeout_s),
                                 payload["weight_sha256"], lambda rows: None)
        payload["peer"], payload["peer_run"] = rows, info
    write(payload, out, args)
    print(json.dumps(payload["targets"], indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
