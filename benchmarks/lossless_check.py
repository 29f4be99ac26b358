"""Greedy losslessness on an accelerator: speculative vs target-only output, and why they differ when they do.

    python benchmarks/lossless_check.py --pair diffspec_jax/demo/pair --out RESULT.json

Speculative greedy decoding emits the target's argmax of each verified row; target-only decoding the argmax of
each single-token step. Mathematically equal, the two differ numerically: the verify step runs K+1 rows through
matrix products of another shape, and on GPUs the reduction order (and so the rounding) of a product depends on
its shape. At a near-tie between the two best tokens the argmax can flip, after which the sequences diverge.
This script measures it: for each dtype (bfloat16 as served; float32 with full-precision products) it decodes the
same prompts both ways and, at the first divergence, recomputes the target's logits in float32 (highest precision,
full-sequence forward) and reports the gap between the two competing tokens. A divergence is a numerical near-tie
when that gap is below ``--tie-tolerance``; anything larger would be a bug, and makes the run fail (exit 1).

``--modes default,deterministic`` runs both settings of :attr:`diffspec_jax.SpecConfig.deterministic` side by side
(each speculative run against target-only decoding under the same setting); in the deterministic mode any divergence
fails the run. ``--shapes 8b`` checks Llama-3.1-8B shapes with random bf16 weights, where nearly every step is a
near-tie. Each run's decode and prefill times are kept (``times``), so the deterministic mode's cost is measured in
the same run.

    python -m benchmarks.lossless_check --dtypes bfloat16 --prompts 16 --context 3000 --new-tokens 512 \
        --policies full,recent,diffspec,self --modes default,deterministic --out RESULT.json
    python -m benchmarks.lossless_check --shapes 8b --cases 8192x1,8192x8,65536x1 --new-tokens 256 \
        --policies diffspec,self --modes default,deterministic --out RESULT.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_output_arguments, claim_outputs, environment, write_json  # noqa: E402
from diffspec_jax.generate import first_divergence  # noqa: E402


def tie_gap(target_f32, prompt: list[int], prefix: list[int], tok_a: int, tok_b: int) -> dict:
    """Float32 (highest precision) logits after ``prompt + prefix``: the gap between two candidate tokens."""
    import diffspec_jax as dj

    with jax.default_matmul_precision("highest"):
        logits = np.asarray(dj.forward(target_f32, [prompt + prefix])[0, -1], np.float64)
    top2 = np.sort(logits)[-2:]
    return {"gap": float(abs(logits[tok_a] - logits[tok_b])), "top2_margin": float(top2[1] - top2[0]),
            "logit_scale": float(np.abs(logits).max())}


POLICIES = ("full", "recent", "diffspec", "self")


def _spec(policy: str | None, deterministic: bool, dj):
    """The SpecConfig of a method: target-only (``None``), an EAGLE-3 policy, or ``self`` (self + diffspec)."""
    flat = dict(deterministic=deterministic)
    if policy is not None:
        flat["draft_context_policy"] = "diffspec" if policy == "self" else policy
    return dj.SpecConfig.from_flat(flat)


def _timed(result) -> dict:
    st = result.stats
    return {"decode_s": st.decode_s, "prefill_s": st.prefill_s, "compile_s": st.compile_s,
            "new_tokens": sum(len(t) for t in result.tokens)}


def compare(dj, target, draft, prompts, args, label: dict, target_f32=None, prompt_ids=None) -> tuple[list, list, bool]:
    """Target-only and each policy's speculative greedy output, per mode; rows per (mode, policy, prompt), timings
    per (mode, method); ``ok`` False on a divergence that is no near-tie (with ``target_f32``) or, in the
    deterministic mode, on any divergence."""
    rows, times, ok = [], [], True
    kw = dict(max_new_tokens=args.new_tokens, stop_token_ids=())
    for mode in args.modes.split(","):
        det = mode == "deterministic"
        base = dj.generate(target, None, prompts, spec=_spec(None, det, dj), **kw)
        times.append({**label, "mode": mode, "method": "target-only", **_timed(base)})
        for policy in args.policies.split(","):
            d = "self" if policy == "self" else draft
            out = dj.generate(target, d, prompts, spec=_spec(policy, det, dj), **kw)
            times.append({**label, "mode": mode, "method": policy, **_timed(out),
                          "acceptance": out.stats.mean_acceptance_length})
            for i, (a, b) in enumerate(zip(base.tokens, out.tokens)):
                j = first_divergence(a, b)
                row = {**label, "mode": mode, "policy": policy, "prompt": i, "identical": j is None,
                       "first_divergence": j}
                if j is not None:
                    if target_f32 is not None:
                        row.update(tie_gap(target_f32, prompt_ids[i], a[:j], a[j], b[j]))
                        row["near_tie"] = row["gap"] <= args.tie_tolerance
                        ok = ok and (row["near_tie"] and not det)
                    else:
                        ok = ok and not det
                rows.append(row)
            n_div = sum(1 for r in rows[-len(prompts):] if not r["identical"])
            print(f"{label} {mode} {policy}: {n_div}/{len(prompts)} differ; acceptance "
                  f"{out.stats.mean_acceptance_length:.2f}", flush=True)
    return rows, times, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="diffspec_jax/demo/pair")
    add_output_arguments(ap, "benchmarks/results/lossless_check.json")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tie-tolerance", type=float, default=0.05)
    ap.add_argument("--no-ties", action="store_true",
                    help="skip the float32 tie analysis of each divergence (one full forward, and a compile, each)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="the demo pair's dtypes (comma-separated)")
    ap.add_argument("--policies", default="full,diffspec",
                    help=f"comma-separated, of {', '.join(POLICIES)} (self: self-drafting with diffspec)")
    ap.add_argument("--modes", default="default",
                    help="comma-separated: default (SpecConfig.deterministic off) and/or deterministic")
    ap.add_argument("--shapes", choices=("demo", "8b"), default="demo",
                    help="demo: the pair's prompts; 8b: Llama-3.1-8B shapes with random bf16 weights (every logit "
                         "a near-tie), random prompts, no tie analysis")
    ap.add_argument("--cases", default="8192x1", help="8b: CONTEXTxBATCH cases, in order (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="8b: tiny shapes (tests)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: skip the 8b cases that start after this much wall time")
    args = ap.parse_args(argv)
    out, = claim_outputs(ap, args, [args.out], __file__)
    import time

    import diffspec_jax as dj

    t0 = time.perf_counter()
    rows, times, ok, skipped = [], [], True, []
    payload = {"check": "greedy speculative vs target-only output", "environment": environment(sys.argv),
               "settings": vars(args)}
    if args.shapes == "demo":
        from transformers import AutoTokenizer

        pair = Path(args.pair)
        tok = AutoTokenizer.from_pretrained(pair / "target")
        ids = tok((pair / "demo_prompt.txt").read_text())["input_ids"]
        step = max(1, (len(ids) - args.context) // max(1, args.prompts))
        prompts = [ids[i * step:i * step + args.context] for i in range(args.prompts)]
        target_f32 = dj.load_target(pair / "target", dtype="float32")
        for dtype in args.dtypes.split(","):
            ctx = jax.default_matmul_precision("highest") if dtype == "float32" else jax.default_matmul_precision(None)
            with ctx:
                target = dj.load_target(pair / "target", dtype=dtype)
                draft = dj.load_draft(pair / "draft", target)
                r, t, good = compare(dj, target, draft, prompts, args, {"dtype": dtype},
                                     None if args.no_ties else target_f32, prompts)
                rows, times, ok = rows + r, times + t, ok and good
    else:
        from benchmarks import long_context as lc
        from diffspec_jax.draft import DraftModel

        tcfg, dcfg = lc.shapes(args.quick)
        target = lc.random_target(tcfg)
        draft = DraftModel(config=dcfg, params=lc.random_draft(dcfg, target),
                           aux_layers=dcfg.resolve_aux_layers(tcfg))
        rng = np.random.default_rng(0)
        for case in args.cases.split(","):
            ctx, batch = (int(x) for x in case.split("x"))
            label = {"dtype": "bfloat16", "context": ctx, "batch": batch}
            if args.time_budget is not None and time.perf_counter() - t0 > args.time_budget:
                skipped.append({**label, "why": "time budget"})
                continue
            prompts = [rng.integers(0, tcfg.vocab_size, ctx).tolist() for _ in range(batch)]
            try:
                r, t, good = compare(dj, target, draft, prompts, args, label)
            except dj.DiffspecError as exc:  # e.g. a batch the device cannot hold: named, the other cases go on
                skipped.append({**label, "why": f"{type(exc).__name__}: {exc}"})
                print(skipped[-1], flush=True)
                continue
            rows, times, ok = rows + r, times + t, ok and good
            write_json(out, {**payload, "rows": rows, "times": times, "skipped": skipped, "partial": True})
    payload.update(rows=rows, times=times, skipped=skipped, all_divergences_are_near_ties=ok,
                   deterministic_divergences=sum(1 for r in rows if r["mode"] == "deterministic"
                                                 and not r["identical"]))
    write_json(out, payload)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
