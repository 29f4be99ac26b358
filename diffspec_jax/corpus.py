"""Training data for the demo pair: the Python standard library sources of the running interpreter.

Documents are **packages** (a directory such as ``email/``, or a top-level module file such as ``argparse.py``):
a package's files are concatenated in path order, each preceded by a ``# file: <path>`` line, so a long training
sequence is repository-level context. A fixed set of packages is held out for evaluation. Generated tables
(``encodings``), documentation data (``pydoc_data``), tests and the IDE are left out.

Every corpus records the Python version, the file list of each split and a sha256 of each split's text, so a
result can be traced to the exact data.

:func:`held_out_prompts` cuts evaluation prompts from the held-out packages, for two workloads:

* ``windows``: random windows of a package (natural code; most of what predicts the next token is local);
* ``recall``: a window that ends by starting to re-emit a file it contains, at least 3/4 of the context back
  (``# file: <path>`` and the file's first tokens), as when a model is asked to rewrite a file of its context. The
  continuation a copying model writes comes from far back, beyond a sliding window's reach.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import platform
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from diffspec_jax.errors import ConfigError

#: packages held out of training (evaluation prompts and the demo prompt come from these)
HELD_OUT = ("argparse", "csv", "email", "http", "json", "logging", "tarfile")
#: the held-out package the demo prompt comes from, left out of the evaluation prompts
DEMO_PROMPT_PACKAGE = "argparse"
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


@dataclass
class LineDeduplicator:
    """Near-duplicate file filter for the training split: a file is dropped when more than ``threshold`` of its
    lines (stripped, at least ``min_chars`` characters) already occurred in files kept before it.

    Code bases copy code: in transformers 5.x two thirds of such lines repeat (a model's modeling file is mostly
    copied from another's, every file opens with the same licence), against a fifth in the standard library, so
    a corpus with it over-weights copied code. Files are seen in corpus order (standard library first), so the
    first copy is the one kept. (Leaving the copies out did not make a continued demo target loop less in greedy
    decoding: ``benchmarks/README.md``, build 7.)

    Attributes:
        threshold: the largest share of already-seen lines a kept file may have, in (0, 1).
        min_chars: shorter lines (``else:``, ``return x``) are ignored [16].
        seen / dropped_files / dropped_chars: the lines of kept files, and what was dropped (for the manifest).
    """

    threshold: float
    min_chars: int = 16
    seen: set = field(default_factory=set, repr=False)
    dropped_files: int = 0
    dropped_chars: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"the deduplication threshold is a share of lines in (0, 1), got {self.threshold}")
        if self.min_chars < 1:
            raise ConfigError(f"min_chars must be >= 1, got {self.min_chars}")

    def keep(self, text: str) -> bool:
        """Whether to keep a file of this text; a kept file's lines join ``seen``."""
        lines = {s for s in (line.strip() for line in text.splitlines()) if len(s) >= self.min_chars}
        # a file's own repeated lines count once: the test is against earlier files
        if lines and len(lines & self.seen) > self.threshold * len(lines):
            self.dropped_files += 1
            self.dropped_chars += len(text)
            return False
        self.seen |= lines
        return True

    def summary(self) -> dict:
        return {"threshold": self.threshold, "min_chars": self.min_chars, "dropped_files": self.dropped_files,
                "dropped_chars": self.dropped_chars}


def _document(name: str, root: Path, paths: list[Path], skip: frozenset[str] = frozenset(),
              dedup: LineDeduplicator | None = None) -> Document:
    """Files of ``paths`` (relative names from ``root``) concatenated, each after a ``# file: <path>`` line; files
    whose text's sha256 is in ``skip``, or that ``dedup`` rejects, are left out."""
    parts, names = [], []
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if hashlib.sha256(text.encode()).hexdigest() in skip or (dedup is not None and not dedup.keep(text)):
            continue
        parts.append(f"# file: {p.relative_to(root).as_posix()}\n{text}\n")
        names.append(p.relative_to(root).as_posix())
    return Document(name=name, files=names, text="".join(parts))


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not any(part in EXCLUDED for part in p.relative_to(root).parts))


def installed_package_documents(names: tuple[str, ...], skip: frozenset[str] = frozenset(),
                                dedup: LineDeduplicator | None = None) -> tuple[list[Document], dict[str, str]]:
    """Training documents from the Python sources of installed packages (e.g. ``transformers``): one document per
    directory (a model's modeling, configuration and tokenizer files together, repository-level context), named
    ``<dir path>``; tests, and files whose text's sha256 is in ``skip`` (vendored copies of held-out modules), are
    left out, and so are files that ``dedup`` rejects. Returns the documents and each package's installed version.

    Raises:
        ConfigError when a package is not installed or is a single module rather than a package directory.
    """
    docs, versions = [], {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"extra corpus package {name!r} is not an installed package directory")
        pkg = Path(list(spec.submodule_search_locations)[0])
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "unknown"
        by_dir: dict[Path, list[Path]] = {}
        for f in _python_files(pkg):
            by_dir.setdefault(f.parent, []).append(f)
        docs += [_document(d.relative_to(pkg.parent).as_posix(), pkg.parent, fs, skip, dedup)
                 for d, fs in sorted(by_dir.items())]
    if dedup is not None:  # directories whose every file was dropped
        docs = [d for d in docs if d.files]
    return docs, versions


def build_corpus(root: str | Path | None = None, held_out: tuple[str, ...] = HELD_OUT,
                 max_files: int | None = None, extra_packages: tuple[str, ...] = (),
                 dedup_threshold: float | None = None) -> Corpus:
    """Collect the standard library of ``root`` (default: this interpreter's) into package documents.

    Args:
        max_files: keep only the first N files in path order (tests build small corpora this way).
        extra_packages: installed packages whose sources join the training split
            (:func:`installed_package_documents`; their versions go into the manifest). More text than a small
            model can memorise: trained for many epochs on the standard library alone, the demo target
            memorises its training text and learns nothing that reads far context.
        dedup_threshold: drop training files of which more than this share of lines occurred in earlier training
            files (:class:`LineDeduplicator`; standard library first, then the extra packages in order). The
            held-out split is never filtered. ``None`` (default) keeps every file.
    """
    root = Path(root) if root is not None else stdlib_root()
    files = _python_files(root)
    if max_files is not None:
        files = files[:max_files]
    by_package: dict[str, list[Path]] = {}
    for f in files:
        by_package.setdefault(_package_of(f.relative_to(root)), []).append(f)
    dedup = LineDeduplicator(dedup_threshold) if dedup_threshold is not None else None
    train, held = [], []
    for name in sorted(by_package):
        if name in held_out:
            held.append(_document(name, root, by_package[name]))
            continue
        doc = _document(name, root, by_package[name], dedup=dedup)
        if doc.files or dedup is None:
            train.append(doc)
    versions = {}
    if extra_packages:
        held_texts = frozenset(hashlib.sha256(p.read_text(encoding="utf-8", errors="replace").encode()).hexdigest()
                               for name in by_package if name in held_out for p in by_package[name])
        extra, versions = installed_package_documents(tuple(extra_packages), held_texts, dedup)
        train += extra

    def digest(docs):
        h = hashlib.sha256()
        for d in docs:
            h.update(d.text.encode())
        return h.hexdigest()

    manifest = {"python": platform.python_version(), "stdlib_root": str(root), "held_out_packages": list(held_out),
                "extra_packages": versions, "dedup": dedup.summary() if dedup is not None else None,
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


#: the workloads of :func:`held_out_prompts`
WORKLOADS = ("windows", "recall")


@dataclass
class Prompt:
    """One evaluation prompt: ``ids`` (``context`` token ids) cut from held-out document ``doc`` at token
    ``start``; ``reference`` holds the document's tokens that follow the prompt (``new_tokens`` of them). Recall
    prompts also name the file being re-emitted: ``source`` is the token where the file starts in the document (its
    copy in the prompt begins ``distance`` tokens before the prompt's end), and their ``reference`` follows the
    re-emitted part (what a perfect copy would write next)."""

    ids: list[int]
    doc: str
    start: int
    source: int | None = None
    distance: int | None = None
    reference: list[int] | None = None

    def describe(self) -> dict:
        """The JSON-able description (no token lists)."""
        return {k: v for k, v in vars(self).items() if k not in ("ids", "reference")}


@dataclass
class EncodedDocument:
    """A document's token ids (int32 ``[N]``) and the token indices where its ``# file: `` headers begin."""

    name: str
    ids: np.ndarray
    file_starts: np.ndarray


def encode_documents(tokenizer, docs: list[Document]) -> list[EncodedDocument]:
    """Tokenize ``docs`` in one batched call (the tokenizer runs in parallel) and locate their file headers."""
    if not docs:
        return []
    enc = tokenizer([d.text for d in docs], return_offsets_mapping=True)
    out = []
    for d, ids, offsets in zip(docs, enc["input_ids"], enc["offset_mapping"]):
        starts = np.asarray([a for a, _ in offsets])
        chars = [m.start() for m in re.finditer(r"(?m)^# file: ", d.text)]
        out.append(EncodedDocument(d.name, np.asarray(ids, np.int32),
                                   np.unique(np.searchsorted(starts, chars, side="right") - 1)))
    return out


def held_out_prompts(docs: list[EncodedDocument], context: int, count: int, seed: int, workload: str = "windows",
                     new_tokens: int = 0, reemit: int = 64) -> list[Prompt]:
    """``count`` prompts of ``context`` tokens from ``docs`` (:func:`encode_documents`), seeded, spread over the
    documents long enough.

    Args:
        workload: ``windows`` (random windows) or ``recall`` (see the module docstring): the prompt is
            ``doc[start : start + context - reemit] + doc[source : source + reemit]`` with ``source`` a file
            header in the first quarter of the window, so the file's first copy begins at least 3/4 of the
            context before the prompt's end.
        new_tokens: tokens each prompt must leave after it in its document (recall: after the re-emitted part),
            so a reference continuation exists.
    Raises:
        ConfigError when no document is long enough (or, for ``recall``, has a usable file header).
    """
    if workload not in WORKLOADS:
        raise ConfigError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    if workload == "recall" and not 0 < reemit < context // 4:
        raise ConfigError(f"recall prompts re-emit 0 < reemit < context / 4 tokens, got {reemit} (context {context})")
    rng = np.random.default_rng(seed)
    cands = []  # (doc, start bounds or header)
    for d in docs:
        ids = d.ids
        if workload == "windows":
            if len(ids) >= context + new_tokens:
                cands.append((d.name, ids, None))
            continue
        for h in d.file_starts:  # the window [h - ctx/4, h] must fit, and the file must go on past the re-emitted part
            if h + context - reemit <= len(ids) and h + reemit + new_tokens <= len(ids):
                cands.append((d.name, ids, int(h)))
    if not cands:
        raise ConfigError(f"no held-out document is long enough for {workload} prompts of {context} tokens "
                          f"(+{new_tokens} new)")
    out = []
    if workload == "windows":
        for i in range(count):
            name, ids, _ = cands[i % len(cands)]
            s = int(rng.integers(0, len(ids) - context - new_tokens + 1))
            out.append(Prompt([int(t) for t in ids[s:s + context]], name, s,
                              reference=[int(t) for t in ids[s + context:s + context + new_tokens]]))
        return out
    order = rng.permutation(len(cands))
    for i in range(count):
        name, ids, h = cands[int(order[i % len(cands)])]
        s = h - int(rng.integers(0, min(h, context // 4) + 1))
        body = ids[s:s + context - reemit]
        out.append(Prompt([int(t) for t in np.concatenate([body, ids[h:h + reemit]])], name, s, source=h,
                          distance=context - (h - s),
                          reference=[int(t) for t in ids[h + reemit:h + reemit + new_tokens]]))
    return out


def copied_fraction(outputs: list[list[int]], prompts) -> float:
    """Mean share of each recall prompt's new tokens that continue its file verbatim (longest common prefix of the
    output and the document's continuation, over the output length)."""
    shares = []
    for out, p in zip(outputs, prompts):
        n = min(len(out), len(p.reference))
        same = np.asarray(out[:n]) == np.asarray(p.reference[:n])
        shares.append((n if same.all() else int(np.argmin(same))) / max(1, len(out)))
    return float(np.mean(shares))
