"""``python -m diffspec_jax.generate``: speculative generation from the command line.

Examples::

    python -m diffspec_jax.generate                                  # the embedded default pair
    python -m diffspec_jax.generate --target T --draft D --prompt "def main():" --max-new-tokens 128
    python -m diffspec_jax.generate --target T --draft D --prompt-file long.py --policy diffspec --json
    python -m diffspec_jax.generate --example recall                 # where DiffSpec's retrieval matters (below)
    python -m diffspec_jax.generate --target T --draft self --prompt-file long.py   # the target drafts for itself
    python -m diffspec_jax.generate --target T --draft ngram --prompt-file long.py  # prompt lookup, no draft model

The tokenizer (and, with ``--chat``, its chat template) comes from the target directory through
``transformers.AutoTokenizer`` when the directory has one; otherwise prompts are given as ids
(``--prompt-ids``) and output is printed as ids. Text streams to stdout (decoded incrementally, special tokens
left out unless ``--keep-special-tokens``, cut before the first ``--stop`` string); progress and the statistics go
to stderr: a progress bar, or, when stdout and stderr are the same terminal, one status line before the text and
the statistics after it. ``--json`` prints one JSON object instead. Sampling settings not given default to the
target's ``generation_config.json`` (greedy without one), and its EOS ids end generation. ``--compare`` also runs
target-only decoding on the same prompt (both paths warmed up first) and reports each run's prefill and decode
times, the decode speedup and the end-to-end speedup (prefill + decode), a line on why when either is below 1, and
whether the outputs are identical (greedy) or why they differ (sampling). The embedded pair compares by default
(``--no-compare`` runs the speculative path alone, without the warm-up runs); ``--no-draft`` never compares.

``--example recall`` runs the embedded pair on a prompt where DiffSpec's retrieval matters: the built-in prompt's
file, 8K tokens of it, then the file's first 64 tokens again, so that a continuation that copies re-emits the
file from 8K tokens back, far beyond a working cache of 1024 positions (``--token-budget`` changes it), which the
``recent`` window cannot reach and ``diffspec`` can retrieve. It decodes the same prompt greedily three times
(target-only, ``--policy diffspec``, ``--policy recent``; same ``--max-new-tokens``) and reports each policy's mean
acceptance length, DiffSpec's retrieval counters, whether each output is identical to target-only, and how much of
the file the target's own output re-emits (``--json``: one object). It brings its own prompt, pair, policies and
greedy sampling, so the options that set those are usage errors with it.

This module is also callable: ``diffspec_jax.generate(target, draft, prompts, ...)`` is
:func:`diffspec_jax.engine.generate` whether ``diffspec_jax.generate`` names the function or this module.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np

from diffspec_jax import corpus, demo, engine, stopping
from diffspec_jax import target as tgt
from diffspec_jax.draft import load_draft
from diffspec_jax.mesh import make_mesh
from diffspec_jax.target import check_token_ids, load_target
from diffspec_jax.config import (KERNEL_CHOICES, KERNELS_ENV, KV_CACHE_DTYPES, DiffSpec, NGram, SamplingConfig,
                                 SpecConfig, Tree)
from diffspec_jax.engine.drafter import named_drafts
from diffspec_jax.errors import CheckpointError, ConfigError, DiffspecError, InputError
from diffspec_jax.validation import (ArgumentParser, check_generate_args, check_int, check_stop_strings,
                                     decode_text, quiet_library_notices, read_at_most, read_text, report_error)


def default_pair() -> tuple[Path, Path]:
    """The embedded default pair shipped in the package (``diffspec_jax/demo/pair``): a small Llama trained on
    the Python standard library and its EAGLE-3 draft (see ``MODEL_CARD.md`` there)."""
    return demo.target_dir(), demo.draft_dir()


def _tokenizer(path: Path):
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # tokenizers / transformers raise many types for damaged files
        raise CheckpointError(f"cannot load the tokenizer in {path} ({type(exc).__name__}: {exc}); its tokenizer "
                              f"files are damaged or incomplete") from exc


#: the largest prompt ``--prompt-file`` (or standard input) reads by default: 2**20 tokens (beyond the context window
#: of every supported model) at 16 bytes per token (UTF-8 text averages about 4); ``--max-prompt-bytes`` raises it
MAX_PROMPT_BYTES = 16 << 20


#: the built-in examples of ``--example``
EXAMPLES = ("recall",)
#: ``--example recall``: the prompt's tokens (the re-emitted passage's first copy is this far back), the passage's
#: tokens, and the working-cache budget unless ``--token-budget`` is given (far below the distance, so the
#: ``recent`` window cannot hold the passage)
RECALL_CONTEXT, RECALL_PASSAGE, RECALL_BUDGET = 8192, 64, 1024
#: the draft-context policies ``--example recall`` compares, in the order it runs them
RECALL_POLICIES = ("diffspec", "recent")
#: below this share of new tokens re-emitting the passage, the target itself barely copies it, which bounds what
#: retrieval can add to the draft's acceptance
LOW_COPYING = 0.5


def _prompt_text(args) -> str | None:
    """The prompt text of ``--prompt-file`` (``-``: standard input) or ``--prompt``; ``None`` for ``--prompt-ids``
    or the built-in prompt. A file or input of more than ``--max-prompt-bytes`` bytes is refused after reading
    that many (so ``/dev/zero`` fails at once)."""
    hint = f" of --max-prompt-bytes ({MAX_PROMPT_BYTES} by default); pass a larger --max-prompt-bytes"
    if args.prompt_file == "-":
        text = decode_text(read_at_most(sys.stdin.buffer, args.max_prompt_bytes, "standard input", InputError,
                                        hint), "standard input")
        if not text.strip():
            raise InputError("--prompt-file - read an empty prompt from standard input")
        return text
    if args.prompt_file is not None:
        return read_text(args.prompt_file, "prompt file", max_bytes=args.max_prompt_bytes, raise_hint=hint)
    return args.prompt


def _prompt_ids(args, text: str | None, tok) -> list[int]:
    if args.prompt_ids is not None:
        parts = [x.strip() for x in args.prompt_ids.split(",")]
        if not any(parts):
            raise InputError("--prompt-ids is empty: give comma-separated token ids, e.g. --prompt-ids 1,2,3")
        ids = []
        for i, x in enumerate(parts):
            if not x:
                raise InputError(f"--prompt-ids has an empty entry (item {i + 1} of {args.prompt_ids!r}); give "
                                 f"comma-separated token ids, e.g. --prompt-ids 1,2,3")
            try:
                ids.append(int(x))
            except ValueError:
                raise InputError(f"--prompt-ids must be comma-separated integers, got {x!r} in "
                                 f"{args.prompt_ids!r}") from None
        return ids
    if text is None:
        text = demo.prompt_text()  # the built-in long prompt: a held-out standard-library module
    if tok is None:
        raise InputError("the target directory has no tokenizer; pass --prompt-ids")
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise InputError("--chat: the target's tokenizer has no chat template")
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers v5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return list(tok(text, add_special_tokens=True)["input_ids"])


def add_model_arguments(ap) -> None:
    """``--target``, ``--draft``, ``--no-draft``, ``--no-verify``, ``--dtype`` and ``--kv-cache-dtype`` (shared by
    the command-line tools that decode: this one and ``python -m diffspec_jax.serve``); :func:`model_dirs` reads
    them."""
    ap.add_argument("--target", help="Hugging Face or Orbax target directory (default: the embedded pair)")
    ap.add_argument("--draft", help="EAGLE-3 draft directory (default: the embedded pair's draft, if no --target), "
                                    "'self': the target drafts for itself over its working set "
                                    "(docs/self_drafting.md), or 'ngram': prompt lookup, the continuation of the "
                                    "longest recent n-gram match in the sequence (no draft model; --ngram-min-n, "
                                    "--ngram-max-n). A directory named self or ngram is ./self or ./ngram")
    ap.add_argument("--no-draft", action="store_true", help="target-only autoregressive decoding (no draft)")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip the integrity checks at load: the diffspec_manifest.json digests and the NaN / inf / "
                         "magnitude check of the weights (docs/checkpoints.md)")
    ap.add_argument("--dtype", default="auto",
                    help="auto | bfloat16 | float32. auto: float32 on the CPU, bfloat16 on accelerators (XLA:CPU "
                         "widens bfloat16 products to float32 with a conversion pass over the KV cache per step, "
                         "which made bfloat16 decoding of the demo pair 3x slower than float32 on a 2-core CPU)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the target's K/V cache: auto (the model's dtype) | fp8 (float8 e4m3 rows with a float32 "
                         "scale per token and KV head, about 1.9x the tokens in the same memory; speculation stays "
                         "lossless relative to the target on the fp8 cache; docs/serving.md)")


def named_draft(args) -> str | None:
    """``--draft`` when it names a drafter (:func:`~diffspec_jax.engine.drafter.named_drafts`: ``self``, ``ngram``)
    and ``--no-draft`` is not given; else ``None``."""
    return args.draft if args.draft in named_drafts() and not args.no_draft else None


def model_dirs(args) -> tuple[Path, Path | None, bool]:
    """``(target_dir, draft_dir or None, embedded)`` from :func:`add_model_arguments`' options (no ``--target``:
    the embedded demo pair). A named drafter (``--draft self``: the target drafts for itself; ``--draft ngram``:
    prompt lookup) gives no draft directory, with or without ``--target``."""
    named = args.draft in named_drafts()
    embedded = args.target is None
    if embedded and args.draft is not None and not named:
        raise ConfigError("--draft needs --target (the draft is bound to its target); without --target the "
                          "embedded demo pair runs, which brings its own draft")
    if embedded:
        target_dir, draft_dir = default_pair()
    else:
        target_dir, draft_dir = Path(args.target), Path(args.draft) if args.draft else None
    return target_dir, None if args.no_draft or named else draft_dir, embedded


def add_spec_arguments(ap) -> None:
    """The speculative-decoding options (shared with ``python -m diffspec_jax.serve``); :func:`spec_from_args`
    reads them."""
    ap.add_argument("--num-speculative-tokens", "-k", type=int, default=SpecConfig.num_speculative_tokens,
                    help="K: tokens drafted per verification (chain depth)")
    ap.add_argument("--policy", default=None,
                    help="full | recent | diffspec. Default diffspec: it equals full while the context fits "
                         "--token-budget, and beyond it keeps a draft trained on short windows accepting where full "
                         "collapses (0.80-0.89x at 16K on the demo pair, whose target reads no far context, so "
                         "recent was faster there; docs/benchmarks.md)")
    ap.add_argument("--chunk-size", type=int, default=DiffSpec.chunk_size,
                    help="diffspec: tokens per context chunk that retrieval scores and selects")
    ap.add_argument("--token-budget", type=int, default=DiffSpec.token_budget,
                    help="diffspec / recent: working-cache positions the draft reads (a multiple of --chunk-size)")
    ap.add_argument("--retrieval-interval", type=int, default=DiffSpec.retrieval_interval,
                    help="diffspec: cycles between retrievals of the working cache's chunks (default: 1 with "
                         "--draft self, 4 with a draft model)")
    ap.add_argument("--verification-mode", default="auto",
                    help="auto | linear (chain drafting) | tree (tree drafting and verification)")
    ap.add_argument("--max-tree-nodes", type=int, default=Tree.max_nodes,
                    help="tree mode: nodes verified per cycle besides the root")
    ap.add_argument("--tree-topk", type=int, default=Tree.topk,
                    help="tree mode: frontier width and children per node")
    ap.add_argument("--tree-branching", default=Tree.branching,
                    help="tree mode: hazard | full | chain | shallow | deep | uniform<N>")
    ap.add_argument("--tree-threshold", type=float, default=Tree.threshold,
                    help="tree mode: stop expanding once a level adds less draft probability mass than this")
    ap.add_argument("--ngram-min-n", type=int, default=NGram.min_n,
                    help="--draft ngram (or --ngram-first): the shortest suffix prompt lookup matches")
    ap.add_argument("--ngram-max-n", type=int, default=NGram.max_n,
                    help="--draft ngram (or --ngram-first): the longest suffix prompt lookup matches (tried first)")
    ap.add_argument("--ngram-first", action="store_true",
                    help="with an EAGLE-3 draft or --draft self: prompt lookup proposes where an n-gram matches, the "
                         "draft elsewhere (raise --ngram-min-n with it)")
    ap.add_argument("--adaptive", action="store_true",
                    help="adapt per sequence: retrieval interval, chain depth (chain mode), node budget (tree mode)")
    ap.add_argument("--kernels", default=None, choices=KERNEL_CHOICES,
                    help=f"hot-path kernels: auto (Pallas on GPUs, the pure-JAX references elsewhere) | reference | "
                         f"pallas (default: ${KERNELS_ENV}, else auto)")
    ap.add_argument("--deterministic", action="store_true",
                    help="bit-exact speculation: greedy output identical to the bit to target-only decoding with the "
                         "same flag, on GPUs too (chains at a fixed depth; costs in docs/benchmarks.md)")


def add_parallel_arguments(ap) -> None:
    """``--tp`` and ``--draft-tp`` (shared with ``python -m diffspec_jax.serve``); :func:`check_parallel_options`
    checks them, ``make_mesh(args.tp)`` and ``spec_from_args(args, args.draft_tp)`` read them."""
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (devices on the mesh's tp axis)")
    ap.add_argument("--draft-tp", type=int, default=None,
                    help="draft tensor-parallel size: 1 (replicated) or --tp (default: --tp)")


def check_parallel_options(args) -> None:
    """Refuse a ``--tp`` below 1 and a ``--draft-tp`` other than 1 or ``--tp`` (a :class:`ConfigError`)."""
    if args.tp < 1:
        raise ConfigError(f"--tp must be a positive integer (devices on the tensor-parallel axis), got {args.tp}")
    if args.draft_tp is not None and args.draft_tp not in (1, args.tp):
        raise ConfigError(f"--draft-tp must be 1 (a replicated draft) or equal to --tp (a draft sharded like the "
                          f"target; --tp is {args.tp}), got {args.draft_tp}")


def spec_from_args(args, draft_tp: int | None = None) -> SpecConfig:
    """The :class:`SpecConfig` of :func:`add_spec_arguments`' options, built from their flat names
    (:meth:`SpecConfig.from_flat`; ``--policy`` defaults to ``diffspec``, ``--kernels`` to ``$DIFFSPEC_KERNELS``)."""
    flat = dict(
        num_speculative_tokens=args.num_speculative_tokens, draft_context_policy=args.policy or DiffSpec.policy,
        diffspec_chunk_size=args.chunk_size, diffspec_token_budget=args.token_budget,
        diffspec_retrieval_interval=args.retrieval_interval, diffspec_verification_mode=args.verification_mode,
        diffspec_max_tree_nodes=args.max_tree_nodes, diffspec_tree_topk=args.tree_topk,
        diffspec_tree_branching=args.tree_branching, diffspec_tree_threshold=args.tree_threshold,
        diffspec_adaptive_profile=args.adaptive, draft_tensor_parallel_size=draft_tp, ngram_min_n=args.ngram_min_n,
        ngram_max_n=args.ngram_max_n, ngram_first=args.ngram_first, deterministic=args.deterministic)
    if args.kernels is not None:
        flat["kernels"] = args.kernels
    return SpecConfig.from_flat(flat)


def build_parser() -> ArgumentParser:
    """The CLI's parser: usage errors are one line on stderr and exit status 2."""
    ap = ArgumentParser(prog="python -m diffspec_jax.generate", description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (default, with none of the three prompt options: the embedded "
                                      "pair's built-in long prompt, about 10K tokens)")
    src.add_argument("--prompt-file", help="file holding the prompt text (- reads standard input; default: see "
                                           "--prompt)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids (default: see --prompt)")
    ap.add_argument("--max-prompt-bytes", type=int, default=MAX_PROMPT_BYTES,
                    help=f"refuse a --prompt-file (or standard input) larger than this (default {MAX_PROMPT_BYTES}: "
                         f"2**20 tokens at 16 bytes each)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    ap.add_argument("--temperature", type=float, default=None,
                    help="0 = greedy (default: the target's generation_config.json; greedy without one)")
    ap.add_argument("--top-k", type=int, default=None, help="0 = off (default: generation_config.json)")
    ap.add_argument("--top-p", type=float, default=None, help="1 = off (default: generation_config.json)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of sampling")
    ap.add_argument("--stop", action="append", default=None, metavar="STR",
                    help="stop at this text (repeatable; needs a tokenizer): the output ends before it (default: "
                         "none; the EOS ids still stop)")
    ap.add_argument("--keep-special-tokens", action="store_true",
                    help="print special tokens (EOS, chat markers) in the text (default: left out)")
    add_spec_arguments(ap)
    add_parallel_arguments(ap)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    compare = ap.add_mutually_exclusive_group()
    compare.add_argument("--compare", action="store_true",
                         help="also run target-only decoding (both paths warmed up first) and report the decode and "
                              "end-to-end speedups (default: on for the embedded pair, off otherwise)")
    compare.add_argument("--no-compare", action="store_true",
                         help="run the speculative path alone: no warm-up runs, no comparison (the embedded pair's "
                              "opt-out)")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (ids, text, finish_reason: stop | length, stats)")
    ap.add_argument("--example", choices=EXAMPLES,
                    help=f"run a built-in example on the embedded pair instead of a prompt (default: none). recall: "
                         f"a prompt of {RECALL_CONTEXT} tokens that ends by re-emitting a file from its start, beyond "
                         f"a working cache of {RECALL_BUDGET} positions (--token-budget changes it); compares the "
                         f"diffspec and recent policies' acceptance, DiffSpec's retrievals and losslessness (greedy; "
                         f"not with the prompt, model, --policy or sampling options)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar or status line")
    return ap


def _sampling(args, target_dir: Path) -> tuple[SamplingConfig, dict]:
    """--temperature / --top-k / --top-p, each defaulting to the target's generation_config.json (then to
    :class:`SamplingConfig`'s greedy defaults); returns the config and the defaults that were read."""
    defaults = stopping.generation_defaults(target_dir)
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    return SamplingConfig(**{k: v if v is not None else defaults.get(k, getattr(SamplingConfig, k))
                             for k, v in given.items()}), defaults


#: options that only shape speculative decoding: with --no-draft they would be ignored, so they are refused
SPECULATIVE_OPTIONS = ("draft", "draft_tp", "compare", "num_speculative_tokens", "policy", "chunk_size", "token_budget",
                       "retrieval_interval", "verification_mode", "max_tree_nodes", "tree_topk", "tree_branching",
                       "tree_threshold", "adaptive", "ngram_min_n", "ngram_max_n", "ngram_first")
#: options of tree verification: refused unless --verification-mode tree (chain drafting ignores them)
TREE_OPTIONS = ("max_tree_nodes", "tree_topk", "tree_branching", "tree_threshold")
#: options of prompt lookup: refused unless --draft ngram or --ngram-first
NGRAM_OPTIONS = ("ngram_min_n", "ngram_max_n")
#: options of a draft's context: refused with --draft ngram (prompt lookup reads the whole sequence)
CONTEXT_OPTIONS = ("policy", "chunk_size", "token_budget", "retrieval_interval")
#: options refused with --example: it sets the prompt, the pair, the policies and greedy sampling itself
EXAMPLE_OPTIONS = ("prompt", "prompt_file", "prompt_ids", "max_prompt_bytes", "chat", "target", "draft", "no_draft",
                   "policy", "temperature", "top_k", "top_p", "stop", "compare", "no_compare")


def given_options(argv: list[str] | None) -> dict[str, str]:
    """The options given on the command line ``argv`` (not left at their defaults), as ``{dest: option name}``."""
    probe = build_parser()
    names = {a.dest: max(a.option_strings, key=len) for a in probe._actions if a.option_strings}
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return {dest: names[dest] for dest in vars(probe.parse_args(argv)) if dest in names}


def check_option_combinations(args, given: dict[str, str]) -> None:
    """Refuse options that contradict each other or that the other options make ineffective (a
    :class:`ConfigError`: exit status 2), rather than ignoring them without a word."""
    example = [given[d] for d in EXAMPLE_OPTIONS if d in given]
    if args.example and example:
        raise ConfigError(f"--example {args.example} brings its own prompt, the embedded pair, both the diffspec and "
                          f"recent policies and greedy decoding, so it cannot be combined with {', '.join(example)}; "
                          f"drop {'them' if len(example) > 1 else 'it'} or --example")
    check_parallel_options(args)
    ignored = [given[d] for d in SPECULATIVE_OPTIONS if d in given]
    if args.no_draft and ignored:
        raise ConfigError(f"--no-draft decodes with the target alone, so {', '.join(ignored)} would have no effect; "
                          f"drop {'them' if len(ignored) > 1 else 'it'} or --no-draft")
    tree = [given[d] for d in TREE_OPTIONS if d in given]
    if tree and args.verification_mode != "tree":
        raise ConfigError(f"{', '.join(tree)} shape{'' if len(tree) > 1 else 's'} tree verification, but "
                          f"--verification-mode is {args.verification_mode} (chain drafting); add --verification-mode "
                          f"tree or drop {'them' if len(tree) > 1 else 'it'}")
    lookup = args.draft == "ngram" and not args.no_draft
    ngram = [given[d] for d in NGRAM_OPTIONS if d in given]
    if ngram and not (lookup or args.ngram_first):
        raise ConfigError(f"{', '.join(ngram)} shape{'' if len(ngram) > 1 else 's'} prompt lookup, which runs with "
                          f"--draft ngram or --ngram-first; add one or drop {'them' if len(ngram) > 1 else 'it'}")
    context = [given[d] for d in CONTEXT_OPTIONS if d in given]
    if context and lookup:
        raise ConfigError(f"--draft ngram reads the whole sequence, so {', '.join(context)} would have no effect; "
                          f"drop {'them' if len(context) > 1 else 'it'}")
    if args.chat and args.prompt_ids is not None:
        raise ConfigError("--chat wraps prompt text in the chat template, but --prompt-ids gives token ids; give the "
                          "text with --prompt or --prompt-file, or drop --chat")
    check_int(args.max_prompt_bytes, "--max-prompt-bytes", min=1)


def compare_wanted(args, embedded: bool) -> bool:
    """Whether to run target-only decoding too: ``--compare``, or the embedded pair's default (the demo reports its
    speedups) unless ``--no-compare``, or ``--no-draft`` (target-only decoding has nothing to compare with)."""
    return args.compare or (embedded and not (args.no_draft or args.no_compare))


def main(argv: list[str] | None = None) -> int:
    quiet_library_notices()
    args = build_parser().parse_args(argv)
    try:
        given = given_options(argv)
        check_option_combinations(args, given)
        if args.example:
            return run_example(args, given)
        text = _prompt_text(args)  # before any model is loaded: a bad prompt file fails at once
        named = named_draft(args)
        target_dir, draft_dir, embedded = model_dirs(args)
        args.compare = compare_wanted(args, embedded)
        spec = spec_from_args(args, args.draft_tp)
        policy = spec.context.policy
        target = load_target(target_dir, dtype=resolve_dtype_arg(args.dtype), verify=not args.no_verify)
        sampling, gen_defaults = _sampling(args, target_dir)
        draft = named or (load_draft(draft_dir, target, verify=not args.no_verify) if draft_dir is not None else None)
        random_pair = (target_dir / "RANDOM_WEIGHTS.json").exists()
        tok = _tokenizer(target_dir)
        if args.stop and tok is None:
            raise InputError("--stop matches text, but the target directory has no tokenizer (stop at token ids "
                             "with the EOS ids of its generation_config.json instead)")
        prompt = _prompt_ids(args, text, tok)
        # the CLI's own checks, before anything is printed (whatever generate() checks itself)
        check_token_ids(prompt, target.config.vocab_size, "the prompt")
        check_int(args.max_new_tokens, "--max-new-tokens", min=1, error=InputError)
        check_generate_args(target.config.vocab_size, seed=args.seed)
        stops = check_stop_strings(args.stop, "--stop")
        console = _Console(stream=not args.json, progress=not (args.json or args.no_progress))
        if random_pair and not args.json:
            print(f"[RANDOM weights in {target_dir}: the tokens are meaningless]", file=sys.stderr)
        if embedded and not args.json:
            shown = "ngram (prompt lookup)" if named == "ngram" else policy
            print(demo_banner(target_dir.parent, len(prompt), None if draft is None else shown,
                              self_draft=named == engine.SELF, compare=args.compare), file=sys.stderr)
        if gen_defaults and not args.json and not sampling.greedy:
            print(f"[sampling as {target_dir / stopping.GENERATION_CONFIG} says: temperature {sampling.temperature:g}"
                  f", top_k {sampling.top_k}, top_p {sampling.top_p:g} (--temperature 0 for greedy)]",
                  file=sys.stderr)
        mesh = make_mesh(args.tp) if args.tp > 1 else None
        kwargs = dict(max_new_tokens=args.max_new_tokens, spec=spec, sampling=sampling, seed=args.seed,
                      stop_token_ids=() if args.ignore_eos else None, mesh=mesh, stop=stops or None, tokenizer=tok,
                      skip_special_tokens=not args.keep_special_tokens, kv_cache_dtype=args.kv_cache_dtype)
        warmup = []
        console.status(f"prefill of {len(prompt)} prompt tokens" + (
            ", compiling and warming up both paths (--compare)" if args.compare else
            " (the first run in a process compiles first)"))
        t_warmup = time.perf_counter()
        if args.compare:  # compile both paths first, so the timed runs below measure decoding only
            warmup = [engine.generate(target, draft, [prompt], **kwargs),
                      engine.generate(target, None, [prompt], **kwargs)]
        t_warmup = time.perf_counter() - t_warmup
        console.start()
        result = engine.generate(target, draft, [prompt], on_tokens=console.ids if tok is None else None,
                                 on_text=console.text if tok is not None else None, progress=console.bar, **kwargs)
        console.close()
        report: dict = {"target": str(target_dir),
                        "draft": named or (str(draft_dir) if draft_dir else None),
                        "random_weights": random_pair, "prompt_ids": prompt, "ids": result.tokens[0],
                        "text": result.texts[0] if result.texts is not None else None,
                        "finish_reason": result.finish_reasons[0], "stop": list(stops),
                        "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k,
                                     "top_p": sampling.top_p},
                        "stats": result.stats.to_dict()}
        if args.compare:
            base = engine.generate(target, None, [prompt], **kwargs)
            report["baseline"] = base.stats.to_dict()
            report["identical_to_target_only"] = base.tokens == result.tokens
            report["greedy"] = sampling.greedy
            if sampling.greedy and base.tokens != result.tokens:
                report["divergence"] = divergence(target, prompt, base.tokens[0], result.tokens[0])
            report.update(speedups(report["stats"], report["baseline"]))
            report["warmup_s"] = t_warmup
            report["speedup_note"] = speedup_note(
                report, context=len(prompt) + len(result.tokens[0]),
                budget=getattr(spec.context, "token_budget", DiffSpec.token_budget))
        # compilation of every run (the warm-up runs of --compare compile what the timed runs then reuse)
        report["compile_s"] = sum(r.stats.compile_s for r in warmup + [result] + ([base] if args.compare else []))
    except (DiffspecError, OSError) as exc:  # one line on stderr; 2 = usage error, 1 = other (a damaged file)
        return report_error(exc)
    if args.json:
        print(json.dumps(report))
    else:
        _print_summary(report)
    div = report.get("divergence")
    return 1 if div is not None and not div["near_tie"] else 0  # a real greedy mismatch is a bug: fail


def recall_example(args, given: dict[str, str], *, say=None, progress=None) -> dict:
    """``--example recall`` (see the module docstring): greedy target-only decoding, then speculative decoding with
    each of :data:`RECALL_POLICIES`, of one :func:`diffspec_jax.demo.recall_prompt` on the embedded pair. Returns
    the report that ``--json`` prints; ``say(line)`` gets what will run once the settings are checked (before the
    models load), ``progress(line)`` a line before each run."""
    target_dir, draft_dir = default_pair()
    if "token_budget" not in given:
        args.token_budget = RECALL_BUDGET
    specs = {}
    for policy in RECALL_POLICIES:
        args.policy = policy
        specs[policy] = spec_from_args(args, args.draft_tp)
    check_int(args.max_new_tokens, "--max-new-tokens", min=1, error=InputError)
    tok = _tokenizer(target_dir)
    prompt = demo.recall_prompt(tok, RECALL_CONTEXT, RECALL_PASSAGE, args.max_new_tokens)
    if args.token_budget >= prompt.distance:
        raise ConfigError(f"--token-budget {args.token_budget} would hold the whole recall passage "
                          f"({prompt.distance} tokens back), so recent would see it too; give less than "
                          f"{prompt.distance} (default {RECALL_BUDGET})")
    if say is not None:
        say(f"[embedded demo pair: {target_dir.parent}; example recall: the first {len(prompt.ids) - RECALL_PASSAGE} "
            f"tokens of the built-in prompt's file ({prompt.doc}), then its first {RECALL_PASSAGE} tokens again, so "
            f"a continuation that copies re-emits the file from {prompt.distance} tokens back; working-cache budget "
            f"{args.token_budget} positions: the recent window cannot reach that far, diffspec can retrieve it; "
            f"target-only, diffspec and recent decode it greedily, {args.max_new_tokens} new tokens each]")
    target = load_target(target_dir, dtype=resolve_dtype_arg(args.dtype), verify=not args.no_verify)
    draft = load_draft(draft_dir, target, verify=not args.no_verify)
    kwargs = dict(max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(), seed=args.seed,
                  stop_token_ids=() if args.ignore_eos else None, mesh=make_mesh(args.tp) if args.tp > 1 else None,
                  tokenizer=tok, skip_special_tokens=not args.keep_special_tokens, kv_cache_dtype=args.kv_cache_dtype)
    runs = len(RECALL_POLICIES) + 1
    progress = progress or (lambda line: None)
    progress(f"1/{runs}: target-only decoding of the {len(prompt.ids)}-token prompt (compiles first)")
    base = engine.generate(target, None, [prompt.ids], **kwargs)
    spec = specs[RECALL_POLICIES[0]]
    report = {"example": "recall", "target": str(target_dir), "draft": str(draft_dir),
              "prompt_tokens": len(prompt.ids), "passage_file": prompt.doc, "passage_tokens": RECALL_PASSAGE,
              "passage_distance": prompt.distance, "token_budget": args.token_budget,
              "chunk_size": spec.context.chunk_size, "num_speculative_tokens": spec.num_speculative_tokens,
              "max_new_tokens": args.max_new_tokens, "greedy": True,
              "passage_text": tok.decode(prompt.ids[-RECALL_PASSAGE:]), "ids": base.tokens[0],
              "text": base.texts[0], "finish_reason": base.finish_reasons[0],
              "copied_fraction": corpus.copied_fraction(base.tokens, [prompt]), "baseline": base.stats.to_dict(),
              "policies": {}}
    compile_s = base.stats.compile_s
    for i, policy in enumerate(RECALL_POLICIES, 2):
        progress(f"{i}/{runs}: speculative decoding, policy {policy}")
        res = engine.generate(target, draft, [prompt.ids], **kwargs, spec=specs[policy])
        s = res.stats
        run = {"mean_acceptance_length": s.mean_acceptance_length,
               "retrieval": (s.retrieval or {}).get("aggregate"),
               "history_slots": specs[policy].context.history_slots(s.num_speculative_tokens),
               "identical_to_target_only": res.tokens == base.tokens, "stats": s.to_dict()}
        if res.tokens != base.tokens:
            run["divergence"] = divergence(target, prompt.ids, base.tokens[0], res.tokens[0])
        report["policies"][policy] = run
        compile_s += s.compile_s
    report["compile_s"] = compile_s
    return report


def recall_summary_lines(report: dict) -> list[str]:
    """What ``--example recall`` prints on stderr after the text (``report``: :func:`recall_example`'s)."""
    def fmt(x):  # no verification ran (a single new token)
        return "n/a" if x is None else f"{x:.2f}"

    lines = [f"{_run_line('target-only', report['baseline'], report['finish_reason'])}; compilation "
             f"{report['compile_s']:.2f}s in all {len(report['policies']) + 1} runs, not in their times"]
    for policy, run in report["policies"].items():
        s, a = run["stats"], run["retrieval"]
        seen = (f"retrievals {a['retrievals']} (after prefill {a['retrievals_after_prefill']}), skipped not due "
                f"{a['skipped_not_due']}, skipped fits {a['skipped_fits']}, {a['retrieval_ms']:.2f} ms each"
                if a else f"no retrieval: the draft reads the last {run['history_slots']} positions only")
        same = ("output identical to target-only (greedy: lossless)" if run["identical_to_target_only"]
                else "output differs from target-only")
        lines.append(f"{policy}: mean acceptance length {fmt(run['mean_acceptance_length'])} "
                     f"(K={s['num_speculative_tokens']}, {s['sequence_cycles']} cycles, accepted per position "
                     f"{s['acceptance_per_position']}); "
                     f"{seen}; {same}")
        div = run.get("divergence")
        if div is not None:
            verdict = ("a numerical near-tie" if div["near_tie"]
                       else f"NOT a near-tie (> {NEAR_TIE_LOGIT_GAP}): a bug, please report it")
            lines.append(f"  first divergence at new token {div['new_token']}: logit gap {div['logit_gap']:.4f} "
                         f"({div['dtype']}): {verdict}")
    first, second = (report["policies"][p]["mean_acceptance_length"] for p in RECALL_POLICIES)
    if first is not None and second is not None:
        lines.append(f"{RECALL_POLICIES[0]} - {RECALL_POLICIES[1]}: {first - second:+.2f} tokens per verification on "
                     f"the same prompt")
    share = report["copied_fraction"]
    lines.append(f"the target's own continuation follows the file's text after the passage verbatim for {share:.0%} "
                 f"of its new tokens" + (": a target that barely copies leaves retrieval little to add to the "
                                         "draft's acceptance" if share < LOW_COPYING else ""))
    return lines


def run_example(args, given: dict[str, str]) -> int:
    """``--example``: run it, print its text on stdout and its summary on stderr (or one JSON object); exit
    status 1 when a policy's greedy output differs from target-only beyond a near-tie (a bug), else 0."""
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    chatty = not args.json
    report = recall_example(args, given, say=say if chatty else None,
                            progress=(lambda line: say(f"[{line} ...]")) if chatty and not args.no_progress else None)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"[the prompt ends with {report['passage_text']!r}; the target-only continuation follows]",
              file=sys.stderr)
        print(report["text"])
        print("\n".join(recall_summary_lines(report)), file=sys.stderr)
    return 1 if any(r.get("divergence") and not r["divergence"]["near_tie"]
                    for r in report["policies"].values()) else 0


#: a greedy divergence whose two tokens' target logits differ by at most this is a numerical near-tie (the two
#: paths reduce in different orders); the benchmarks' ``--tie-tolerance`` default
NEAR_TIE_LOGIT_GAP = 0.05


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (``None`` when they agree on their common length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def divergence(target, prompt: list[int], base: list[int], ours: list[int]) -> dict | None:
    """Where greedy speculative output ``ours`` first differs from target-only output ``base`` (``None`` when no
    token differs), and the gap there between the two tokens' logits of the target itself (one prefill of the prompt
    and the agreed prefix, in the target's dtype)."""
    j = first_divergence(base, ours)
    if j is None:
        return None
    ids = list(prompt) + list(base[:j])
    logits, _ = tgt.prefill(target, tgt.create_cache(target, 1, len(ids)), [ids])
    row = np.asarray(logits[0], np.float64)
    gap = float(abs(row[base[j]] - row[ours[j]]))
    return {"new_token": j, "target_only": int(base[j]), "speculative": int(ours[j]), "logit_gap": gap,
            "near_tie": gap <= NEAR_TIE_LOGIT_GAP, "dtype": str(np.dtype(target.dtype))}


def resolve_dtype_arg(dtype: str) -> str:
    """``--dtype``: ``auto`` is float32 on the CPU and bfloat16 on accelerators; anything else is passed on."""
    if dtype != "auto":
        return dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def same_terminal(out=None, err=None) -> bool:
    """Whether ``out`` and ``err`` (default: stdout and stderr) are one terminal, where a progress bar on stderr
    would interleave with text streamed to stdout."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        a, b = out.fileno(), err.fileno()
        return os.isatty(a) and os.isatty(b) and os.path.samestat(os.fstat(a), os.fstat(b))
    except (AttributeError, OSError, ValueError):  # replaced streams (captured output, notebooks)
        return False


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, OSError, ValueError):  # replaced or closed streams
        return False


class _Console:
    """What the CLI prints while generating: streamed text (or ids) on stdout, progress on stderr.

    Progress is a progress bar on stderr, except when stdout and stderr are the same terminal and text streams:
    then one status line on stderr before the text (``status``), finished when the first text arrives (time to
    first token, compilation included), and the statistics after it (:func:`_print_summary`).
    """

    def __init__(self, *, stream: bool, progress: bool):
        self.stream = stream
        self.line = stream and progress and same_terminal()
        self.bar = progress and not self.line
        self.t0, self.open = time.perf_counter(), False

    def status(self, text: str) -> None:
        if self.line:
            sys.stderr.write(f"[{text} ...]")
            sys.stderr.flush()
            self.open = True

    def start(self) -> None:
        """The timed run starts (the status line's time to first token counts from here)."""
        self.t0 = time.perf_counter()

    def _write(self, text: str) -> None:
        if self.open:  # finish the status line before the first text
            sys.stderr.write(f"\r\x1b[K[first token after {time.perf_counter() - self.t0:.2f} s]\n")
            sys.stderr.flush()
            self.open = False
        sys.stdout.write(text)
        sys.stdout.flush()

    def text(self, seq: int, piece: str) -> None:
        if self.stream:
            self._write(piece)

    def ids(self, seq: int, new: list[int]) -> None:
        if self.stream:
            self._write(" ".join(map(str, new)) + " ")

    def close(self) -> None:
        if self.open:
            sys.stderr.write("\n")
            self.open = False
        if self.bar and not _isatty(sys.stderr):  # on a terminal the finished bar erases itself; elsewhere its
            sys.stderr.write("\n")                 # last state stays, ended by a bare \r: end its line
        if self.stream:
            sys.stdout.write("\n")
            sys.stdout.flush()


def demo_banner(pair: Path, prompt_tokens: int, policy: str | None, *, self_draft: bool = False,
                compare: bool = False) -> str:
    """The line the embedded pair's run starts with: what runs (``policy`` ``None``: the target alone, as
    ``--no-draft``) and whether it is compared with target-only decoding."""
    if policy is None:
        mode = "target-only decoding (--no-draft): no draft, no comparison"
    else:
        mode = (f"speculative decoding, policy {policy}{', the target drafting for itself' if self_draft else ''}"
                + ("; then target-only decoding for the comparison (--no-compare skips it)" if compare else ""))
    return (f"[embedded demo pair: {pair} (a small Llama and EAGLE-3 draft trained on the Python standard library; "
            f"see MODEL_CARD.md there); prompt: {prompt_tokens} tokens; {mode}]")


def _end_to_end_rate(stats: dict) -> float | None:
    """New tokens per second of prefill + decode (what a user waits for; compilation excluded)."""
    seconds = stats["prefill_s"] + stats["decode_s"]
    return stats["new_tokens"] / seconds if seconds > 0 and stats["new_tokens"] else None


def speedups(ours: dict, base: dict) -> dict:
    """``decode_speedup`` (decode tokens per second, speculative over target-only: the decoding loop alone) and
    ``end_to_end_speedup`` (new tokens per second of prefill + decode: what the user waits for) of two runs'
    :meth:`GenerateStats.to_dict`; a rate that cannot be measured (no tokens decoded) leaves its key out."""
    out = {}
    if ours["decode_tokens_per_s"] and base["decode_tokens_per_s"]:
        out["decode_speedup"] = ours["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    e2e = _end_to_end_rate(ours), _end_to_end_rate(base)
    if e2e[0] and e2e[1]:
        out["end_to_end_speedup"] = e2e[0] / e2e[1]
    return out


#: a mean acceptance length (tokens per verification, the bonus token included) below this is "low": most drafted
#: tokens are rejected, and drafting them costs more than the few accepted ones save
LOW_ACCEPTANCE = 1.5


def speedup_note(report: dict, *, context: int, budget: int) -> str | None:
    """One line on why a speedup of ``report`` (:func:`speedups`' keys, ``stats`` with the acceptance) is below 1,
    or ``None`` when neither is: low acceptance, a context (prompt + new tokens) under the working-cache budget
    (where a target step is cheap and drafting is not), or a prefill that the speculative path makes longer (it
    also runs the draft) and too few new tokens to win back."""
    d, e = report.get("decode_speedup"), report.get("end_to_end_speedup")
    if (d is None or d >= 1) and (e is None or e >= 1):
        return None
    s, why = report["stats"], []
    accept = s.get("mean_acceptance_length")
    if accept is not None and accept < LOW_ACCEPTANCE:
        why.append(f"low acceptance ({accept:.2f} tokens per verification, under {LOW_ACCEPTANCE}): the draft "
                   f"predicts this text poorly, so most drafted tokens are wasted work")
    if context < budget:
        why.append(f"the context ({context} tokens) is under the working-cache budget ({budget} tokens): at this "
                   f"length a target step reads little K/V and costs about as much as drafting, so speculation "
                   f"saves little; it pays on long contexts (the embedded pair's built-in prompt is about 10K tokens)")
    if d is not None and d >= 1 > (e or 0):
        why.append("decoding was faster, but the speculative prefill also runs the draft (and DiffSpec's first "
                   "retrieval), and too few new tokens won that back (raise --max-new-tokens)")
    if not why:
        why.append("drafting and verification cost more than the accepted tokens saved at this context and "
                   "acceptance on this machine")
    return "why below 1x: " + "; ".join(why)


def _run_line(label: str, s: dict, finish_reason: str | None = None) -> str:
    rate = f" ({s['decode_tokens_per_s']:.1f} tok/s)" if s["decode_tokens_per_s"] else ""
    finish = f" (finish reason {finish_reason})" if finish_reason else ""
    ttft = f"time to first token {s['ttft_s']:.3f}s, " if s.get("ttft_s") is not None else ""
    return (f"{label}: new tokens {s['new_tokens']}{finish}, {ttft}prefill {s['prefill_s']:.3f}s, decode "
            f"{s['decode_s']:.3f}s{rate}")


def summary_lines(report: dict) -> list[str]:
    """The statistics the CLI prints on stderr after the text (``report`` as ``--json`` prints it): the run's
    times, its drafting and retrieval counters and, with ``--compare``, target-only's times, both speedups
    labelled, why one is below 1, and whether the outputs agree (and why they need not, under sampling)."""
    s = report["stats"]
    compared = "baseline" in report
    label = "speculative" if s["num_speculative_tokens"] else "target-only"
    compile_s = report.get("compile_s", s["compile_s"])
    where = (f"in the two warm-up runs (one per path, {report['warmup_s']:.1f} s in all; --no-compare skips them)"
             if compared and "warmup_s" in report else "")
    lines = [f"{_run_line(label, s, report['finish_reason'])}; compilation {compile_s:.2f}s "
             f"{where + ', ' if where else ''}not in those times"]
    if s["num_speculative_tokens"]:
        lines.append(f"policy {s['draft_context_policy']}, K={s['num_speculative_tokens']}, cycles "
                     f"{s['sequence_cycles']}, mean acceptance length {s['mean_acceptance_length']:.2f}, "
                     f"accepted per position {s['acceptance_per_position']}")
        if s.get("verification_mode") == "tree":
            lines.append(f"tree: mean {s['mean_tree_size']:.1f} nodes, accepted depth histogram "
                         f"{s['accepted_depth_histogram']}")
    if s.get("retrieval"):
        a = s["retrieval"]["aggregate"]
        lines.append(f"retrievals {a['retrievals']} (after prefill {a['retrievals_after_prefill']}), skipped not "
                     f"due {a['skipped_not_due']}, skipped fits {a['skipped_fits']}, {a['retrieval_ms']:.2f} ms each")
    if not compared:
        return lines
    lines.append(_run_line("target-only", report["baseline"]))
    d, e = (f"{report[k]:.2f}x" if report.get(k) is not None else "n/a"
            for k in ("decode_speedup", "end_to_end_speedup"))
    lines.append(f"speedup over target-only: decode {d} (decode time alone), end to end {e} (prefill + decode)")
    if report.get("speedup_note"):
        lines.append(report["speedup_note"])
    if report["identical_to_target_only"]:
        lines.append("output identical to target-only" + (" (greedy decoding: lossless)" if report.get("greedy")
                                                           else ""))
    elif not report.get("greedy", True):
        lines.append("output differs from target-only, as expected when sampling: each run draws its own random "
                     "tokens; speculative sampling keeps the target's distribution, not its draws (--temperature 0 "
                     "compares token for token)")
    else:
        lines.append("output differs from target-only")
    div = report.get("divergence")
    if div is not None:
        verdict = ("a numerical near-tie, not a drafting error (see the README on greedy losslessness)"
                   if div["near_tie"] else f"NOT a near-tie (> {NEAR_TIE_LOGIT_GAP}): a bug, please report it")
        lines.append(f"first divergence at new token {div['new_token']}: the target's logits for its token "
                     f"{div['target_only']} and ours {div['speculative']} differ by {div['logit_gap']:.4f} "
                     f"({div['dtype']}): {verdict}")
    return lines


def _print_summary(report: dict) -> None:
    print("\n".join(summary_lines(report)), file=sys.stderr)


class _CallableModule(types.ModuleType):
    """Importing this module replaces the package attribute ``diffspec_jax.generate`` (the function) with the
    module; making the module callable keeps ``diffspec_jax.generate(...)`` working either way."""

    def __call__(self, *args, **kwargs):
        return engine.generate(*args, **kwargs)


__signature__ = inspect.signature(engine.generate)
sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
