"""Accuracy of the 8-bit K/V cache (issue 41): fp8 against the model-dtype cache on the demo pair, on the same prompts.

    python benchmarks/kv_fp8_accuracy.py --contexts 16384 --prompts 16 --new-tokens 256 \\
        --out benchmarks/results/kv_fp8_accuracy_h200.json                       # on the GPU (bfloat16)
    python benchmarks/kv_fp8_accuracy.py --quick --out /tmp/kv_fp8_accuracy.json  # a CPU in about a minute

Per context, ``--prompts`` held-out prompts of the demo pair's corpus (``diffspec_jax.corpus.held_out_prompts``,
windows; ``--random-prompts``: random token ids, no corpus) go through:

* **logits**: the target's prefill of each prompt, then ``--teacher-tokens`` decode steps of one token fed the
  model-dtype cache's greedy continuation (teacher forcing: both caches see the same tokens), once into a cache in
  the model's dtype (``kv_cache_dtype="auto"``) and once into an fp8 one. Per prompt: max |fp8 - auto| over every
  logit, that over max |auto| (norm-relative), the mean KL(auto || fp8) of the softmaxes, and the share of
  positions whose argmax agrees;
* **greedy agreement**: ``generate()`` target-only, ``--new-tokens`` greedy tokens with each cache; per prompt the
  tokens before the first difference and the share of equal positions;
* **acceptance**: ``generate()`` with the demo draft (``--method``: ``diffspec`` by default) on each cache; the
  tokens per verification of each prompt, their paired difference fp8 - auto with a seeded 95% bootstrap interval
  over prompts (``paired.py``'s), and whether the speculative tokens equal the target-only ones of the same cache
  (losslessness relative to the fp8-cache target: ``lossless_fp8`` must be true).

``--workload recall`` takes the corpus's recall prompts instead of windows. ``--deterministic`` runs every call with
``SpecConfig(deterministic=True)``, which a GPU in bfloat16 needs for the losslessness check to be exact (issue 40).

``--dtype`` is the target's (default: float32 on a CPU, bfloat16 on a GPU; the "auto" cache is that dtype). The
JSON (and a PNG beside it: the paired acceptance and the greedy agreement per prompt) is rewritten after every
context.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# the repository root first, and not this directory: benchmarks/kernels.py would shadow the `kernels` package that
# transformers probes for
HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

from benchmarks.common import (add_output_arguments, add_plot_only_argument, claim_outputs, environment,  # noqa: E402
                               redraw, save_figure, write_json)
from benchmarks.paired import build_prompts, paired_difference  # noqa: E402

KINDS = ("auto", "fp8")


def teacher_logits(target, prompt: list[int], follow: list[int], kind: str, capacity: int) -> np.ndarray:
    """float32 ``[1 + len(follow), V]``: the logits after the prompt's prefill and after each token of ``follow``
    fed one decode step at a time, into a fresh cache of ``kind``."""
    from diffspec_jax import target as tgt

    cache = tgt.create_cache(target, 1, capacity, kv_cache_dtype=kind)
    last, cache = tgt.prefill(target, cache, [prompt])
    rows = [np.asarray(last[0], np.float32)]
    for i, tok in enumerate(follow):
        lg, cache = tgt.decode(target, cache, [[tok]], [len(prompt) + i])
        rows.append(np.asarray(lg[0, 0], np.float32))
    return np.stack(rows)


def logit_errors(auto: np.ndarray, fp8: np.ndarray) -> dict:
    """The errors of fp8 logits ``[N, V]`` against the model-dtype cache's."""
    diff = np.abs(fp8.astype(np.float64) - auto)
    la = jax.nn.log_softmax(jnp.asarray(auto, jnp.float32), axis=-1)
    lf = jax.nn.log_softmax(jnp.asarray(fp8, jnp.float32), axis=-1)
    kl = np.asarray(jnp.sum(jnp.exp(la) * (la - lf), axis=-1))
    return {"max_abs": float(diff.max()), "max_rel": float(diff.max() / np.abs(auto).max()),
            "mean_abs": float(diff.mean()), "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "argmax_agreement": float((auto.argmax(-1) == fp8.argmax(-1)).mean()), "positions": int(len(auto))}


def agreement(a: list[int], b: list[int]) -> dict:
    """Tokens before the first difference of two greedy outputs, and the share of equal positions."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return {"common_prefix": first, "equal_share": float(np.mean([x == y for x, y in zip(a, b)])) if n else 1.0,
            "tokens": n}


def prompts_for(args, target, ctx: int):
    """``args.prompts`` prompts of ``ctx`` tokens: held-out windows of the demo pair's corpus, or random ids."""
    if args.random_prompts:
        source = np.random.default_rng(args.seed).integers(0, target.config.vocab_size, ctx * 4)
        return build_prompts(source, ctx, args.prompts, args.seed + ctx), "random token ids"
    from transformers import AutoTokenizer

    from diffspec_jax.corpus import DEMO_PROMPT_PACKAGE, build_corpus, encode_documents, held_out_prompts

    if not hasattr(args, "_docs"):
        tok = AutoTokenizer.from_pretrained(args.target_dir)
        corpus = build_corpus()
        args._docs = encode_documents(tok, [d for d in corpus.held_out if d.name != DEMO_PROMPT_PACKAGE])
    held = held_out_prompts(args._docs, ctx, args.prompts, args.seed + ctx, args.workload, new_tokens=args.new_tokens)
    return [p.ids for p in held], f"held-out {args.workload} prompts of the demo corpus"


def run_context(target, draft, ctx: int, args) -> dict:
    import diffspec_jax as dj

    prompts, source = prompts_for(args, target, ctx)
    kw = dict(max_new_tokens=args.new_tokens, stop_token_ids=(), max_cache_len=ctx + args.new_tokens + 64)
    spec = dj.SpecConfig.from_flat(dict(num_speculative_tokens=args.k, draft_context_policy=args.method,
                                        diffspec_chunk_size=args.chunk, diffspec_token_budget=args.budget,
                                        deterministic=args.deterministic))
    alone, spec_out, acc = {}, {}, {}
    for kind in KINDS:  # deterministic: target-only runs its steps in the same form (a spec it reads that from)
        alone[kind] = dj.generate(target, None, prompts, kv_cache_dtype=kind,
                                  **({"spec": spec} if args.deterministic else {}), **kw).tokens
        res = dj.generate(target, draft, prompts, spec=spec, kv_cache_dtype=kind, **kw)
        spec_out[kind], acc[kind] = res.tokens, res.stats.acceptance_length_per_sequence
    cap = ctx + args.teacher_tokens + 64
    logits = []
    for p, follow in zip(prompts, alone["auto"]):
        auto = teacher_logits(target, p, follow[:args.teacher_tokens], "auto", cap)
        logits.append(logit_errors(auto, teacher_logits(target, p, follow[:args.teacher_tokens], "fp8", cap)))
    agree = [agreement(a, b) for a, b in zip(alone["auto"], alone["fp8"])]
    return {
        "context": ctx, "prompts": len(prompts), "prompt_source": source,
        "prompt_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "logits": {"per_prompt": logits, "max_abs": max(r["max_abs"] for r in logits),
                   "max_rel": max(r["max_rel"] for r in logits),
                   "mean_kl": float(np.mean([r["mean_kl"] for r in logits])),
                   "argmax_agreement": float(np.mean([r["argmax_agreement"] for r in logits]))},
        "greedy_agreement": {"per_prompt": agree, "mean_equal_share": float(np.mean([a["equal_share"] for a in agree])),
                             "mean_common_prefix": float(np.mean([a["common_prefix"] for a in agree]))},
        "acceptance": {"method": args.method, "per_prompt": acc,
                       "mean": {k: float(np.mean(v)) for k, v in acc.items()},
                       "fp8_minus_auto": paired_difference(acc["fp8"], acc["auto"], args.seed)},
        "lossless_auto": spec_out["auto"] == alone["auto"], "lossless_fp8": spec_out["fp8"] == alone["fp8"],
        "prompts_differing": {k: sum(a != b for a, b in zip(spec_out[k], alone[k])) for k in KINDS}}


def plot(payload: dict, path) -> str | None:
    """Per prompt of each context: acceptance on the fp8 cache against the model-dtype one (paired; the diagonal is
    no change), and the greedy tokens before the first difference of the two caches' target-only outputs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cases = payload["cases"]
    if not cases:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.3))
    for i, c in enumerate(cases):
        acc = c["acceptance"]["per_prompt"]
        d = c["acceptance"]["fp8_minus_auto"]
        a.scatter(acc["auto"], acc["fp8"], s=18, color=f"C{i}",
                  label=f"{c['context'] // 1024}K: fp8 - auto {d['mean_difference']:+.3f} "
                        f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")
        prefix = [g["common_prefix"] for g in c["greedy_agreement"]["per_prompt"]]
        b.bar(np.arange(len(prefix)) + 0.8 * i / len(cases), prefix, 0.8 / len(cases), color=f"C{i}",
              label=f"{c['context'] // 1024}K (mean {np.mean(prefix):.0f} of {payload['settings']['new_tokens']})")
    lo, hi = a.get_xlim()
    a.plot([lo, hi], [lo, hi], "k:", lw=0.8)
    a.set(xlabel="tokens per verification, model-dtype cache", ylabel="fp8 cache",
          title=f"acceptance ({cases[0]['acceptance']['method']}), paired per prompt")
    a.legend(fontsize=7)
    b.set(xlabel="prompt", ylabel="tokens", title="greedy target-only: tokens before the first difference")
    b.legend(fontsize=7)
    env = payload["environment"]
    mode = "deterministic" if payload["settings"].get("deterministic") else "default mode"
    fig.suptitle(f"fp8 vs {payload['target_dtype']} K/V, demo pair, {cases[0]['prompt_source']}, {mode}; "
                 f"{env['device']}", fontsize=9)
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target directory (default: the demo pair's)")
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft directory (default: the demo pair's)")
    ap.add_argument("--dtype", default="auto", help="the target's dtype (auto: float32 on a CPU, bfloat16 on a GPU)")
    ap.add_argument("--contexts", default="16384")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--teacher-tokens", type=int, default=32, help="decode steps of the logits comparison")
    ap.add_argument("--method", default="diffspec", choices=("full", "recent", "diffspec"),
                    help="the draft's context policy for the acceptance comparison")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-prompts", action="store_true", help="random token ids instead of the held-out corpus")
    ap.add_argument("--workload", default="windows", choices=("windows", "recall"),
                    help="the demo corpus's prompt set (corpus.held_out_prompts)")
    ap.add_argument("--deterministic", action="store_true",
                    help="SpecConfig(deterministic=True) for every call: on a GPU, speculation must then equal "
                         "target-only on each cache to the bit (without it, bf16 GPU runs may differ: issue 40)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU-sized defaults: contexts 512, 2 prompts, 64 new tokens, 8 teacher tokens, budget 256")
    add_plot_only_argument(ap)
    add_output_arguments(ap, "benchmarks/results/kv_fp8_accuracy.json")
    args = ap.parse_args(argv)
    if redraw(ap, args, plot, __file__):
        return 0
    if args.quick:  # small defaults for what the command line leaves at its defaults
        defaults = ap.parse_args([])
        for key, value in (("contexts", "512"), ("prompts", 2), ("new_tokens", 64), ("teacher_tokens", 8),
                           ("budget", 256), ("chunk", 32)):
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    import diffspec_jax as dj
    from diffspec_jax import demo
    from diffspec_jax.generate import resolve_dtype_arg

    t0 = time.perf_counter()
    outs = claim_outputs(ap, args, [args.out, Path(args.out).with_suffix(".png")], __file__)
    args.target_dir = Path(args.target) if args.target else demo.target_dir()
    ddir = Path(args.draft) if args.draft else demo.draft_dir()
    dtype = resolve_dtype_arg(args.dtype)
    target = dj.load_target(args.target_dir, dtype=dtype)
    draft = dj.load_draft(ddir, target)
    payload = {"benchmark": "fp8 vs model-dtype K/V cache: logits, greedy agreement, acceptance (issue 41)",
               "environment": environment(sys.argv if argv is None else ["benchmarks/kv_fp8_accuracy.py", *argv]),
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                            if not k.startswith("_")},
               "target_dtype": dtype, "target": str(args.target_dir), "draft": str(ddir), "cases": []}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        case = run_context(target, draft, ctx, args)
        payload["cases"].append(case)
        payload["lossless_fp8"] = all(c["lossless_fp8"] for c in payload["cases"])
        payload["figure"] = plot(payload, outs[1])
        write_json(outs[0], payload)
        print(json.dumps({"context": ctx, "logits_max_rel": case["logits"]["max_rel"],
                          "logits_mean_kl": case["logits"]["mean_kl"],
                          "greedy_equal_share": case["greedy_agreement"]["mean_equal_share"],
                          "acceptance": case["acceptance"]["mean"],
                          "acceptance_fp8_minus_auto": case["acceptance"]["fp8_minus_auto"],
                          "lossless_fp8": case["lossless_fp8"], "prompts_differing": case["prompts_differing"]}),
              flush=True)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0 if payload.get("lossless_fp8", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
