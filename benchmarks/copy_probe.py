"""Copy probe: does a target continue a passage it saw earlier in its context, and from how far back?

    python benchmarks/copy_probe.py --target diffspec_jax/demo/pair/target [--target DIR ...] \\
        --gaps 256,2048,8192 --out benchmarks/results/copy_probe.json

DiffSpec's retrieval can beat a recent window only when the target reads far context: when what it writes next
depends on tokens the window no longer holds. This probe measures that directly. Each sequence is
``passage + filler + passage``: ``--span`` tokens, then ``gap`` tokens, then the same passage again. The target
predicts every token of the sequence (teacher-forced, one full forward pass) and the probe reports top-1 accuracy
on the passage's second occurrence beside its first. A target that copies scores near 1 on the second occurrence;
one that does not scores as on the first.

Teacher-forced accuracy is the easy half: each prediction sees the true tokens before it. **Free-running** copying
(``--free-running-tokens``, default 64; 0 skips it) is what speculative decoding meets: the same sequence is cut
after the second occurrence's first ``--free-running-shown`` tokens (default 32), the target decodes greedily, and
the probe scores its new tokens against the rest of the passage (the share that match, and how many come before
the first miss). A target whose copy breaks at its first wrong guess scores far below its teacher-forced accuracy.

Two kinds of passage, both followed by natural filler:

* ``natural``: a window of held-out code (the standard library packages the demo pair never trained on,
  tokenized with each target's own tokenizer) and the text that follows it as filler, so the first occurrence
  reads as ordinary code;
* ``random``: uniform random token ids, predictable on their second occurrence only by copying (first: about 0).

Beside copying, the probe measures how repetitive each target's own greedy writing is (``--greedy-prompts``,
default 8; 0 skips it): held-out windows of ``--greedy-context`` tokens, ``--greedy-new-tokens`` of target-only
greedy decoding, and the share of distinct 4-grams among them (1.0: nothing repeats; a target stuck in a loop
approaches 0), beside the same share of the held-out text that really follows each window. A target trained to
copy can learn to repeat itself too, and greedy loops flatter every drafter's acceptance.

Two optional looks inside, per (kind, gap), on the same sequences:

* ``--layers``: a **logit lens** (Llama-family targets): the final norm and LM head applied to the residual stream
  entering each layer (HF ``hidden_states`` 1 .. L-1) and their top-1 accuracy on the second occurrence, beside the
  final logits'. It shows in which layer a copy forms. An EAGLE-3 draft reads only some of those states (its aux
  layers), so a copy formed after its last aux layer never reaches the draft's features.
* ``--draft DIR`` (one per ``--target``, in order): the draft's teacher-forced top-1 agreement with the target's
  top-1 at each of its TTT steps (as its training evaluates it: step k predicts the token k + 1 past a true
  prefix), on the first and on the second occurrence. A draft that copies agrees on the second occurrence at
  least as well as on the first; one that cannot falls behind the target there. The draft's attention is dense
  over the whole sequence, so keep ``2 * span + gap`` near the windows it was trained on.

The JSON holds, per target, its weight hashes and build settings (``model_card.json`` next to it, when there is
one) and per (kind, gap) the mean accuracies on both occurrences and each passage's. Accuracy is not speed, so
the figures do not depend on the machine beyond float rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_output_arguments, claim_outputs, environment, write_json  # noqa: E402

KINDS = ("natural", "random")


def copy_sequences(doc: np.ndarray, vocab: int, span: int, gap: int, count: int, seed: int) -> dict[str, np.ndarray]:
    """int32 ``[count, 2 * span + gap]`` sequences ``passage + filler + passage`` per kind.

    ``natural``: passage ``doc[s : s + span]``, filler ``doc[s + span : s + span + gap]`` (seeded random starts
    ``s``); ``random``: uniform ids in ``[1, vocab)`` as passage, the same filler.
    """
    if len(doc) < span + gap + 1:
        raise SystemExit(f"the held-out document has {len(doc)} tokens, too few for a {span}-token passage and a "
                         f"{gap}-token gap")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(doc) - span - gap + 1, count)
    out = {k: [] for k in KINDS}
    for s in starts:
        passage, filler = doc[s:s + span], doc[s + span:s + span + gap]
        noise = rng.integers(1, vocab, span).astype(np.int32)
        for kind, p in (("natural", passage), ("random", noise)):
            out[kind].append(np.concatenate([p, filler, p]))
    return {k: np.stack(v).astype(np.int32) for k, v in out.items()}


def copy_accuracy(pred: np.ndarray, seq: np.ndarray, span: int, gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 accuracy per row on the passage's first and second occurrence.

    ``pred[:, i]`` is the prediction for ``seq[:, i + 1]``; each occurrence scores its tokens 2..span (its first
    token follows unrelated text and cannot be copied).
    """
    second = span + gap
    hit = pred[:, :-1] == seq[:, 1:]
    return hit[:, :span - 1].mean(axis=1), hit[:, second:second + span - 1].mean(axis=1)


def free_running_copy(model, seqs: np.ndarray, span: int, gap: int, shown: int, new_tokens: int) -> dict:
    """Greedy target-only continuations of ``seqs`` (:func:`copy_sequences`' rows) cut after the second
    occurrence's first ``shown`` tokens, scored against the passage's next ``new_tokens`` tokens."""
    from diffspec_jax import generate

    cut = span + gap + shown
    out = generate(model, None, [list(map(int, s[:cut])) for s in seqs], max_new_tokens=new_tokens,
                   stop_token_ids=())
    match = np.array([np.asarray(o[:new_tokens]) == s[cut:cut + new_tokens] for o, s in zip(out.tokens, seqs)])
    before = [int(np.argmin(m)) if not m.all() else new_tokens for m in match]
    return {"shown": shown, "new_tokens": new_tokens, "match_share": float(match.mean()),
            "tokens_before_first_miss": float(np.mean(before)),
            "per_passage": {"match_share": match.mean(axis=1).tolist(), "tokens_before_first_miss": before},
            "tokens": [list(o) for o in out.tokens]}


def distinct_ngram_share(tokens, n: int = 4) -> float:
    """Distinct ``n``-grams over all ``n``-grams of a token sequence: 1.0 when none repeats, toward 0 in a loop."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def greedy_repetition(model, encoded, *, context: int, new_tokens: int, count: int, seed: int) -> dict:
    """Distinct-4-gram share of target-only greedy continuations of ``count`` held-out windows (``encoded``:
    :class:`~diffspec_jax.corpus.EncodedDocument` list) beside that of the text that follows each window."""
    from diffspec_jax import generate
    from diffspec_jax.corpus import held_out_prompts

    prompts = held_out_prompts(encoded, context, count, seed, new_tokens=new_tokens)
    out = generate(model, None, [p.ids for p in prompts], max_new_tokens=new_tokens, stop_token_ids=())
    greedy = [distinct_ngram_share(o) for o in out.tokens]
    held = [distinct_ngram_share(p.reference) for p in prompts]
    return {"context": context, "new_tokens": new_tokens, "n": 4, "prompts": [p.describe() for p in prompts],
            "greedy_distinct_share": float(np.mean(greedy)), "held_out_distinct_share": float(np.mean(held)),
            "per_prompt": {"greedy": greedy, "held_out": held}, "greedy_tokens": [list(o) for o in out.tokens]}


def layer_lens(model, seq: np.ndarray) -> np.ndarray:
    """int ``[L, T]`` top-1 of the final norm + LM head applied to the residual stream entering layers 1 .. L-1
    (HF ``hidden_states`` indices), then the target's own final prediction (row L-1)."""
    import jax.numpy as jnp

    from diffspec_jax.models import family, llama

    cfg = model.config
    if cfg.family != "llama":
        raise SystemExit(f"--layers reads Llama-family targets (this one is {cfg.family!r})")
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    logits, aux = family(cfg).forward_aux(cfg, model.params, jnp.asarray(seq[None]), aux_layers=tuple(range(1, n)))
    reads = [llama._lm_head(cfg, model.params, aux[..., i * h:(i + 1) * h], None) for i in range(n - 1)]
    return np.stack([np.asarray(jnp.argmax(r[0], -1)) for r in [*reads, logits]])


def draft_agreement(model, draft, seq: np.ndarray, steps: int = 4) -> np.ndarray:
    """float ``[steps, T]``: 1 where the draft's TTT step k, run on the true prefix ``seq[: j - k]``, names the
    target's top-1 for token j (0 where it does not, NaN where step k has no prediction for j)."""
    import jax.numpy as jnp

    from diffspec_jax.models import eagle3, family
    from diffspec_jax.train_draft import ttt_logits

    cfg = model.config
    tokens = jnp.asarray(seq[None])
    logits, aux = family(cfg).forward_aux(cfg, model.params, tokens, aux_layers=draft.aux_layers)
    top = np.asarray(jnp.argmax(logits[0], -1))           # top[i]: the target's guess for token i + 1
    t = len(seq) - steps
    out = np.full((steps, len(seq)), np.nan)
    for k, lg in enumerate(ttt_logits(draft.config, draft.params, aux[:, :t], tokens[:, 1:], steps)):
        guess = np.asarray(eagle3.to_target_ids(draft.params, jnp.argmax(lg[0], -1)))  # entry i: token i + 2 + k
        n = min(t, len(seq) - 2 - k)                          # tokens past the sequence's end are not scored
        out[k, 2 + k:2 + k + n] = guess[:n] == top[1 + k:1 + k + n]
    return out


def _token_hits(pred: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """float ``[..., T]``: 1 where ``pred[..., j - 1]`` (the guess for token j) is ``seq[j]``, NaN for token 0."""
    out = np.full(pred.shape, np.nan)
    out[..., 1:] = pred[..., :-1] == seq[1:]
    return out


def occurrence_means(per_token: np.ndarray, span: int, gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Means of ``per_token [..., T]`` (NaN: no value) over each occurrence's tokens 2 .. span, as in
    :func:`copy_accuracy` (its first token follows unrelated text)."""
    second = span + gap
    return (np.nanmean(per_token[..., 1:span], axis=-1), np.nanmean(per_token[..., second + 1:second + span], axis=-1))


def _means(entry: dict) -> dict:
    """``entry`` without its per-passage lists and token ids (what the probe prints as it goes)."""
    return {k: _means(v) if isinstance(v, dict) else v for k, v in entry.items() if k not in ("per_passage", "tokens")}


def probe_target(path: Path, docs, *, span: int, gaps: list[int], count: int, seed: int, dtype: str,
                 greedy: tuple[int, int, int] = (0, 2048, 128), free_running: tuple[int, int] = (32, 0),
                 layers: bool = False, draft: Path | None = None) -> dict:
    """Copy rows per (kind, gap), each with :func:`free_running_copy` over ``free_running`` = (shown, new tokens)
    when new tokens > 0, :func:`layer_lens` when ``layers`` and :func:`draft_agreement` for ``draft``, and, when
    ``greedy[0]`` > 0, :func:`greedy_repetition` over ``greedy`` = (prompts, context, new tokens)."""
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from checkpoints_tools.inspect import file_hashes
    from diffspec_jax.corpus import encode_documents
    from diffspec_jax.draft import load_draft
    from diffspec_jax.target import forward, load_target

    model = load_target(path, dtype)
    drafter = load_draft(draft, model, dtype=dtype) if draft is not None else None
    tok = AutoTokenizer.from_pretrained(path)
    encoded = encode_documents(tok, docs)
    doc = max((e.ids for e in encoded), key=len)
    card = path.parent / "model_card.json"
    entry = {"path": str(path), "weights": file_hashes(path), "dtype": dtype, "held_out_document_tokens": len(doc),
             "build_settings": json.loads(card.read_text()).get("settings") if card.is_file() else None, "rows": []}
    if drafter is not None:
        entry["draft"] = {"path": str(draft), "weights": file_hashes(draft), "aux_layers": list(drafter.aux_layers)}
    for gap in gaps:
        seqs = copy_sequences(doc, model.config.vocab_size, span, gap, count, seed)
        for kind in KINDS:
            # one sequence per call: the reference forward materialises [T, T] scores
            pred = np.concatenate([np.asarray(jnp.argmax(forward(model, s[None]), -1)) for s in seqs[kind]])
            first, second = copy_accuracy(pred, seqs[kind], span, gap)
            row = {"kind": kind, "gap": gap, "first_occurrence_accuracy": float(first.mean()),
                   "second_occurrence_accuracy": float(second.mean()),
                   "per_passage": {"first": first.tolist(), "second": second.tolist()}}
            if free_running[1]:
                row["free_running"] = free_running_copy(model, seqs[kind], span, gap, *free_running)
            if layers:  # [passages, L]: second-occurrence accuracy of each layer's readout
                hits = np.stack([occurrence_means(_token_hits(layer_lens(model, q), q), span, gap)[1]
                                 for q in seqs[kind]])
                row["layer_lens"] = {"layers": list(range(1, model.config.num_hidden_layers)) + ["final"],
                                     "second_occurrence_accuracy": hits.mean(axis=0).tolist(),
                                     "per_passage": hits.tolist()}
            if drafter is not None:  # [passages, 2 occurrences, steps]
                agree = np.stack([np.stack(occurrence_means(draft_agreement(model, drafter, q), span, gap))
                                  for q in seqs[kind]])
                row["draft_agreement"] = {"first": agree[:, 0].mean(axis=0).tolist(),
                                          "second": agree[:, 1].mean(axis=0).tolist(),
                                          "per_passage": {"first": agree[:, 0].tolist(),
                                                          "second": agree[:, 1].tolist()}}
            entry["rows"].append(row)
            print(json.dumps({"target": str(path), **_means(row)}), flush=True)
    if greedy[0]:
        entry["greedy_repetition"] = greedy_repetition(model, encoded, context=greedy[1], new_tokens=greedy[2],
                                                       count=greedy[0], seed=seed)
        print(json.dumps({"target": str(path), **{k: v for k, v in entry["greedy_repetition"].items()
                                                  if k.endswith("share")}}), flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", action="append", help="target directory (repeat for several; default: demo pair)")
    ap.add_argument("--gaps", default="256,2048,8192", help="tokens between the two occurrences")
    ap.add_argument("--span", type=int, default=256, help="passage length (tokens)")
    ap.add_argument("--passages", type=int, default=4, help="passages per (kind, gap)")
    ap.add_argument("--greedy-prompts", type=int, default=8, help="held-out windows decoded greedily (0: skip)")
    ap.add_argument("--greedy-context", type=int, default=2048, help="tokens per greedy-decoding window")
    ap.add_argument("--greedy-new-tokens", type=int, default=128, help="greedy tokens per window")
    ap.add_argument("--free-running-shown", type=int, default=32,
                    help="free-running copying: the second occurrence's tokens given before greedy decoding")
    ap.add_argument("--free-running-tokens", type=int, default=64,
                    help="free-running copying: greedy tokens scored against the rest of the passage (0: skip)")
    ap.add_argument("--layers", action="store_true",
                    help="logit lens: each layer's readout accuracy on the second occurrence (Llama-family targets)")
    ap.add_argument("--draft", action="append",
                    help="EAGLE-3 draft of the --target in the same place: its per-step top-1 agreement with the "
                         "target on both occurrences (give one per --target)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-files", type=int, default=None, help="small held-out corpus (smoke tests)")
    add_output_arguments(ap, "benchmarks/results/copy_probe.json")
    args = ap.parse_args(argv)
    out, = claim_outputs(ap, args, [args.out], __file__)
    if args.span < 2 or args.passages < 1:
        raise SystemExit("--span must be at least 2 and --passages at least 1")
    if args.free_running_tokens < 0 or args.free_running_shown < 1 or (
            args.free_running_tokens and args.free_running_shown + args.free_running_tokens > args.span):
        raise SystemExit("--free-running-shown must be >= 1 and --free-running-tokens >= 0, the two together at most "
                         "--span (the passage they are scored on)")
    if args.greedy_prompts < 0 or args.greedy_context < 1 or args.greedy_new_tokens < 4:
        raise SystemExit("--greedy-prompts must be >= 0, --greedy-context >= 1 and --greedy-new-tokens >= 4")
    gaps = [int(g) for g in args.gaps.split(",") if g]
    targets = [Path(t) for t in (args.target or ["diffspec_jax/demo/pair/target"])]
    if args.draft and len(args.draft) != len(targets):
        raise SystemExit(f"--draft pairs with --target in order: give one per target ({len(targets)}), got "
                         f"{len(args.draft)}")
    drafts = [Path(d) for d in args.draft] if args.draft else [None] * len(targets)
    from diffspec_jax.corpus import HELD_OUT, build_corpus

    corpus = build_corpus(max_files=args.max_files)
    if not corpus.held_out:
        raise SystemExit("no held-out documents in the corpus (raise --max-files)")
    payload = {"environment": environment(sys.argv if argv is None else ["benchmarks/copy_probe.py", *argv]),
               "settings": {**vars(args), "gaps": gaps, "held_out_packages": list(HELD_OUT)},
               "held_out_sha256": corpus.manifest.get("held_out_sha256"),
               "targets": [probe_target(t, corpus.held_out, span=args.span, gaps=gaps, count=args.passages,
                                        seed=args.seed, dtype=args.dtype,
                                        greedy=(args.greedy_prompts, args.greedy_context, args.greedy_new_tokens),
                                        free_running=(args.free_running_shown, args.free_running_tokens),
                                        layers=args.layers, draft=d)
                           for t, d in zip(targets, drafts)]}
    print("wrote", write_json(out, payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
