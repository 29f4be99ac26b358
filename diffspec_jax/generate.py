"""``python -m diffspec_jax.generate``: speculative generation from the command line.

Examples::

    python -m diffspec_jax.generate                                  # the embedded default pair
    python -m diffspec_jax.generate --target T --draft D --prompt "def main():" --max-new-tokens 128
    python -m diffspec_jax.generate --target T --draft D --prompt-file long.py --policy diffspec --json
    python -m diffspec_jax.generate --target T --draft self --prompt-file long.py   # the target drafts for itself

The tokenizer (and, with ``--chat``, its chat template) comes from the target directory through
``transformers.AutoTokenizer`` when the directory has one; otherwise prompts are given as ids
(``--prompt-ids``) and output is printed as ids. Text streams to stdout (decoded incrementally, special tokens
left out unless ``--keep-special-tokens``, cut before the first ``--stop`` string); progress and the statistics go
to stderr: a progress bar, or, when stdout and stderr are the same terminal, one status line before the text and
the statistics after it. ``--json`` prints one JSON object instead. Sampling settings not given default to the
target's ``generation_config.json`` (greedy without one), and its EOS ids end generation. ``--compare`` also runs
target-only decoding on the same prompt and reports the speedup (and, when greedy, checks that the outputs are
identical).

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

from diffspec_jax import demo, engine, stopping
from diffspec_jax import target as tgt
from diffspec_jax.draft import load_draft
from diffspec_jax.mesh import make_mesh
from diffspec_jax.target import check_token_ids, load_target
from diffspec_jax.config import KERNEL_CHOICES, KERNELS_ENV, DiffSpec, SamplingConfig, SpecConfig, Tree
from diffspec_jax.errors import CheckpointError, ConfigError, DiffspecError, InputError
from diffspec_jax.validation import (ArgumentParser, check_generate_args, check_int, check_stop_strings,
                                     decode_text, read_at_most, read_text, report_error)


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
    """``--target``, ``--draft``, ``--no-draft``, ``--no-verify`` and ``--dtype`` (shared by the command-line tools
    that decode: this one and ``python -m diffspec_jax.serve``); :func:`model_dirs` reads them."""
    ap.add_argument("--target", help="Hugging Face or Orbax target directory (default: the embedded pair)")
    ap.add_argument("--draft", help="EAGLE-3 draft directory (default: the embedded pair's draft, if no --target), "
                                    "or 'self' (this command only): the target drafts for itself over its "
                                    "working set (docs/self_drafting.md; a directory named self is ./self)")
    ap.add_argument("--no-draft", action="store_true", help="target-only autoregressive decoding")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip the integrity checks at load: the diffspec_manifest.json digests and the NaN / inf / "
                         "magnitude check of the weights (docs/checkpoints.md)")
    ap.add_argument("--dtype", default="auto",
                    help="auto | bfloat16 | float32. auto: float32 on the CPU, bfloat16 on accelerators (XLA:CPU "
                         "widens bfloat16 products to float32 with a conversion pass over the KV cache per step, "
                         "which made bfloat16 decoding of the demo pair 3x slower than float32 on a 2-core CPU)")


def model_dirs(args, *, self_draft_ok: bool = False) -> tuple[Path, Path | None, bool]:
    """``(target_dir, draft_dir or None, embedded)`` from :func:`add_model_arguments`' options (no ``--target``:
    the embedded demo pair). ``--draft self`` (the target drafts for itself: no draft directory, with or without
    ``--target``) is refused unless ``self_draft_ok``."""
    self_draft = args.draft == engine.SELF
    if self_draft and not self_draft_ok:
        raise ConfigError("--draft self (self-drafting) is not supported by this command; python -m "
                          "diffspec_jax.generate runs it")
    embedded = args.target is None
    if embedded and args.draft is not None and not self_draft:
        raise ConfigError("--draft needs --target (the draft is bound to its target); without --target the "
                          "embedded demo pair runs, which brings its own draft")
    if embedded:
        target_dir, draft_dir = default_pair()
    else:
        target_dir, draft_dir = Path(args.target), Path(args.draft) if args.draft else None
    return target_dir, None if args.no_draft or self_draft else draft_dir, embedded


def add_spec_arguments(ap) -> None:
    """The speculative-decoding options (shared with ``python -m diffspec_jax.serve``); :func:`spec_from_args`
    reads them."""
    ap.add_argument("--num-speculative-tokens", "-k", type=int, default=SpecConfig.num_speculative_tokens)
    ap.add_argument("--policy", default=None,
                    help="full | recent | diffspec. Default diffspec: it equals full while the context fits "
                         "--token-budget, and beyond it keeps a draft trained on short windows accepting where full "
                         "collapses (0.80-0.89x at 16K on the demo pair, whose target reads no far context, so "
                         "recent was faster there; docs/benchmarks.md)")
    ap.add_argument("--chunk-size", type=int, default=DiffSpec.chunk_size)
    ap.add_argument("--token-budget", type=int, default=DiffSpec.token_budget)
    ap.add_argument("--retrieval-interval", type=int, default=DiffSpec.retrieval_interval)
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
    ap.add_argument("--adaptive", action="store_true",
                    help="adapt per sequence: retrieval interval, chain depth (chain mode), node budget (tree mode)")
    ap.add_argument("--kernels", default=None, choices=KERNEL_CHOICES,
                    help=f"hot-path kernels: auto (Pallas on GPUs, the pure-JAX references elsewhere) | reference | "
                         f"pallas (default: ${KERNELS_ENV}, else auto)")


def spec_from_args(args, draft_tp: int | None = None) -> SpecConfig:
    """The :class:`SpecConfig` of :func:`add_spec_arguments`' options, built from their flat names
    (:meth:`SpecConfig.from_flat`; ``--policy`` defaults to ``diffspec``, ``--kernels`` to ``$DIFFSPEC_KERNELS``)."""
    flat = dict(
        num_speculative_tokens=args.num_speculative_tokens, draft_context_policy=args.policy or "diffspec",
        diffspec_chunk_size=args.chunk_size, diffspec_token_budget=args.token_budget,
        diffspec_retrieval_interval=args.retrieval_interval, diffspec_verification_mode=args.verification_mode,
        diffspec_max_tree_nodes=args.max_tree_nodes, diffspec_tree_topk=args.tree_topk,
        diffspec_tree_branching=args.tree_branching, diffspec_tree_threshold=args.tree_threshold,
        diffspec_adaptive_profile=args.adaptive, draft_tensor_parallel_size=draft_tp)
    if args.kernels is not None:
        flat["kernels"] = args.kernels
    return SpecConfig.from_flat(flat)


def build_parser() -> ArgumentParser:
    """The CLI's parser: usage errors are one line on stderr and exit status 2."""
    ap = ArgumentParser(prog="python -m diffspec_jax.generate", description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text (- reads standard input)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    ap.add_argument("--max-prompt-bytes", type=int, default=MAX_PROMPT_BYTES,
                    help=f"refuse a --prompt-file (or standard input) larger than this (default {MAX_PROMPT_BYTES}: "
                         f"2**20 tokens at 16 bytes each)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=None,
                    help="0 = greedy (default: the target's generation_config.json; greedy without one)")
    ap.add_argument("--top-k", type=int, default=None, help="0 = off (default: generation_config.json)")
    ap.add_argument("--top-p", type=float, default=None, help="1 = off (default: generation_config.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=None, metavar="STR",
                    help="stop at this text (repeatable; needs a tokenizer): the output ends before it")
    ap.add_argument("--keep-special-tokens", action="store_true",
                    help="print special tokens (EOS, chat markers) in the text (default: left out)")
    add_spec_arguments(ap)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (devices on the mesh's tp axis)")
    ap.add_argument("--draft-tp", type=int, default=None, help="draft tensor-parallel size: 1 (replicated) or --tp")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    ap.add_argument("--compare", action="store_true", help="also run target-only decoding and report the speedup")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (ids, text, finish_reason: stop | length, stats)")
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
                       "tree_threshold", "adaptive")
#: options of tree verification: refused unless --verification-mode tree (chain drafting ignores them)
TREE_OPTIONS = ("max_tree_nodes", "tree_topk", "tree_branching", "tree_threshold")


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
    if args.tp < 1:
        raise ConfigError(f"--tp must be a positive integer (devices on the tensor-parallel axis), got {args.tp}")
    if args.draft_tp is not None and args.draft_tp not in (1, args.tp):
        raise ConfigError(f"--draft-tp must be 1 (a replicated draft) or equal to --tp (a draft sharded like the "
                          f"target; --tp is {args.tp}), got {args.draft_tp}")
    ignored = [given[d] for d in SPECULATIVE_OPTIONS if d in given]
    if args.no_draft and ignored:
        raise ConfigError(f"--no-draft decodes with the target alone, so {', '.join(ignored)} would have no effect; "
                          f"drop {'them' if len(ignored) > 1 else 'it'} or --no-draft")
    tree = [given[d] for d in TREE_OPTIONS if d in given]
    if tree and args.verification_mode != "tree":
        raise ConfigError(f"{', '.join(tree)} shape{'' if len(tree) > 1 else 's'} tree verification, but "
                          f"--verification-mode is {args.verification_mode} (chain drafting); add --verification-mode "
                          f"tree or drop {'them' if len(tree) > 1 else 'it'}")
    if args.chat and args.prompt_ids is not None:
        raise ConfigError("--chat wraps prompt text in the chat template, but --prompt-ids gives token ids; give the "
                          "text with --prompt or --prompt-file, or drop --chat")
    check_int(args.max_prompt_bytes, "--max-prompt-bytes", min=1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_option_combinations(args, given_options(argv))
        text = _prompt_text(args)  # before any model is loaded: a bad prompt file fails at once
        self_draft = args.draft == engine.SELF and not args.no_draft
        target_dir, draft_dir, embedded = model_dirs(args, self_draft_ok=True)
        if embedded:
            args.compare = args.compare or not args.no_draft  # the demo reports its speedup, measured here
        spec = spec_from_args(args, args.draft_tp)
        policy = spec.context.policy
        target = load_target(target_dir, dtype=resolve_dtype_arg(args.dtype), verify=not args.no_verify)
        sampling, gen_defaults = _sampling(args, target_dir)
        draft = (engine.SELF if self_draft else load_draft(draft_dir, target, verify=not args.no_verify)
                 if draft_dir is not None else None)
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
            print(f"[embedded demo pair: {target_dir.parent} (a small Llama and EAGLE-3 draft trained on the Python "
                  f"standard library; see MODEL_CARD.md there); prompt: {len(prompt)} tokens, policy {policy}"
                  f"{', the target drafting for itself' if self_draft else ''}]",
                  file=sys.stderr)
        if gen_defaults and not args.json and not sampling.greedy:
            print(f"[sampling as {target_dir / stopping.GENERATION_CONFIG} says: temperature {sampling.temperature:g}"
                  f", top_k {sampling.top_k}, top_p {sampling.top_p:g} (--temperature 0 for greedy)]",
                  file=sys.stderr)
        mesh = make_mesh(args.tp) if args.tp > 1 else None
        kwargs = dict(max_new_tokens=args.max_new_tokens, spec=spec, sampling=sampling, seed=args.seed,
                      stop_token_ids=() if args.ignore_eos else None, mesh=mesh, stop=stops or None, tokenizer=tok,
                      skip_special_tokens=not args.keep_special_tokens)
        warmup = []
        console.status(f"prefill of {len(prompt)} prompt tokens" + (
            ", compiling and warming up both paths (--compare)" if args.compare else
            " (the first run in a process compiles first)"))
        if args.compare:  # compile both paths first, so the timed runs below measure decoding only
            warmup = [engine.generate(target, draft, [prompt], **kwargs),
                      engine.generate(target, None, [prompt], **kwargs)]
        console.start()
        result = engine.generate(target, draft, [prompt], on_tokens=console.ids if tok is None else None,
                                 on_text=console.text if tok is not None else None, progress=console.bar, **kwargs)
        console.close()
        report: dict = {"target": str(target_dir),
                        "draft": engine.SELF if self_draft else str(draft_dir) if draft_dir else None,
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
            if sampling.greedy and base.tokens != result.tokens:
                report["divergence"] = divergence(target, prompt, base.tokens[0], result.tokens[0])
            if base.stats.decode_tokens_per_s and result.stats.decode_tokens_per_s:
                report["decode_speedup"] = result.stats.decode_tokens_per_s / base.stats.decode_tokens_per_s
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
        if self.stream:
            sys.stdout.write("\n")
            sys.stdout.flush()


def _print_summary(report: dict) -> None:
    s = report["stats"]
    rate = f" ({s['decode_tokens_per_s']:.1f} tok/s)" if s["decode_tokens_per_s"] else ""
    lines = [f"new tokens {s['new_tokens']} (finish reason {report['finish_reason']}), time to first token "
             f"{s['ttft_s']:.3f}s, prefill {s['prefill_s']:.3f}s, decode {s['decode_s']:.3f}s{rate}; compilation "
             f"{report.get('compile_s', s['compile_s']):.2f}s (not in those times)"]
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
    if "baseline" in report:
        b = report["baseline"]
        lines.append(f"target-only: {b['decode_tokens_per_s'] or 0:.1f} tok/s; speedup "
                     f"{report.get('decode_speedup', float('nan')):.2f}x; identical output: "
                     f"{report['identical_to_target_only']}")
        div = report.get("divergence")
        if div is not None:
            verdict = ("a numerical near-tie, not a drafting error (see the README on greedy losslessness)"
                       if div["near_tie"] else f"NOT a near-tie (> {NEAR_TIE_LOGIT_GAP}): a bug, please report it")
            lines.append(f"first divergence at new token {div['new_token']}: the target's logits for its token "
                         f"{div['target_only']} and ours {div['speculative']} differ by {div['logit_gap']:.4f} "
                         f"({div['dtype']}): {verdict}")
    print("\n".join(lines), file=sys.stderr)


class _CallableModule(types.ModuleType):
    """Importing this module replaces the package attribute ``diffspec_jax.generate`` (the function) with the
    module; making the module callable keeps ``diffspec_jax.generate(...)`` working either way."""

    def __call__(self, *args, **kwargs):
        return engine.generate(*args, **kwargs)


__signature__ = inspect.signature(engine.generate)
sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
