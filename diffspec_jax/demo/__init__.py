"""The embedded demo pair: a small Llama target and its EAGLE-3 draft trained by :mod:`diffspec_jax.demo.build`
on the Python standard library, shipped under ``pair/`` with its model card and a built-in long prompt."""

from __future__ import annotations

from pathlib import Path

from diffspec_jax.corpus import Document, encode_documents, held_out_prompts
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


def recall_prompt(tokenizer, context: int, passage: int, new_tokens: int):
    """A recall prompt (:func:`diffspec_jax.corpus.held_out_prompts`, workload ``recall``) cut from the built-in
    prompt's text, which is one held-out file after its ``# file: <path>`` line: the first ``context - passage``
    tokens of it, then its first ``passage`` tokens again (the header and the file's opening lines), so that a model
    that copies continues the file from ``context`` tokens back (``Prompt.distance``). ``Prompt.reference`` holds
    the up to ``new_tokens`` tokens that follow the re-emitted part in the file (what a perfect copy writes next).

    Raises:
        ConfigError when the text is shorter than ``context - passage`` tokens or ``passage`` is not in
        ``(0, context / 4)``.
    """
    text = prompt_text()
    name = text.partition("\n")[0].removeprefix("# file: ")
    doc = encode_documents(tokenizer, [Document(name, [name], text)])
    new_tokens = max(0, min(new_tokens, len(doc[0].ids) - passage))  # the reference ends where the text does
    return held_out_prompts(doc, context, 1, seed=0, workload="recall", new_tokens=new_tokens, reemit=passage)[0]
