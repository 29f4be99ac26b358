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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="diffspec_jax/demo/pair")
    add_output_arguments(ap, "benchmarks/results/lossless_check.json")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tie-tolerance", type=float, default=0.05)
    args = ap.parse_args(argv)
    out, = claim_outputs(ap, args, [args.out], __file__)
    import diffspec_jax as dj
    from transformers import AutoTokenizer

    pair = Path(args.pair)
    tok = AutoTokenizer.from_pretrained(pair / "target")
    ids = tok((pair / "demo_prompt.txt").read_text())["input_ids"]
    step = max(1, (len(ids) - args.context) // max(1, args.prompts))
    prompts = [ids[i * step:i * step + args.context] for i in range(args.prompts)]
    target_f32 = dj.load_target(pair / "target", dtype="float32")
    rows, ok = [], True
    for dtype in ("bfloat16", "float32"):
        ctx = jax.default_matmul_precision("highest") if dtype == "float32" else jax.default_matmul_precision(None)
        with ctx:
            target = dj.load_target(pair / "target", dtype=dtype)
            draft = dj.load_draft(pair / "draft", target)
            kw = dict(max_new_tokens=args.new_tokens, stop_token_ids=())
            base = dj.generate(target, None, prompts, **kw).tokens
            for policy in ("full", "diffspec"):
                spec = dj.SpecConfig.from_flat(dict(draft_context_policy=policy))
                out = dj.generate(target, draft, prompts, spec=spec, **kw).tokens
                for i, (a, b) in enumerate(zip(base, out)):
                    j = first_divergence(a, b)
                    row = {"dtype": dtype, "policy": policy, "prompt": i, "identical": j is None,
                           "first_divergence": j}
                    if j is not None:
                        row.update(tie_gap(target_f32, prompts[i], a[:j], a[j], b[j]))
                        row["near_tie"] = row["gap"] <= args.tie_tolerance
                        ok = ok and row["near_tie"]
                    rows.append(row)
                    print(row, flush=True)
    write_json(out, {"check": "greedy speculative vs target-only output", "environment": environment(sys.argv),
                          "settings": vars(args), "rows": rows, "all_divergences_are_near_ties": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
