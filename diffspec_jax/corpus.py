"""Training data for the demo pair: the Python standard library sources of the running interpreter.

Documents are **packages** (a directory such as ``email/``, or a top-level module file such as ``argparse.py``):
a package's files are concatenated in path order, each preceded by a ``# file: <path>`` line, so a long training
sequence is repository-level context. A fixed set of packages is held out for evaluation. Generated tables
(``encodings``), documentation data (``pydoc_data``), tests and the IDE are left out.

Every corpus records the Python version, the file list of each split and a sha256 of each split's text, so a
result can be traced to the exact data.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

#: packages held out of training (evaluation prompts and the demo prompt come from these)
HELD_OUT = ("argparse", "csv", "email", "http", "json", "logging", "tarfile")
#: directories never used
EXCLUDED = ("encodings", "pydoc_data", "idlelib", "test", "tests", "site-packages", "dist-packages",
            "turtledemo", "ensurepip", "__pycache__", "lib2to3", "venv")


@dataclass
class Document:
    name: str
    files: list[str]
    text: str


@dataclass
class Corpus:
    """``train`` and ``held_out`` documents plus a manifest (Python version, files, hashes)."""

    train: list[Document]
    held_out: list[Document]
    manifest: dict = field(default_factory=dict)

    def document(self, name: str) -> Document:
        for d in self.train + self.held_out:
            if d.name == name:
                return d
        raise KeyError(name)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _package_of(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def build_corpus(root: str | Path | None = None, held_out: tuple[str, ...] = HELD_OUT,
                 max_files: int | None = None) -> Corpus:
    """Collect the standard library of ``root`` (default: this interpreter's) into package documents.

    Args:
        max_files: keep only the first N files in path order (tests build small corpora this way).
    """
    root = Path(root) if root is not None else stdlib_root()
    files = sorted(p for p in root.rglob("*.py")
                   if not any(part in EXCLUDED for part in p.relative_to(root).parts))
    if max_files is not None:
        files = files[:max_files]
    by_package: dict[str, list[Path]] = {}
    for f in files:
        by_package.setdefault(_package_of(f.relative_to(root)), []).append(f)
    train, held = [], []
    for name in sorted(by_package):
        paths = by_package[name]
        parts = []
        for p in paths:
            try:
                parts.append(f"# file: {p.relative_to(root).as_posix()}\n{p.read_text(encoding='utf-8')}\n")
            except UnicodeDecodeError:
                continue
        doc = Document(name=name, files=[p.relative_to(root).as_posix() for p in paths], text="".join(parts))
        (held if name in held_out else train).append(doc)

    def digest(docs):
        h = hashlib.sha256()
        for d in docs:
            h.update(d.text.encode())
        return h.hexdigest()

    manifest = {"python": platform.python_version(), "stdlib_root": str(root), "held_out_packages": list(held_out),
                "train_files": sum(len(d.files) for d in train), "held_out_files": sum(len(d.files) for d in held),
                "train_chars": sum(len(d.text) for d in train), "held_out_chars": sum(len(d.text) for d in held),
                "train_sha256": digest(train), "held_out_sha256": digest(held),
                "files": {"train": [f for d in train for f in d.files], "held_out": [f for d in held for f in d.files]}}
    return Corpus(train=train, held_out=held, manifest=manifest)


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE (Hugging Face ``tokenizers``) wrapped as a ``PreTrainedTokenizerFast``.

    Special tokens: ``<|endoftext|>`` (id 0: BOS/EOS) and ``<|pad|>`` (id 1). Save with ``save_pretrained(dir)``
    (writes ``tokenizer.json`` + ``tokenizer_config.json``, which ``transformers.AutoTokenizer`` loads).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", model_max_length=1 << 20, clean_up_tokenization_spaces=False)
