"""The embedded demo pair: a small Llama target and its EAGLE-3 draft trained by :mod:`diffspec_jax.demo.build`
on the Python standard library, shipped under ``pair/`` with its model card and a built-in long prompt."""

from __future__ import annotations

from pathlib import Path

from diffspec_jax.errors import CheckpointError

PAIR = Path(__file__).resolve().parent / "pair"


def _require(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(f"the embedded demo pair is missing {path} (an installation without package data?); "
                              f"rebuild it with `python -m diffspec_jax.demo.build --out {PAIR}`")
    return path


def target_dir() -> Path:
    return _require(PAIR / "target")


def draft_dir() -> Path:
    return _require(PAIR / "draft")


def prompt_text() -> str:
    """The built-in long prompt: the opening of a held-out standard-library module (about 10K tokens)."""
    return _require(PAIR / "demo_prompt.txt").read_text()
