"""``diffspec``: one command for every tool, ``diffspec COMMAND [ARGS]``.

Each command runs an existing entry point with the rest of the arguments unchanged (``diffspec generate --help``
is ``python -m diffspec_jax.generate --help``, its program named ``diffspec generate``):

* ``generate``: :mod:`diffspec_jax.generate`; ``convert``: :mod:`checkpoints_tools.convert`; ``inspect``:
  :mod:`checkpoints_tools.inspect`; ``train-draft``: :mod:`diffspec_jax.train_draft`;
* ``bench NAME``: ``benchmarks/NAME.py`` (the benchmarks are not installed with the package: run it from the
  root of a source checkout);
* ``serve``: ``diffspec_jax.serve`` where this installation has it.

Nothing here imports JAX: ``diffspec --help`` is instant; a command imports only its own tool.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from diffspec_jax.validation import ArgumentParser, quiet_library_notices

#: command -> (module whose ``main(argv)`` runs it, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("diffspec_jax.generate", "speculative generation from a prompt (python -m diffspec_jax.generate)"),
    "convert": ("checkpoints_tools.convert", "Hugging Face <-> Orbax checkpoints, *.bin -> safetensors "
                                             "(python -m checkpoints_tools.convert)"),
    "inspect": ("checkpoints_tools.inspect", "what a checkpoint holds and whether its files are intact "
                                             "(python -m checkpoints_tools.inspect)"),
    "train-draft": ("diffspec_jax.train_draft", "train an EAGLE-3 draft for a target "
                                                "(python -m diffspec_jax.train_draft)"),
    "bench": ("benchmarks", "run a benchmark: diffspec bench NAME [ARGS] (from a source checkout's root; "
                            "python benchmarks/NAME.py)"),
    "serve": ("diffspec_jax.serve", "the OpenAI-compatible server (diffspec_jax.serve; the serve extra)"),
}
#: the benchmark scripts ``diffspec bench`` runs (``benchmarks/NAME.py``, each with ``main(argv)``)
BENCHMARKS = ("e2e", "paired", "long_context", "kernels", "lossless_check", "decode_ablation", "copy_probe",
              "profile_steps", "serve_load")


def build_parser() -> ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
    ap = ArgumentParser(prog="diffspec", description="One command for every diffspec-jax tool: diffspec COMMAND "
                                                     "[ARGS].",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=f"commands:\n{listing}\n\n`diffspec COMMAND --help` shows a command's options.")
    ap.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="one of the commands below")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    return ap


def _fail(message: str) -> int:
    print(f"diffspec: error: {message}", file=sys.stderr)
    return 2


def _bench(argv: list[str]) -> int:
    listing = ", ".join(BENCHMARKS)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: diffspec bench NAME [ARGS]\n\nruns benchmarks/NAME.py from the root of a source checkout; "
              f"NAME is one of: {listing}\n`diffspec bench NAME --help` shows its options.")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        return _fail(f"unknown benchmark {name!r} (choose one of {listing})")
    if importlib.util.find_spec("benchmarks") is None and (Path.cwd() / "benchmarks" / "__init__.py").is_file():
        sys.path.insert(0, str(Path.cwd()))  # a source checkout's root, as `python benchmarks/NAME.py` runs there
    if importlib.util.find_spec("benchmarks") is None:
        return _fail("the benchmarks are not installed with the package: run `diffspec bench` from the root of a "
                     "source checkout (the folder holding benchmarks/)")
    module = importlib.import_module(f"benchmarks.{name}")
    return _run_as(f"diffspec bench {name}", module.main, rest)


def _run_as(prog: str, main, argv: list[str]) -> int:
    """``main(argv)`` with ``sys.argv[0]`` set to ``prog``: a tool's usage and ``--help`` name it after the command
    that ran it (argparse's default program name; :func:`diffspec_jax.validation.program_name`)."""
    argv0 = sys.argv[0]
    sys.argv[0] = prog
    try:
        return int(main(argv) or 0)
    finally:
        sys.argv[0] = argv0


def main(argv: list[str] | None = None) -> int:
    quiet_library_notices()
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    if not argv:
        ap.print_help(sys.stderr)
        return 2
    args = ap.parse_args(argv)
    if args.command == "bench":
        return _bench(args.args)
    module = COMMANDS[args.command][0]
    if importlib.util.find_spec(module) is None:
        return _fail(f"`diffspec {args.command}` needs {module}, which this installation does not have; "
                     f"`diffspec generate` runs generation from the command line")
    return _run_as(f"diffspec {args.command}", importlib.import_module(module).main, args.args)


if __name__ == "__main__":
    raise SystemExit(main())
