"""``python -m diffspec_jax.serve``: an OpenAI-compatible server with continuous batching and speculative decoding.

Examples::

    python -m diffspec_jax.serve                                      # the embedded demo pair on 127.0.0.1:8000
    python -m diffspec_jax.serve --target T --draft D --max-num-seqs 8 --max-model-len 65536 --policy diffspec
    python -m diffspec_jax.serve --target T --draft self                # the target drafts for itself
    python -m diffspec_jax.serve --target T --draft D --tp 4            # the target sharded over 4 devices
    python -m diffspec_jax.serve --target T --draft ngram               # prompt lookup, no draft model
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "def main():", "max_tokens": 32, "temperature": 0}'

The server binds to ``--host`` (default 127.0.0.1, this machine only; pass ``--host 0.0.0.0`` to serve others,
ideally with ``--api-key``). It loads the models, compiles every program (the warm-up) and then listens; see
docs/serving.md for the endpoints, the limits, the metrics and the design. On a CPU it defaults to one sequence of
384 tokens (:func:`engine_sizes`). The first Ctrl-C (SIGINT, or SIGTERM) stops accepting requests and finishes
those in flight for up to ``--shutdown-timeout`` seconds, then aborts them; a second one aborts them at once. It
exits with status 1 when its engine fails (every request in it is answered with an error first), for a supervisor
to restart it.
"""

from __future__ import annotations

import dataclasses
import sys

import jax

from diffspec_jax.draft import load_draft
from diffspec_jax.errors import ConfigError, DiffspecError
from diffspec_jax.generate import (_tokenizer, add_model_arguments, add_parallel_arguments, add_spec_arguments,
                                   check_parallel_options, model_dirs, named_draft, resolve_dtype_arg,
                                   spec_from_args)
from diffspec_jax.serving.scheduler import DEFAULT_MAX_MODEL_LEN, EngineConfig, SlotEngine
from diffspec_jax.stopping import generation_defaults
from diffspec_jax.target import load_target
from diffspec_jax.validation import ArgumentParser, check_int, quiet_library_notices, read_text, report_error

#: the defaults on a CPU (:func:`engine_sizes`): one 48-token answer of the demo pair within 1.5x of the CLI's time
#: (a cache of 512 positions: 384 + the verify block + a parking page, in whole attention tiles)
CPU_MAX_NUM_SEQS, CPU_MAX_MODEL_LEN = 1, 384
#: what the CPU defaults' note says (docs/serving.md, "On a CPU", has the runs)
CPU_MEASURED = ("a 48-token answer of the demo pair took 1.1-1.2x the CLI's time at 1 x 384 "
                "(benchmarks/results/cpu_first_request.json)")


def build_parser() -> ArgumentParser:
    """The server's options: the model and speculative options of ``python -m diffspec_jax.generate`` (same
    names) and the server's own."""
    ap = ArgumentParser(prog="python -m diffspec_jax.serve", description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    add_spec_arguments(ap)
    add_parallel_arguments(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help=f"sequences decoded together (default {EngineConfig.max_num_seqs}; {CPU_MAX_NUM_SEQS} on a "
                         f"CPU); memory is held by pages, not by this number")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help=f"most tokens (prompt + generated) per request (default: the target's context window, at "
                         f"most {DEFAULT_MAX_MODEL_LEN}; on a CPU {CPU_MAX_MODEL_LEN}, since every decode step there "
                         f"costs in proportion to --max-num-seqs x --max-model-len)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per page of the paged K/V pool (a power of two, 16 to 256; default 128 on a GPU, "
                         "64 elsewhere)")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="pages in the K/V pool (default: sized by --kv-cache-memory-fraction on a GPU; on a CPU what "
                         "--max-num-seqs requests of --max-model-len tokens need)")
    ap.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                    help="share of the device's memory the process may fill; the K/V pool gets what is left of it "
                         "after the weights (default 0.9)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="do not reuse the K/V of prompt pages that earlier requests computed (default: reuse)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    ap.add_argument("--served-model-name", default=None,
                    help="the model name of /v1/models and of requests (default: the target directory's name)")
    ap.add_argument("--chat-template", default=None,
                    help="a file holding a Jinja chat template (default: the tokenizer's own)")
    ap.add_argument("--max-waiting", type=int, default=256,
                    help="requests waiting for a slot beyond which the server answers 503 (default 256)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds a request may run before it is ended with 504 (default 600)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prompt tokens per prefill chunk, one fixed width (default 512 on CPUs, 2048 on GPUs)")
    ap.add_argument("--block-cycles", type=int, default=None, help="decode cycles per device block (default 16)")
    ap.add_argument("--max-prefill-per-block", type=int, default=None,
                    help="prompt tokens prefilled between two decode blocks while requests decode, in whole chunks "
                         "(default one chunk): bounds the gap prefill adds between a running request's tokens")
    ap.add_argument("--max-request-bytes", type=int, default=None,
                    help="largest request body; a larger one gets 413 before it is parsed (default: 1 MiB + 64 "
                         "bytes per token of --max-model-len)")
    ap.add_argument("--header-timeout", type=float, default=20.0,
                    help="seconds for a request's headers to arrive, from the connection or the request's first "
                         "byte; past it 408 and the connection closes (default 20)")
    ap.add_argument("--body-timeout", type=float, default=60.0,
                    help="seconds for a request's body to arrive after its headers; past it 408 (default 60)")
    ap.add_argument("--keep-alive-timeout", type=float, default=5.0,
                    help="seconds an idle keep-alive connection stays open (default 5)")
    ap.add_argument("--max-connections", type=int, default=512,
                    help="open connections at most; beyond it requests get 503 (default 512)")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds the requests in flight may take to finish after the first SIGINT/SIGTERM, which "
                         "stops accepting new ones; then they are aborted (finish_reason 'abort'), as at a second "
                         "Ctrl-C (default 10)")
    ap.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    return ap


def engine_sizes(max_num_seqs: int | None, max_model_len: int | None, backend: str) -> tuple[int, int | None, str]:
    """``(max_num_seqs, max_model_len, note)``: the options, or their defaults on ``backend``. On a CPU every decode
    step costs in proportion to the sequences x the tokens a request may reach (each step attends over that whole
    capacity), so the CPU defaults are small (:data:`CPU_MAX_NUM_SEQS` x :data:`CPU_MAX_MODEL_LEN`); ``note`` says
    so when a CPU default was taken ("" otherwise)."""
    cpu = backend == "cpu"
    note = ""
    if cpu and (max_num_seqs is None or max_model_len is None):
        note = (f"on a CPU the defaults are --max-num-seqs {CPU_MAX_NUM_SEQS} --max-model-len {CPU_MAX_MODEL_LEN}: "
                f"each decode step's cost grows with both (measured on 2 cores: {CPU_MEASURED}); raise them for "
                f"longer prompts or concurrent requests")
    if max_num_seqs is None:
        max_num_seqs = CPU_MAX_NUM_SEQS if cpu else EngineConfig.max_num_seqs
    if max_model_len is None and cpu:
        max_model_len = CPU_MAX_MODEL_LEN
    return max_num_seqs, max_model_len, note


def main(argv: list[str] | None = None) -> int:
    quiet_library_notices()
    args = build_parser().parse_args(argv)
    try:
        check_int(args.port, "--port", min=0, max=65535)
        check_parallel_options(args)
        target_dir, draft_dir, embedded = model_dirs(args)
        spec = spec_from_args(args, args.draft_tp)
        max_num_seqs, max_model_len, cpu_note = engine_sizes(args.max_num_seqs, args.max_model_len,
                                                             jax.default_backend())
        config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              prefill_chunk=args.prefill_chunk, block_cycles=args.block_cycles,
                              max_prefill_per_block=args.max_prefill_per_block, max_waiting=args.max_waiting,
                              request_timeout=args.request_timeout, block_size=args.block_size,
                              num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                              prefix_caching=not args.no_prefix_caching, tensor_parallel_size=args.tp,
                              kv_cache_dtype=args.kv_cache_dtype)
        template = read_text(args.chat_template, "chat template", error=ConfigError) if args.chat_template else None
        try:
            from diffspec_jax.serving.app import check_chat_template, create_app
            from diffspec_jax.serving.limits import HTTPLimits, run_server
        except ImportError as exc:
            raise ConfigError(f"the server needs the serve extra ({exc.name} is missing): pip install "
                              f"'diffspec-jax[serve]'") from None
        limits = HTTPLimits(max_request_bytes=args.max_request_bytes, header_timeout=args.header_timeout,
                            body_timeout=args.body_timeout, keep_alive_timeout=args.keep_alive_timeout,
                            max_connections=args.max_connections, shutdown_timeout=args.shutdown_timeout)
        tok = _tokenizer(target_dir)
        if tok is None:
            raise ConfigError(f"{target_dir} has no tokenizer (tokenizer.json / tokenizer_config.json): the server "
                              f"needs one for prompts and text")
        chat = check_chat_template(tok, template, f"--chat-template {args.chat_template}" if template else
                                   f"the tokenizer's, in {target_dir}")
        target = load_target(target_dir, dtype=resolve_dtype_arg(args.dtype), verify=not args.no_verify)
        if args.max_model_len is None and config.max_model_len is not None:  # a CPU default: at most the context
            config = dataclasses.replace(config, max_model_len=min(config.max_model_len,
                                                                   target.config.max_position_embeddings))
        draft = named_draft(args) or (load_draft(draft_dir, target, verify=not args.no_verify)
                                      if draft_dir is not None else None)
        engine = SlotEngine(target, draft, spec, config)
        name = args.served_model_name or ("diffspec-demo" if embedded else target_dir.resolve().name)
        app = create_app(engine, tok, model_name=name, api_key=args.api_key, chat_template=template,
                         sampling_defaults=generation_defaults(target_dir))
        print(f"[diffspec-serve] {name}: policy {engine.policy}, up to {engine.num_slots} sequences decoded together, "
              f"max_model_len {engine.max_model_len}, {engine.parallel_summary()}; {engine.pool_summary()}; "
              f"compiling...", file=sys.stderr, flush=True)
        for note in (cpu_note, "" if chat is not None else f"{name} has no chat template: /v1/chat/completions "
                                                           f"answers 400 (start with --chat-template FILE)"):
            if note:
                print(f"[diffspec-serve] {note}", file=sys.stderr, flush=True)
        engine.start()
        print(f"[diffspec-serve] compiled {engine.compiles} programs in {engine.clock.seconds:.1f} s; listening on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    except (DiffspecError, OSError) as exc:
        return report_error(exc)
    except KeyboardInterrupt:  # Ctrl-C while loading or compiling (once it listens, the server handles signals)
        print("[diffspec-serve] interrupted before the server started", file=sys.stderr, flush=True)
        return 130
    status = run_server(app, engine, limits, host=args.host, port=args.port, log_level=args.log_level)
    if status:
        print(f"[diffspec-serve] the engine failed ({type(engine.error).__name__}: {engine.error}); exiting with "
              f"status {status} for a supervisor to restart the server", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
