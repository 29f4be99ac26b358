"""Build the demo pair: ``python -m diffspec_jax.demo.build --out DIR`` (run on a GPU; minutes on an H200).

Steps, all recorded in ``DIR/model_card.json``:

1. corpus: the running interpreter's standard library (:mod:`diffspec_jax.corpus`), packages held out, plus the
   sources of installed packages named by ``--extra-packages`` (training only); ``--dedup-lines`` leaves
   near-duplicate training files out (:class:`~diffspec_jax.corpus.LineDeduplicator`);
2. tokenizer: byte-level BPE, vocabulary 4096, trained on the training split;
3. target: a 6-layer Llama (about 6 M parameters) trained from scratch with optax on windows of ``--seq-len``
   (default 16384) tokens, exported as a Hugging Face ``LlamaForCausalLM`` directory (bfloat16); optionally
   after a ``--curriculum`` of phases on shorter windows, and with ``--recall-fraction`` of the windows carrying a
   recall span (:class:`~diffspec_jax.training.TokenStream`: a passage copied to a later place in the window, so
   the target learns to continue a passage it saw earlier, as real LLMs do). Both are off by default: the
   committed pair was built without them (see ``benchmarks/README.md``, "Can the demo target copy?").
   ``--init-target DIR`` continues training an earlier build's target (its tokenizer and weights) instead of
   training a tokenizer and a target from scratch, so training can be spread over several GPU sessions;
4. draft: an EAGLE-3 draft trained with :mod:`diffspec_jax.train_draft` on 2048-token windows (as public drafts
   are; recall spans too when asked for), draft vocabulary 2048, exported in the SpecForge / vLLM layout
   (bfloat16);
5. evaluation: greedy speculative decoding of held-out prompts (both workloads of
   :func:`~diffspec_jax.corpus.held_out_prompts`) at 2K / 8K / 16K tokens with the ``full``, ``recent`` and
   ``diffspec`` policies, mean acceptance length and decode speed beside target-only decoding in the same run, a
   check that every output equals target-only output, and for ``recall`` how much of the file the target copies;
6. the demo prompt: the opening of a held-out module (``argparse``), >= 8K tokens.

The target's tokenizer carries :data:`CHAT_TEMPLATE` (``target/chat_template.jinja``), so the server's chat
endpoint works on the pair out of the box.

Every setting is checked before anything is read or written. ``--out`` is written safely
(:class:`diffspec_jax.outdir.OutputDir`): into ``OUT.partial`` (kept if the build fails), renamed into place at the
end with ``diffspec_manifest.json`` digests in ``OUT``, ``OUT/target`` and ``OUT/draft`` (``load_target`` /
``load_draft`` verify them). A non-empty ``--out`` is refused unless an earlier build wrote it or ``--overwrite``
is given (the old contents are then moved to ``OUT.replaced-<time>``; nothing is deleted), and so is an ``--out``
equal to, inside or around ``--init-target``. Exit status (``python -m``): 0 = built, 2 = usage error, 1 = other.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

from checkpoints_tools.hf import save_hf
from checkpoints_tools.inspect import file_hashes
from diffspec_jax.config import DRAFT_CONTEXT_POLICIES, ModelConfig, RopeConfig, SpecConfig
from diffspec_jax.corpus import (DEMO_PROMPT_PACKAGE, HELD_OUT, WORKLOADS, LineDeduplicator, build_corpus,
                                 copied_fraction, encode_documents, held_out_prompts, train_tokenizer)
from diffspec_jax.draft import load_draft
from diffspec_jax.engine import generate
from diffspec_jax.errors import CheckpointError, ConfigError
from diffspec_jax.outdir import OutputDir
from diffspec_jax.target import TargetModel, load_target
from diffspec_jax.train_draft import DEFAULT_ROPE_THETA, aux_layers_arg, export_draft, train_draft
from diffspec_jax.training import GreedyUnlikelihood, LoopWindows, OptimConfig, TokenStream, train_target
from diffspec_jax.validation import ArgumentParser, check_choice, check_int, check_real, run_main

#: the pair's chat template (written as ``target/chat_template.jinja``): the target is a small model of Python
#: source, so a conversation is rendered as Python, the user's and system's messages as comments and the
#: assistant's as code; the answer continues after the last message
CHAT_TEMPLATE = """{#- the demo pair: user and system messages as Python comments, the assistant's as code -#}
{%- for message in messages -%}
{%- if message['role'] == 'assistant' -%}
{{ message['content'] }}
{% else -%}
# {{ message['role'] }}: {{ message['content'] | replace('\\n', '\\n# ') }}
{% endif -%}
{%- endfor -%}
"""

CONTEXTS = (2048, 8192, 16384)
POLICIES = DRAFT_CONTEXT_POLICIES
TOOL = "diffspec_jax.demo.build"
ATTENTION = ("dense", "flash")
#: a byte-level BPE holds the 256 byte tokens and 2 special tokens before any merge
MIN_VOCAB = 258


#: the demo target's depth
LAYERS = 6
#: the draft's default aux layers: the inputs of a low, the middle and the last target layer
DEFAULT_AUX = (2, LAYERS // 2, LAYERS - 1)


def demo_target_config(vocab: int, eos: int, max_len: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=256, intermediate_size=640,
                       num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                       rms_norm_eps=1e-5, max_position_embeddings=max_len, tie_word_embeddings=False,
                       rope=RopeConfig(theta=500000.0), dtype="bfloat16", bos_token_id=eos, eos_token_ids=(eos,))


def parse_curriculum(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"512:32:10000,2048:8:2000"`` -> ((512, 32, 10000), (2048, 8, 2000)): (window, batch, steps) per phase."""
    try:
        phases = tuple(tuple(int(x) for x in part.split(":")) for part in text.split(",") if part)
    except ValueError:
        phases = ((),)
    if any(len(p) != 3 or min(p) < 1 for p in phases):
        raise argparse.ArgumentTypeError(f"--curriculum wants SEQ_LEN:BATCH:STEPS[,...] with positive integers, "
                                         f"got {text!r}")
    return phases


def span_parser(option: str):
    """The argparse type of ``option``: ``"64,1024"`` -> (64, 1024), the shortest and longest span in tokens."""
    def parse(text: str) -> tuple[int, int]:
        try:
            span = tuple(int(x) for x in text.split(","))
        except ValueError:
            span = ()
        if len(span) != 2:
            raise argparse.ArgumentTypeError(f"{option} wants SHORTEST,LONGEST in tokens, got {text!r}")
        return span
    return parse


#: the ModelConfig fields an ``--init-target`` checkpoint must share with :func:`demo_target_config`
INIT_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def initial_target(path: str | Path):
    """(tokenizer, float32 params in the training layout, model-card entry) of an earlier demo target
    (``--init-target``): a build's ``target/`` directory, tokenizer included. The card entry names the checkpoint
    (sha256 of its files) and, when the build's ``model_card.json`` sits beside it, how that target was trained.

    Raises:
        CheckpointError: no checkpoint or no tokenizer at ``path``.
        ConfigError: a checkpoint whose shapes are not the demo target's.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    model = load_target(path, "float32", fuse_projections=False)
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"--init-target {path} has no tokenizer.json: give a demo build's target directory")
    tok = AutoTokenizer.from_pretrained(path)
    want = demo_target_config(len(tok), tok.eos_token_id, model.config.max_position_embeddings)
    for name in INIT_FIELDS:
        if getattr(model.config, name) != getattr(want, name):
            raise ConfigError(f"--init-target {path}: {name} is {getattr(model.config, name)!r}, the demo target "
                              f"has {getattr(want, name)!r}")
    entry = {"path": str(path), "sha256": file_hashes(path, (".safetensors",))}
    card = path.parent / "model_card.json"
    if card.is_file():
        prev = json.loads(card.read_text())
        entry["trained_by"] = {"command": prev["commands"]["build"],
                               "steps": prev["target"]["steps"]
                               + sum(p["steps"] for p in prev["target"].get("curriculum", [])),
                               "init_target": prev["target"].get("init_target")}
    return tok, model.params, entry


def evaluate(target, draft, prompts_by_case: dict[tuple[str, int], list], new_tokens: int, k: int, budget: int,
             chunk: int) -> list[dict]:
    """Acceptance and decode speed per (workload, context, policy), beside target-only decoding of the same
    prompts (:class:`~diffspec_jax.corpus.Prompt` lists keyed by (workload, context))."""
    rows = []
    cap = max(len(p.ids) for ps in prompts_by_case.values() for p in ps) + new_tokens + k + 1
    for (workload, ctx), cases in prompts_by_case.items():
        prompts = [p.ids for p in cases]
        kw = dict(max_new_tokens=new_tokens, stop_token_ids=(), max_cache_len=cap)
        generate(target, None, prompts, **kw)  # warm-up (compile)
        base = generate(target, None, prompts, **kw)
        rows.append({"workload": workload, "context": ctx, "policy": "target-only",
                     "decode_tokens_per_s": base.stats.decode_tokens_per_s,
                     "prompts": [p.describe() for p in cases]})
        if workload == "recall":
            rows[-1]["copied_fraction"] = copied_fraction(base.tokens, cases)
        print(json.dumps(rows[-1]), flush=True)
        for policy in POLICIES:
            spec = SpecConfig.from_flat(dict(num_speculative_tokens=k, draft_context_policy=policy,
                                             diffspec_chunk_size=chunk, diffspec_token_budget=budget))
            generate(target, draft, prompts, spec=spec, **kw)
            res = generate(target, draft, prompts, spec=spec, **kw)
            s = res.stats
            rows.append({"workload": workload, "context": ctx, "policy": policy,
                         "mean_acceptance_length": s.mean_acceptance_length,
                         "acceptance_per_position": s.acceptance_per_position,
                         "decode_tokens_per_s": s.decode_tokens_per_s,
                         "speedup_vs_target": s.decode_tokens_per_s / base.stats.decode_tokens_per_s,
                         "identical_to_target_only": res.tokens == base.tokens,
                         "retrievals": (s.retrieval or {}).get("aggregate", {}).get("retrievals")})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _target_training(t: dict) -> str:
    """The model card's account of how the target was trained (``t``: the card's ``target`` entry)."""
    init = t.get("init_target")
    earlier = f"`{init['path']}` ({init.get('trained_by', {}).get('steps', '?')} earlier steps)" if init else ""
    if not t["steps"]:  # --target-steps 0
        return f"kept as it is from {earlier}; this build did not train it."
    phases = "".join(f"{p['steps']} steps x {p['batch']} sequences of {p['seq_len']} tokens, then "
                     for p in t.get("curriculum", []))
    return ((f"continued from {earlier}, " if init else "") + f"trained {phases}{t['steps']} steps x {t['batch']} "
            f"sequences of {t['seq_len']} tokens (AdamW, warm-up + cosine) in {t['train_seconds']:.0f} s; final "
            f"train loss {t['final']['loss']:.3f}, held-out loss {t['final'].get('eval_loss', float('nan')):.3f} "
            "(nats/token).")


def model_card_markdown(card: dict) -> str:
    """The human-readable model card (``MODEL_CARD.md``) of a ``model_card.json``."""
    d, t, dr, ev = card["data"], card["target"], card["draft"], card.get("eval", {})
    lines = [
        "# diffspec-jax demo pair", "",
        "A small Llama target and its EAGLE-3 draft, trained from scratch by this project on Python sources (below) "
        "so that acceptance (the quantity DiffSpec raises) can be measured without downloading weights. They write "
        "plausible-looking Python and nothing more: a demonstration pair, not a useful model.", "",
        "## Data",
        f"- Python {d['python']} standard library sources ({d['train_files']} training files, "
        f"{d['held_out_files']} held out; packages held out: {', '.join(d['held_out_packages'])}).",
        *([f"- Also in training (counted in the training files above): the sources of "
           f"{', '.join(f'{k} {v}' for k, v in d['extra_packages'].items())} (one document per directory)."]
          if d.get("extra_packages") else []),
        *([f"- Near-duplicate files left out of training: {d['dedup']['dropped_files']} files "
           f"({d['dedup']['dropped_chars']} characters) of which more than {d['dedup']['threshold']:.0%} of the lines "
           f"of {d['dedup']['min_chars']}+ characters occurred in earlier training files."] if d.get("dedup") else []),
        f"- Documents are packages (files concatenated): repository-level context. Training tokens: "
        f"{d.get('train_tokens')}; held-out tokens: {d.get('held_out_tokens')}.",
        *([f"- Recall spans: {t['recall_fraction']:.0%} of the training windows copy "
           + (f"{t['recall_spans']} passages" if t.get("recall_spans", 1) > 1 else "a passage") + " of "
           f"{t['recall_span'][0]}-{t['recall_span'][1]} tokens ({t['recall_noise']:.0%} of its tokens replaced "
           "first) to a later place in the same window"
           + (f", at least {t['recall_distance']:.0%} of the window after it" if t.get("recall_distance") else "")
           + (" (distance drawn uniformly)" if t.get("recall_uniform_distance") else "")
           + (f"; {t['recall_random']:.0%} of the passages are uniform random token ids" if t.get("recall_random")
              else "")
           + (f"; {t['recall_mismatch']:.0%} of each copy's tokens are replaced after copying (the copy resumes "
              "after each)" if t.get("recall_mismatch") else "")
           + "."] if t.get("recall_fraction") else []),
        *([f"- Loop rows: {t['loops']['rows']} windows of {t['loops']['loop_len']} tokens per step whose tail repeats "
           f"a line of {t['loops']['span'][0]}-{t['loops']['span'][1]} tokens; each repetition is trained to "
           f"{t['loops']['decay']:g}x the probability of the one before (weight {t['loops']['weight']:g}), against "
           "greedy loops."] if t.get("loops") else []),
        *([f"- Greedy unlikelihood: each step the target continues {t['unlikelihood']['rows']} prompts of "
           f"{t['unlikelihood']['context']} tokens greedily for {t['unlikelihood']['new_tokens']} tokens; each token "
           f"that repeats a {t['unlikelihood']['ngram']}-gram of its own continuation is trained down "
           f"(-log(1 - p), weight {t['unlikelihood']['weight']:g})."] if t.get("unlikelihood") else []),
        f"- sha256 of the training text {d['train_sha256']}, of the held-out text {d['held_out_sha256']}; "
        "file lists in `corpus_files.json`.",
        f"- Tokenizer: byte-level BPE, vocabulary {card['tokenizer']['vocab_size']} (`target/tokenizer.json`).", "",
        "## Models",
        f"- Target: `LlamaForCausalLM`, {t['parameters']:,} parameters, {t['config']['num_hidden_layers']} layers, "
        f"hidden {t['config']['hidden_size']}, {t['config']['num_attention_heads']} heads / "
        f"{t['config']['num_key_value_heads']} KV heads, "
        + _target_training(t)
        + " Stored in bfloat16.",
        f"- Draft: EAGLE-3 (SpecForge / vLLM layout), {dr['parameters']:,} trainable parameters (embedding shared "
        f"with the target), draft vocabulary {dr['config']['draft_vocab_size']}, aux layers "
        f"{dr['config'].get('eagle_config', {}).get('eagle_aux_hidden_state_layer_ids')}, trained {dr['steps']} "
        f"steps x {dr['batch']} windows of {dr['seq_len']} tokens with {dr['ttt_steps']}-step training-time test in "
        f"{dr['train_seconds']:.0f} s; final loss {dr['final']['loss']:.3f}, held-out teacher-forced acceptance "
        f"length {dr['final'].get('eval_acceptance_length', float('nan')):.2f}.",
        f"- Built on {card['device']} with JAX {card['jax']} in {card.get('build_seconds', 0):.0f} s.", "",
        "## Acceptance (greedy, measured by the build)",
        f"{ev.get('prompts_per_context')} held-out prompts per context and workload ({ev.get('prompt_source')}), "
        f"{ev.get('new_tokens')} new tokens, K = {ev.get('k')}, working-cache budget {ev.get('budget')}, chunk "
        f"{ev.get('chunk')}. Mean acceptance length = tokens emitted per verification (bonus included); speed is "
        "decode tokens/s over target-only decoding of the same prompts in the same run. For `recall`, the "
        "target-only row gives the share of new tokens that continue the re-emitted file verbatim.", "",
        "| workload | context | policy | mean acceptance length | decode tok/s | speedup vs target-only |",
        "|---|---:|---|---:|---:|---:|"]
    for r in card.get("acceptance", []):
        w = r.get("workload", "windows")
        if r["policy"] == "target-only":
            copied = f" (copies {r['copied_fraction']:.0%})" if "copied_fraction" in r else ""
            lines.append(f"| {w} | {r['context']} | target-only{copied} | - | {r['decode_tokens_per_s']:.0f} | 1.00 |")
        else:
            lines.append(f"| {w} | {r['context']} | {r['policy']} | {r['mean_acceptance_length']:.2f} | "
                         f"{r['decode_tokens_per_s']:.0f} | {r['speedup_vs_target']:.2f} |")
    earlier = (t.get("init_target") or {}).get("trained_by")
    lines += ["", "## Rebuild", "```bash",
              *([f"# first the build whose target this one continues (--init-target {t['init_target']['path']})",
                 earlier["command"]] if earlier else []),
              card["commands"]["build"], "```", ""]
    return "\n".join(lines)


def build_parser() -> ArgumentParser:
    """The build's parser (usage errors: one line, exit status 2)."""
    ap = ArgumentParser(prog="python -m diffspec_jax.demo.build", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (written to OUT.partial, then renamed)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a non-empty --out that no build wrote (its contents are moved to "
                         "OUT.replaced-<time>, nothing is deleted)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--target-steps", type=int, default=600,
                    help="target training steps (0 with --init-target: keep that target as it is and train a new "
                         "draft for it)")
    ap.add_argument("--target-batch", type=int, default=4)
    ap.add_argument("--curriculum", type=parse_curriculum, default=(),
                    help="target phases before the main one, SEQ_LEN:BATCH:STEPS[,...], e.g. 512:32:10000")
    ap.add_argument("--init-target", default=None,
                    help="continue training this earlier build's target directory (its tokenizer and weights; "
                         "--vocab is then ignored)")
    ap.add_argument("--recall-fraction", type=float, default=0.0, help="training windows with a recall span")
    ap.add_argument("--recall-span", type=span_parser("--recall-span"), default=(64, 1024),
                    help="shortest,longest recall span (tokens)")
    ap.add_argument("--recall-distance", type=float, default=0.0,
                    help="shortest distance from a recall passage to its copy, as a share of the window (0-0.75)")
    ap.add_argument("--recall-uniform-distance", action="store_true",
                    help="draw each recall span's distance uniformly (far copies as common as near ones)")
    ap.add_argument("--recall-noise", type=float, default=0.0, help="share of a recall passage's tokens replaced")
    ap.add_argument("--recall-mismatch", type=float, default=0.0,
                    help="share of a recall copy's tokens replaced after copying (the copy resumes after each), so "
                         "the target keeps copying after a wrong token")
    ap.add_argument("--recall-spans", type=int, default=1,
                    help="recall spans per window that gets them (more copied tokens per step; spans never overlap)")
    ap.add_argument("--recall-random", type=float, default=0.0,
                    help="share of recall passages made of uniform random token ids (copyable only by reading them)")
    ap.add_argument("--loop-rows", type=int, default=0,
                    help="loop rows per target step, trained out of greedy repetition (0: off; LoopWindows)")
    ap.add_argument("--loop-len", type=int, default=1024, help="tokens per loop row")
    ap.add_argument("--loop-span", type=span_parser("--loop-span"), default=LoopWindows.loop_span,
                    help="shortest,longest repeated period of a loop row (tokens; longest <= --loop-len / 4)")
    ap.add_argument("--loop-decay", type=float, default=0.5,
                    help="each repetition's probability over the one before it, as the loop rows teach")
    ap.add_argument("--loop-weight", type=float, default=1.0, help="weight of the loop penalty beside the LM loss")
    ap.add_argument("--unlikelihood-rows", type=int, default=0,
                    help="prompts per target step that the target continues greedily, its repeated 4-grams trained "
                         "down (0: off; GreedyUnlikelihood)")
    ap.add_argument("--unlikelihood-context", type=int, default=GreedyUnlikelihood.context,
                    help="tokens per unlikelihood prompt")
    ap.add_argument("--unlikelihood-new-tokens", type=int, default=GreedyUnlikelihood.new_tokens,
                    help="greedy tokens per unlikelihood prompt")
    ap.add_argument("--unlikelihood-weight", type=float, default=1.0,
                    help="weight of the unlikelihood penalty beside the LM loss")
    ap.add_argument("--draft-steps", type=int, default=800)
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--draft-seq-len", type=int, default=2048)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--draft-aux-layers", type=aux_layers_arg, default=None,
                    help=f"target layers whose input states the draft reads, comma-separated (0: the token embeddings; "
                         f"default {','.join(map(str, DEFAULT_AUX))}: low, middle and last layer)")
    ap.add_argument("--draft-rope-theta", type=float, default=DEFAULT_ROPE_THETA,
                    help=f"the draft's RoPE base (default {DEFAULT_ROPE_THETA:g}; a larger one, such as the target's "
                         f"500000, keeps its attention's content matches over long distances)")
    ap.add_argument("--eval-new-tokens", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--attention", default="flash" if jax.default_backend() == "gpu" else "dense", choices=ATTENTION)
    ap.add_argument("--max-files", type=int, default=None, help="small corpora for smoke tests")
    ap.add_argument("--extra-packages", default="", help="comma-separated installed packages whose sources join the "
                                                         "training split (e.g. transformers,torch)")
    ap.add_argument("--dedup-lines", type=float, default=None,
                    help="drop training files of which more than this share of lines (16+ characters) occurred in "
                         "earlier training files, e.g. 0.3 (default: keep all)")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="evaluation context lengths")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="evaluation workloads")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def _recall_options(args) -> dict:
    """The build's ``--recall-*`` options as :class:`TokenStream` keyword arguments."""
    return dict(recall_fraction=args.recall_fraction, recall_span=args.recall_span, recall_noise=args.recall_noise,
                recall_distance=args.recall_distance, recall_random=args.recall_random,
                recall_uniform=args.recall_uniform_distance, recall_mismatch=args.recall_mismatch,
                recall_spans=args.recall_spans)


def check_settings(args) -> tuple[list[int], list[str]]:
    """Every setting of the build, checked before anything is read or written (a :class:`ConfigError` naming the
    first bad one). Returns the evaluation contexts and workloads."""
    TokenStream([], 0, vocab_size=args.vocab, **_recall_options(args))
    check_int(args.loop_rows, "--loop-rows", min=0)
    check_int(args.unlikelihood_rows, "--unlikelihood-rows", min=0)
    _loops(args, TokenStream([], 0))
    _unlikelihood(args, TokenStream([], 0))
    if args.dedup_lines is not None:
        LineDeduplicator(args.dedup_lines)
    check_int(args.vocab, "--vocab", min=MIN_VOCAB, hint=" (the 256 byte tokens and 2 special tokens at least)")
    check_int(args.target_steps, "--target-steps", min=0)
    if not args.target_steps and not (args.init_target and not args.curriculum):
        raise ConfigError("--target-steps 0 keeps --init-target's weights as they are: give --init-target (and no "
                          "--curriculum)")
    for name in ("seq_len", "target_batch", "draft_steps", "draft_batch", "draft_seq_len",
                 "eval_new_tokens", "eval_prompts", "k", "budget", "chunk"):
        check_int(getattr(args, name), "--" + name.replace("_", "-"), min=1)
    check_int(args.draft_vocab, "--draft-vocab", min=1, max=None if args.init_target else args.vocab,
              hint="" if args.init_target else f" (at most --vocab {args.vocab})")
    check_int(args.max_files, "--max-files", min=1, none_ok=True)
    check_real(args.draft_rope_theta, "--draft-rope-theta", min=0.0, min_open=True)
    for a in args.draft_aux_layers or ():
        check_int(a, "--draft-aux-layers entry", min=0, max=LAYERS - 1, hint=f" (the demo target has {LAYERS} layers)")
    check_int(args.seed, "--seed", min=0)
    check_choice(args.attention, "--attention", ATTENTION)
    for policy in POLICIES:  # the evaluation's settings
        SpecConfig.from_flat(dict(num_speculative_tokens=args.k, draft_context_policy=policy,
                                  diffspec_chunk_size=args.chunk, diffspec_token_budget=args.budget))
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        contexts = []
    if not contexts or min(contexts) < 1:
        raise ConfigError(f"--contexts wants comma-separated positive context lengths such as 2048,8192, got "
                          f"{args.contexts!r}")
    workloads = args.workloads.split(",")
    for w in workloads:
        check_choice(w, "--workloads entry", WORKLOADS)
    for name in (x for x in args.extra_packages.split(",") if x):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"--extra-packages: {name!r} is not an installed package directory")
    return contexts, workloads


def _loops(args, stream: TokenStream) -> LoopWindows | None:
    """The target's loop rows (``--loop-rows``; None when 0)."""
    if not args.loop_rows:
        return None
    return LoopWindows(stream, rows=args.loop_rows, loop_len=args.loop_len, loop_span=args.loop_span,
                       decay=args.loop_decay, weight=args.loop_weight)


def _unlikelihood(args, stream: TokenStream) -> GreedyUnlikelihood | None:
    """The target's greedy-unlikelihood prompts (``--unlikelihood-rows``; None when 0)."""
    if not args.unlikelihood_rows:
        return None
    return GreedyUnlikelihood(stream, rows=args.unlikelihood_rows, context=args.unlikelihood_context,
                              new_tokens=args.unlikelihood_new_tokens, weight=args.unlikelihood_weight)


def main(argv: list[str] | None = None) -> int:
    """Build the pair into ``--out``. Deliberate errors are raised (``python -m`` prints them as one line)."""
    args = build_parser().parse_args(argv)
    contexts, workloads = check_settings(args)  # nothing read or written yet
    target_out = OutputDir(args.out, tool=TOOL, inputs=[args.init_target], overwrite=args.overwrite,
                           manifests=("target", "draft", "."), keep_on_error=True)
    target_out.check()  # refusals (an --out to keep, --init-target inside it) before the init target is read
    params, init, init_tok = None, None, None
    if args.init_target:
        init_tok, params, init = initial_target(args.init_target)
    with target_out as out:
        seconds = _build(args, argv, out, contexts, workloads, params, init, init_tok)
    print(f"built the demo pair in {args.out} ({seconds:.0f} s)")
    return 0


def _train_target(args, tcfg, train_stream: TokenStream, held_stream: TokenStream, params, out: Path, loops,
                  unlikelihood) -> tuple[dict, list[dict], list[dict]]:
    """The target's curriculum phases, then its main phase (none with ``--target-steps 0``: the ``--init-target``
    weights as they are). Returns (float32 params, the phases' records, the main phase's history)."""
    phases = []
    for seq_len, batch, steps in args.curriculum:
        params, hist = train_target(
            tcfg, train_stream, params=params, steps=steps, batch=batch, seq_len=seq_len,
            optim=OptimConfig(lr=3e-3, warmup_steps=max(1, steps // 20), total_steps=steps),
            seed=args.seed + len(phases) + 1, attention=args.attention, log_every=max(1, steps // 20),
            progress=False, loops=loops, unlikelihood=unlikelihood)
        for row in hist:
            print(f"target-{seq_len}", json.dumps(row), flush=True)
        phases.append({"seq_len": seq_len, "batch": batch, "steps": steps, "final": hist[-1], "history": hist})
    t_hist = []  # --target-steps 0: the --init-target weights as they are
    if args.target_steps:
        params, t_hist = train_target(
            tcfg, train_stream, params=params, steps=args.target_steps, batch=args.target_batch, seq_len=args.seq_len,
            optim=OptimConfig(lr=3e-3, warmup_steps=max(1, args.target_steps // 20), total_steps=args.target_steps),
            ckpt_dir=out / "ckpt_target", seed=args.seed, attention=args.attention, eval_stream=held_stream,
            eval_every=max(1, args.target_steps // 4), log_every=max(1, args.target_steps // 20), progress=False,
            loops=loops, unlikelihood=unlikelihood)
    return params, phases, t_hist


def _build(args, argv, out: Path, contexts: list[int], workloads: list[str], params, init, init_tok) -> float:
    """The build's steps, writing into ``out`` (the partial directory); returns the build's seconds."""
    (out / "target").mkdir(parents=True)
    t_start = time.perf_counter()
    card: dict = {"commands": {"build": "python -m diffspec_jax.demo.build " + " ".join(argv or sys.argv[1:])},
                  "device": str(jax.devices()[0].device_kind if hasattr(jax.devices()[0], "device_kind")
                                else jax.devices()[0]),
                  "jax": jax.__version__, "settings": vars(args)}

    extra = tuple(x for x in args.extra_packages.split(",") if x)
    corpus = build_corpus(max_files=args.max_files, extra_packages=extra, dedup_threshold=args.dedup_lines)
    if not corpus.held_out:
        raise ConfigError(f"the corpus has no held-out documents (packages {', '.join(HELD_OUT)}): --max-files "
                          f"{args.max_files} keeps too few files")
    card["data"] = {k: v for k, v in corpus.manifest.items() if k != "files"}
    (out / "corpus_files.json").write_text(json.dumps(corpus.manifest["files"]) + "\n")
    tok = init_tok if args.init_target else train_tokenizer([d.text for d in corpus.train], args.vocab)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out / "target")
    eos = tok.eos_token_id
    encode = lambda docs: [np.asarray(x, np.int32) for x in tok([d.text for d in docs])["input_ids"]]  # noqa: E731
    train_stream = TokenStream(encode(corpus.train), eos, vocab_size=len(tok), **_recall_options(args))
    held_enc = encode_documents(tok, corpus.held_out)
    held_docs = {e.name: e.ids for e in held_enc}
    held_stream = TokenStream(list(held_docs.values()), eos)
    card["data"]["train_tokens"] = len(train_stream)
    card["data"]["held_out_tokens"] = len(held_stream)
    card["tokenizer"] = {"type": "byte-level BPE", "vocab_size": len(tok)}

    tcfg = demo_target_config(len(tok), eos, max_len=max(32768, 2 * args.seq_len))
    loops, unlikelihood = _loops(args, train_stream), _unlikelihood(args, train_stream)
    t0 = time.perf_counter()
    params, phases, t_hist = _train_target(args, tcfg, train_stream, held_stream, params, out, loops, unlikelihood)
    for row in t_hist:
        print("target", json.dumps(row), flush=True)
    card["target"] = {"architecture": "LlamaForCausalLM", "parameters": tcfg.num_parameters,
                      "config": tcfg.to_hf_dict(), "steps": args.target_steps, "batch": args.target_batch,
                      "seq_len": args.seq_len, "recall_fraction": args.recall_fraction,
                      "recall_span": list(args.recall_span), "recall_noise": args.recall_noise,
                      "recall_distance": args.recall_distance, "recall_random": args.recall_random,
                      "recall_uniform_distance": args.recall_uniform_distance,
                      "recall_mismatch": args.recall_mismatch, "recall_spans": args.recall_spans,
                      "loops": ({"rows": loops.rows, "loop_len": loops.loop_len, "span": list(loops.loop_span),
                                 "decay": loops.decay, "weight": loops.weight} if loops else None),
                      "unlikelihood": ({"rows": unlikelihood.rows, "context": unlikelihood.context,
                                        "new_tokens": unlikelihood.new_tokens, "ngram": unlikelihood.ngram,
                                        "weight": unlikelihood.weight} if unlikelihood else None),
                      "curriculum": phases,
                      "init_target": init,
                      "train_seconds": time.perf_counter() - t0,
                      "final": t_hist[-1] if t_hist else None, "history": t_hist}
    save_hf(out / "target", tcfg, params, dtype="bfloat16", max_shard_bytes=7 << 20)  # shards < 8 MiB
    target_f32 = TargetModel(tcfg, params)

    t0 = time.perf_counter()
    dcfg, dparams, d_hist = train_draft(
        target_f32, train_stream, steps=args.draft_steps, batch=args.draft_batch, seq_len=args.draft_seq_len,
        ttt_steps=4, draft_vocab=args.draft_vocab, aux_layers=args.draft_aux_layers or DEFAULT_AUX,
        optim=OptimConfig(lr=2e-3, warmup_steps=max(1, args.draft_steps // 20), total_steps=args.draft_steps),
        ckpt_dir=out / "ckpt_draft", seed=args.seed, attention=args.attention, eval_stream=held_stream,
        eval_every=max(1, args.draft_steps // 4), log_every=max(1, args.draft_steps // 20), progress=False,
        rope_theta=args.draft_rope_theta)
    for row in d_hist:
        print("draft", json.dumps(row), flush=True)
    export_draft(out / "draft", dcfg, dparams, dtype="bfloat16")
    card["draft"] = {"format": "EAGLE-3 (SpecForge / vLLM layout)", "config": dcfg.to_hf_dict(),
                     "parameters": int(sum(np.size(v) for k, v in dparams.items() if k not in ("embed", "d2t"))),
                     "steps": args.draft_steps, "batch": args.draft_batch, "seq_len": args.draft_seq_len,
                     "ttt_steps": 4, "recall_fraction": args.recall_fraction,
                     "train_seconds": time.perf_counter() - t0, "final": d_hist[-1],
                     "history": d_hist}
    shutil.rmtree(out / "ckpt_target", ignore_errors=True)
    shutil.rmtree(out / "ckpt_draft", ignore_errors=True)

    # the demo prompt: the opening of a held-out module
    argparse_ids = held_docs.get(DEMO_PROMPT_PACKAGE, next(iter(held_docs.values())))
    prompt_ids = argparse_ids[: min(len(argparse_ids), 10000)]
    (out / "demo_prompt.txt").write_text(tok.decode(prompt_ids))
    card["demo_prompt"] = {"source": f"held-out stdlib module {DEMO_PROMPT_PACKAGE}", "tokens": int(len(prompt_ids))}

    target = load_target(out / "target", dtype="bfloat16")
    draft = load_draft(out / "draft", target)
    eval_docs = [e for e in held_enc if e.name != DEMO_PROMPT_PACKAGE]
    prompts = {(w, ctx): held_out_prompts(eval_docs, ctx, args.eval_prompts, args.seed + 7 + ctx, w,
                                          new_tokens=args.eval_new_tokens)
               for w in workloads for ctx in contexts}
    try:
        card["acceptance"] = evaluate(target, draft, prompts, args.eval_new_tokens, args.k, args.budget, args.chunk)
    except Exception as exc:  # keep the trained pair even if evaluation breaks; record why
        card["acceptance_error"] = f"{type(exc).__name__}: {exc}"
        os.environ["DIFFSPEC_KERNELS"] = "reference"
        card["acceptance"] = evaluate(target, draft, prompts, args.eval_new_tokens, args.k, args.budget, args.chunk)
        card["acceptance_kernels"] = "reference (Pallas failed, see acceptance_error)"
    card["eval"] = {"prompts_per_context": args.eval_prompts, "new_tokens": args.eval_new_tokens, "k": args.k,
                    "budget": args.budget, "chunk": args.chunk, "greedy": True,
                    "prompt_source": "held-out packages other than argparse; workloads: "
                                     + ", ".join(workloads)}
    card["build_seconds"] = time.perf_counter() - t_start
    (out / "model_card.json").write_text(json.dumps(card, indent=1) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card_markdown(card))
    return card["build_seconds"]


if __name__ == "__main__":
    raise SystemExit(run_main(main))
