"""Paired benchmark: target-only vs EAGLE-3 (full draft context) vs sliding window vs DiffSpec, same inputs.

    python benchmarks/paired.py --contexts 2048,8192,16384 --new-tokens 256 --repeats 3 \\
        --out benchmarks/results/paired_demo_h200.json            # the demo pair (default models)
    python benchmarks/paired.py --target T --draft D ...           # any pair
    python benchmarks/paired.py --draft self ...                   # self-drafting (+ the demo pair's DiffSpec)

Methods: ``target`` (autoregressive, the reference), ``eagle3-full``, ``eagle3-recent``, ``diffspec``, and the
target drafting for itself (``generate(target, "self")``, docs/self_drafting.md) over its sink chunk + recent window
(``self-recent``), DiffSpec's selected chunks + sink + window (``self-diffspec``) or its full cache (``self-full``),
all at ``--budget``; prompt lookup (``generate(target, "ngram")``, ``--ngram-min-n`` / ``--ngram-max-n``) alone
(``ngram``) or in front of another method (``ngram+M``: ``NGram(first=True)``, method M's draft where no n-gram
matches). ``--draft self`` runs ``target,self-recent,self-diffspec`` (and ``diffspec``, from the demo
pair's EAGLE-3 draft, when no ``--target`` is given). For each
context length the same prompts (``--workload``: ``windows``, random windows of the held-out packages, or
``recall``, windows that end by re-emitting a file they hold at least 3/4 of the context back; see
:func:`diffspec_jax.corpus.held_out_prompts`; hashes recorded) go through every method; after
one warm-up of each, repeats are interleaved ABBA (A B C D, D C B A, ...) so drift hits every method alike. Greedy
output of every method must equal ``target``'s: a mismatch fails the run (exit status 1), unless
``--tie-tolerance`` is given, in which case a divergence is accepted only at a numerical near-tie (the two tokens'
float32 logits, recomputed by a full forward pass, within the tolerance; see ``lossless_check.py``) and reported.
``--temperature T`` (with ``--top-p``, ``--draft-sampling``) samples instead: outputs then differ between methods by
design, so no equality is checked (the sampling tests check the distribution), repeat r samples with seed
``--seed + r``, and each prompt's acceptance is its mean over the repeats.

Per case: time to first token, decode tokens/s (excluding prefill), end-to-end tokens/s, mean acceptance length
(overall and per prompt, with DiffSpec's per-prompt difference from each baseline: wins / losses and a bootstrap
interval), per-position acceptance, retrievals and their share of decode time, peak device memory; medians and
coefficients of variation over the repeats. The JSON records the git commit, versions, device, model configs and
weight-file hashes, how the inputs were built and their hashes, and every setting; a PNG (speedup against the
1.0x line, acceptance with seeded 95% bootstrap intervals over prompts, vs context) is written next to it when
matplotlib is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_output_arguments, claim_outputs, context_axis, environment, reference_line, repo_relative, save_figure,
    write_json)
from checkpoints_tools.inspect import file_hashes  # noqa: E402
from diffspec_jax.corpus import WORKLOADS  # noqa: E402

METHODS = ("target", "eagle3-full", "eagle3-recent", "diffspec")
#: the target drafting for itself (no draft model), per working-set policy
SELF_METHODS = ("self-recent", "self-diffspec", "self-full")
#: prompt lookup alone, and in front of a draft (``ngram+M``: method M where no n-gram matches)
NGRAM_METHODS = ("ngram", "ngram+eagle3-recent", "ngram+diffspec", "ngram+self-recent", "ngram+self-diffspec")
#: every method: ``<x>-tree`` is method x with tree drafting + tree verification (``--tree-nodes``, ``--tree-topk``)
ALL_METHODS = METHODS + ("eagle3-full-tree", "eagle3-recent-tree", "diffspec-tree") + SELF_METHODS + NGRAM_METHODS
POLICY = {"eagle3-full": "full", "eagle3-recent": "recent", "diffspec": "diffspec", "self-recent": "recent",
          "self-diffspec": "diffspec", "self-full": "full"}
#: methods whose acceptance is compared with every other speculative method's (:func:`comparisons`)
COMPARED = ("diffspec", "self-diffspec", "ngram")


def build_prompts(ids: np.ndarray, context: int, count: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``context`` tokens at seeded random offsets of ``ids`` (``--prompt-source`` files and
    ``--random-prompts``)."""
    if len(ids) < context:
        raise SystemExit(f"the prompt source has {len(ids)} tokens, fewer than the context {context}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - context + 1, count)
    return [[int(t) for t in ids[s:s + context]] for s in starts]


def peak_memory() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # CPU backends have none
        return None
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def run_method(method, target, draft, prompts, args, repeat: int = 0):
    import diffspec_jax as dj

    tree = method.endswith("-tree")
    behind = method.removeprefix("ngram+")  # the method that drafts where prompt lookup finds no match
    spec = dj.SpecConfig.from_flat(dict(num_speculative_tokens=args.k,
                                        draft_context_policy=POLICY.get(behind.removesuffix("-tree"), "full"),
                                        ngram_min_n=args.ngram_min_n, ngram_max_n=args.ngram_max_n,
                                        ngram_first=behind != method,
                                        diffspec_chunk_size=args.chunk, diffspec_token_budget=args.budget,
                                        diffspec_retrieval_interval=args.interval,
                                        diffspec_scoring_layer=args.scoring_layer, draft_sampling=args.draft_sampling,
                                        diffspec_verification_mode="tree" if tree else "auto",
                                        diffspec_max_tree_nodes=args.tree_nodes, diffspec_tree_topk=args.tree_topk))
    t0 = time.perf_counter()
    drafter = {"target": None, "ngram": "ngram"}.get(method, "self" if behind in SELF_METHODS else draft)
    res = dj.generate(target, drafter, prompts, max_new_tokens=args.new_tokens, spec=spec, stop_token_ids=(),
                      max_cache_len=args.cache_len, seed=args.seed + repeat,
                      sampling=dj.SamplingConfig(temperature=args.temperature, top_p=args.top_p))
    total = time.perf_counter() - t0
    s = res.stats
    ret = (s.retrieval or {}).get("aggregate", {})
    retrieval_s = ret.get("retrieval_ms", 0.0) * ret.get("retrievals", 0) / 1e3
    return res.tokens, {
        "ttft_s": s.prefill_s, "decode_tokens_per_s": s.decode_tokens_per_s, "end_to_end_tokens_per_s":
            s.new_tokens / total, "mean_acceptance_length": s.mean_acceptance_length,
        "acceptance_per_position": s.acceptance_per_position, "retrievals": ret.get("retrievals"),
        "acceptance_length_per_prompt": s.acceptance_length_per_sequence,
        "mean_tree_size": s.mean_tree_size, "accepted_depth_histogram": s.accepted_depth_histogram,
        "retrieval_share_of_decode": retrieval_s / s.decode_s if s.decode_s else None,
        "peak_memory_bytes": peak_memory()}


def check_equal(base, out, target_f32, prompts, tol):
    """None when identical; else a list of divergences, each with its float32 logit gap and near-tie verdict."""
    from benchmarks.lossless_check import tie_gap
    from diffspec_jax.generate import first_divergence

    problems = []
    for i, (a, b) in enumerate(zip(base, out)):
        j = first_divergence(a, b)
        if j is None:
            continue
        row = {"prompt": i, "first_divergence": j}
        if tol is not None:
            row.update(tie_gap(target_f32, prompts[i], a[:j], a[j], b[j]))
            row["near_tie"] = row["gap"] <= tol
        problems.append(row)
    return problems or None


def summarise(rows: list[dict]) -> dict:
    out = {}
    for key in ("ttft_s", "decode_tokens_per_s", "end_to_end_tokens_per_s", "mean_acceptance_length",
                "retrieval_share_of_decode", "peak_memory_bytes"):
        vals = [r[key] for r in rows if r[key] is not None]
        if vals:
            med = statistics.median(vals)
            cv = statistics.pstdev(vals) / statistics.mean(vals) if len(vals) > 1 and statistics.mean(vals) else 0.0
            out[key] = {"median": med, "cv": cv, "values": vals}
    for key in ("acceptance_per_position", "mean_tree_size", "accepted_depth_histogram"):
        out[key] = rows[-1][key]
    # each prompt's acceptance over the repeats (identical when greedy; sampled repeats use other seeds)
    per = [r["acceptance_length_per_prompt"] for r in rows]
    out["acceptance_length_per_prompt"] = None if per[-1] is None else [
        None if None in vals else float(np.mean(vals)) for vals in zip(*per)]
    out["retrievals"] = rows[-1]["retrievals"]
    return out


def bootstrap_ci(values, seed: int = 0, resamples: int = 10000) -> list[float]:
    """The 95% bootstrap interval of the mean of ``values`` (per-prompt samples resampled with replacement,
    seeded)."""
    v = np.asarray(values, np.float64)
    boot = v[np.random.default_rng(seed).integers(0, len(v), (resamples, len(v)))].mean(axis=1)
    return [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))]


def paired_difference(a: list[float], b: list[float], seed: int = 0, resamples: int = 10000) -> dict:
    """Per-prompt acceptance of method A against method B on the same prompts: wins / ties / losses of A, the mean
    difference A - B and its 95% bootstrap interval (prompts resampled with replacement, seeded). Greedy acceptance
    is deterministic, so the spread is over prompts, not repeats (sampled runs: each prompt's mean over them)."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return {"prompts": len(d), "wins": int((d > 0).sum()), "ties": int((d == 0).sum()), "losses": int((d < 0).sum()),
            "mean_difference": float(d.mean()), "ci95": bootstrap_ci(d, seed, resamples)}


def comparisons(case: dict, methods: list[str], seed: int) -> dict:
    """``paired_difference`` of each DiffSpec method (EAGLE-3 or self-drafting) against every other speculative
    method of the case."""
    per = {m: case["methods"][m]["acceptance_length_per_prompt"] for m in methods[1:]}
    return {f"{a} vs {b}": paired_difference(per[a], per[b], seed) for a in per if a.startswith(COMPARED)
            for b in per if b != a and None not in per[a] + per[b]}


def plot(payload: dict, path: Path, seed: int = 0) -> str | None:
    """Decode speedup over target-only (left, with the 1.0x line) and acceptance length (right: the mean over
    prompts of each prompt's tokens per verification, with a seeded 95% bootstrap interval over prompts where the
    JSON has per-prompt values) against context, and, where the cases hold :func:`comparisons`, a third panel with
    each comparison's paired mean difference and its 95% interval against the zero line. Returns the file name, or
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ctxs = sorted({c["context"] for c in payload["cases"]})
    case = {c["context"]: c for c in payload["cases"]}
    pairs = sorted({k for c in payload["cases"] for k in c.get("comparisons") or {}})
    fig, axes = plt.subplots(1, 3 if pairs else 2, figsize=(16.5 if pairs else 11, 4.2))
    ax1, ax2 = axes[:2]
    prompts = set()
    methods = payload["settings"]["methods"][1:]
    for i, m in enumerate(methods):
        rows = [case[x]["methods"][m] for x in ctxs]
        ax1.plot(ctxs, [r.get("speedup_vs_target") or np.nan for r in rows], marker="o", color=f"C{i}", label=m)
        mean, lo, hi = [], [], []
        for r in rows:
            per = r.get("acceptance_length_per_prompt") or []
            if per and None not in per:
                prompts.add(len(per))
                a, b = bootstrap_ci(per, seed)
                mean.append(float(np.mean(per)))
                lo.append(mean[-1] - a)
                hi.append(b - mean[-1])
            else:  # an older JSON without per-prompt values: the median, no interval
                mean.append(r["mean_acceptance_length"]["median"])
                lo.append(0.0)
                hi.append(0.0)
        dodge = 2 ** (0.05 * (i - (len(methods) - 1) / 2))  # side by side, so the intervals do not hide each other
        ax2.errorbar([x * dodge for x in ctxs], mean, yerr=[lo, hi], marker="o", capsize=3, color=f"C{i}", label=m)
    reference_line(ax1, "1.0x (target-only)")
    ax1.set(title="Decode speedup over target-only", ylabel="speedup (x)")
    if prompts:
        ax2.set(title=f"Acceptance (95% bootstrap interval over {'/'.join(map(str, sorted(prompts)))} prompts)",
                ylabel="tokens per verification (mean over prompts)")
    else:
        ax2.set(title="Acceptance (median over repeats)", ylabel="tokens per verification")
    if pairs:
        ax3 = axes[2]
        for i, name in enumerate(pairs):
            rows = [case[x].get("comparisons", {}).get(name) for x in ctxs]
            mid = [r["mean_difference"] if r else np.nan for r in rows]
            lo = [r["mean_difference"] - r["ci95"][0] if r else 0.0 for r in rows]
            hi = [r["ci95"][1] - r["mean_difference"] if r else 0.0 for r in rows]
            dodge = 2 ** (0.05 * (i - (len(pairs) - 1) / 2))
            ax3.errorbar([x * dodge for x in ctxs], mid, yerr=[lo, hi], marker="o", capsize=3, color=f"C{i}",
                         label=name)
        reference_line(ax3, "no difference", y=0.0)
        ax3.set(title="Paired difference (mean, 95% bootstrap interval)",
                ylabel="tokens per verification, A - B")
    for ax in axes:
        context_axis(ax, ctxs)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    where = repo_relative(payload["models"]["target"].get("path"))
    fig.suptitle(f"{payload['environment']['device']}" + (f", target {where}" if where else ""), fontsize=10)
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target directory (default: the demo pair)")
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft directory, or 'self' (self-drafting methods)")
    ap.add_argument("--prompt-source", default=None, help="a text file to cut windows from instead of the held-out "
                                                          "packages of the demo pair's corpus")
    ap.add_argument("--workload", default="windows", choices=WORKLOADS,
                    help="held-out prompts: random windows, or windows that end re-emitting a file far back")
    ap.add_argument("--random-prompts", action="store_true", help="prompts of random token ids (random models)")
    ap.add_argument("--contexts", default="2048,8192,16384")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--methods", default=None,
                    help=f"comma-separated, 'target' first; any of {', '.join(ALL_METHODS)} (default: "
                         f"{','.join(METHODS)}; with --draft self: target,self-recent,self-diffspec[,diffspec])")
    ap.add_argument("--tree-nodes", type=int, default=50, help="tree methods: nodes per verification")
    ap.add_argument("--tree-topk", type=int, default=8, help="tree methods: frontier width")
    ap.add_argument("--ngram-min-n", type=int, default=1, help="ngram methods: the shortest suffix matched")
    ap.add_argument("--ngram-max-n", type=int, default=3, help="ngram methods: the longest suffix matched")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--interval", type=int, default=None,
                    help="DiffSpec retrieval interval (default: the drafter's, 1 self-drafting, 4 a draft model)")
    ap.add_argument("--scoring-layer", type=int, default=None, help="target layer that scores chunks (default: last)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tie-tolerance", type=float, default=None)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (outputs checked against target-only); > 0 samples (no equality check)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    ap.add_argument("--draft-sampling", default="argmax", choices=("argmax", "sample"),
                    help="sampled runs: drafts are the draft's argmax (one-hot q) or samples of its distribution")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the warm-up run of each method (acceptance studies: generate() times compilation "
                         "apart anyway, but the first run's timings are colder)")
    ap.add_argument("--seed", type=int, default=0)
    add_output_arguments(ap, "benchmarks/results/paired.json")
    args = ap.parse_args(argv)
    out, png = claim_outputs(ap, args, [args.out, Path(args.out).with_suffix(".png")], __file__)
    sampled = args.temperature > 0
    if sampled and args.tie_tolerance is not None:
        raise SystemExit("--tie-tolerance applies to greedy runs; sampled outputs are not compared token by token")
    self_draft = args.draft == "self"
    if args.methods is None:
        args.methods = ",".join(("target", "self-recent", "self-diffspec") + (() if args.target else ("diffspec",))
                                if self_draft else METHODS)
    methods = args.methods.split(",")
    if methods[0] != "target" or any(m not in ALL_METHODS for m in methods):
        raise SystemExit(f"--methods must start with 'target' and use only {', '.join(ALL_METHODS)}")
    args.methods = methods
    import diffspec_jax as dj
    from diffspec_jax import demo
    from diffspec_jax.corpus import (DEMO_PROMPT_PACKAGE, build_corpus, copied_fraction, encode_documents,
                                     held_out_prompts)

    tdir = Path(args.target) if args.target else demo.target_dir()
    ddir = Path(args.draft) if args.draft and not self_draft else (demo.draft_dir() if not args.target else None)
    eagle = [m for m in methods[1:] if m.removeprefix("ngram+") not in SELF_METHODS + ("ngram",)]
    if ddir is None and eagle:
        raise SystemExit(f"methods {', '.join(eagle)} need an EAGLE-3 draft: --draft DIR (with --target)")
    target = dj.load_target(tdir, dtype=args.dtype)
    draft = dj.load_draft(ddir, target) if ddir is not None else None
    target_f32 = dj.load_target(tdir, dtype="float32") if args.tie_tolerance is not None else None
    contexts = [int(c) for c in args.contexts.split(",")]
    docs = None  # held-out documents, unless prompts come from random ids or a text file
    if args.random_prompts:
        source = np.random.default_rng(args.seed).integers(0, target.config.vocab_size, max(contexts) * 4)
        input_desc = {"kind": "random token ids", "seed": args.seed}
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tdir)
        if args.prompt_source:
            text = Path(args.prompt_source).read_text()
            source = np.asarray(tok(text)["input_ids"])
            input_desc = {"kind": "windows of a text file", "source": args.prompt_source,
                          "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": int(len(source))}
        else:
            corpus = build_corpus()
            docs = encode_documents(tok, [d for d in corpus.held_out if d.name != DEMO_PROMPT_PACKAGE])
            input_desc = {"kind": f"held-out packages, workload {args.workload!r}", "python": corpus.manifest["python"],
                          "held_out_sha256": corpus.manifest["held_out_sha256"],
                          "packages": [d.name for d in docs]}
    block = max(args.k, args.tree_nodes if any(m.endswith("-tree") for m in methods) else 0)
    args.cache_len = max(contexts) + args.new_tokens + block + 1
    payload = {"benchmark": "paired speculative decoding", "environment": environment(sys.argv),
               "settings": vars(args),
               "models": {"target": {"path": str(tdir), "config": target.config.to_hf_dict(), "files": file_hashes(tdir)},
                          "draft": {"path": str(ddir), "config": draft.config.to_hf_dict(), "files": file_hashes(ddir)}
                          if draft is not None else None},
               "inputs": input_desc, "cases": [], "equality": "not checked (sampled)" if sampled else
               "strict" if args.tie_tolerance is None else f"near-ties within {args.tie_tolerance} allowed"}
    failed = False
    for ctx in contexts:
        held = None
        if docs is not None:
            held = held_out_prompts(docs, ctx, args.prompts, args.seed + ctx, args.workload,
                                    new_tokens=args.new_tokens)
            prompts = [p.ids for p in held]
        else:
            prompts = build_prompts(source, ctx, args.prompts, args.seed + ctx)
        case = {"context": ctx, "prompt_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
                "methods": {}, "mismatches": {}}
        if held is not None:
            case["prompts"] = [p.describe() for p in held]
        for m in methods if not args.no_warmup else ():  # warm-up: compile every method once
            run_method(m, target, draft, prompts, args)
        rows = {m: [] for m in methods}
        outputs = {}
        for r in range(args.repeats):
            order = methods if r % 2 == 0 else methods[::-1]
            for m in order:
                tokens, row = run_method(m, target, draft, prompts, args, r if sampled else 0)
                rows[m].append(row)
                outputs[m] = tokens
        if held is not None and args.workload == "recall":
            # how much of the re-emitted files target-only decoding copies verbatim
            case["target_copied_fraction"] = copied_fraction(outputs["target"], held)
        for m in methods:
            case["methods"][m] = summarise(rows[m])
            if m != "target":
                problems = None if sampled else check_equal(outputs["target"], outputs[m], target_f32, prompts, args.tie_tolerance)
                if problems:
                    case["mismatches"][m] = problems
                    if args.tie_tolerance is None or not all(p["near_tie"] for p in problems):
                        failed = True
                base = case["methods"]["target"]["decode_tokens_per_s"]["median"]
                case["methods"][m]["speedup_vs_target"] = case["methods"][m]["decode_tokens_per_s"]["median"] / base
        case["comparisons"] = comparisons(case, methods, args.seed)
        payload["cases"].append(case)
        payload["passed_equality"] = not failed
        write_json(out, payload)  # after every context, so a run cut short still leaves its data
        print(json.dumps({"context": ctx, **{m: {k: case["methods"][m].get(k) for k in ("speedup_vs_target",)}
                                              | {"acceptance": (case["methods"][m].get("mean_acceptance_length")
                                                                or {}).get("median")}
                                              for m in methods[1:]}, "mismatches": list(case["mismatches"]),
                          "comparisons": case["comparisons"]}),
              flush=True)
    payload["passed_equality"] = not failed
    payload["figure"] = plot(payload, png)
    write_json(out, payload)
    print(f"wrote {out}" + (f" and {payload['figure']}" if payload["figure"] else ""))
    if failed:
        print("FAILED: a method's greedy output differs from target-only decoding", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
