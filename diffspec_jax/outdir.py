"""Safe output directories and SHA-256 manifests, shared by every tool that writes a directory.

:class:`OutputDir` is how ``checkpoints_tools.convert``, ``python -m diffspec_jax.train_draft`` and
``python -m diffspec_jax.demo.build`` write their ``--out``:

* the checks come first, before anything is written: ``--out`` may not be an input, lie inside one or contain
  one; a non-empty ``--out`` is refused unless a diffspec tool wrote it (its manifest lists every file in it,
  digests matching) or ``--overwrite`` is given;
* the tool writes into a sibling ``<out>.partial`` (marked as ours by a ``.diffspec_partial`` file), so a failed
  run never leaves a half-written ``--out``; on success the manifests are written and the directory is renamed
  into place (one ``rename`` on the same file system);
* nothing the tool did not write is ever deleted: a previous output of a diffspec tool is replaced, anything else
  (only with ``--overwrite``) is moved aside to ``<out>.replaced-<time>``.

:class:`OutputFile` applies the same policy to a single output file (the benchmarks' ``--out`` JSON and figure):
an existing file is replaced only when a diffspec tool wrote it (a JSON output carries a mark with a digest of its
contents, a PNG a ``Software`` text), each write goes to a temporary sibling and is renamed into place.

Manifest format (``diffspec_manifest.json``, JSON)::

    {"format": "diffspec-manifest", "version": 1, "tool": "checkpoints_tools.convert", "algorithm": "sha256",
     "files": {"config.json": {"bytes": 812, "sha256": "<64 hex>"}, "params/manifest.ocdbt": {...}, ...},
     "self_sha256": "<64 hex>"}

``files`` lists every file of the directory (paths relative to it, ``/``-separated) except the manifest;
``self_sha256`` is the SHA-256 of the manifest's other fields (canonical JSON: sorted keys, no spaces), so a
damaged manifest is detected too. Tools may add fields (``convert`` records its source's digests under
``"source"``); the self digest covers them. :func:`verify_manifest` checks a directory against its manifest
(``load_target`` / ``load_draft`` do when one is present, ``checkpoints_tools.inspect --verify`` on demand).

Digests of unchanged files are remembered (:func:`file_digest`): in this process and in a small on-disk cache
(``$DIFFSPEC_DIGEST_CACHE``, default ``~/.cache/diffspec_jax/digests``; ``off`` disables it), keyed by the file's
real path, device, inode, size, modification and status-change times, so loading the same checkpoint again does
not hash it again. A file damaged without any of these changing (bit rot on the disk) is only found by hashing
afresh: ``inspect --verify`` always does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator

from diffspec_jax.errors import IntegrityError, OutputDirError

MANIFEST = "diffspec_manifest.json"
MANIFEST_FORMAT = "diffspec-manifest"
PARTIAL_MARKER = ".diffspec_partial"
#: the environment variable naming the digest cache directory (``0`` / ``off`` / ``false`` / ``no``: none)
DIGEST_CACHE_ENV = "DIFFSPEC_DIGEST_CACHE"
#: manifest fields a tool may not set through ``extra``
_RESERVED = frozenset({"format", "version", "tool", "algorithm", "files", "self_sha256"})
#: this process's remembered digests, by :func:`_stat_key`
_digests: dict[tuple, str] = {}


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def digest_cache_dir(environ=None) -> Path | None:
    """Where :func:`file_digest` keeps digests across processes: ``$DIFFSPEC_DIGEST_CACHE`` when it names a
    directory, ``None`` when it is ``0`` / ``off`` / ``false`` / ``no``, else ``$XDG_CACHE_HOME/diffspec_jax/digests``
    (default ``~/.cache/diffspec_jax/digests``)."""
    env = os.environ if environ is None else environ
    value = (env.get(DIGEST_CACHE_ENV) or "").strip()
    if value.lower() in ("0", "off", "false", "no", "none"):
        return None
    if value:
        return Path(value).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diffspec_jax" / "digests"


def _stat_key(path: Path) -> tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_digest(path: str | Path, *, cached: bool = True) -> str:
    """SHA-256 of ``path``. With ``cached``, a digest computed before for the same file (same real path, device,
    inode, size, mtime and ctime) is reused, from this process or from :func:`digest_cache_dir`; a new one is
    remembered there (a cache that cannot be written is skipped)."""
    path = Path(path)
    if not cached:
        return sha256_file(path)
    key = _stat_key(path)
    if key in _digests:
        return _digests[key]
    store = digest_cache_dir()
    entry = store / hashlib.sha256(repr(key).encode()).hexdigest() if store is not None else None
    try:
        known = entry.read_text().strip() if entry is not None else ""
    except OSError:
        known = ""
    if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
        _digests[key] = known
        return known
    digest = sha256_file(path)
    if _stat_key(path) == key:  # unchanged while it was read
        _digests[key] = digest
        if entry is not None:
            try:
                entry.parent.mkdir(parents=True, exist_ok=True)
                tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
                tmp.write_text(digest + "\n")
                os.replace(tmp, entry)
            except OSError:
                pass
    return digest


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def write_manifest(directory: str | Path, tool: str, extra: dict[str, Any] | None = None) -> Path:
    """Write ``directory/diffspec_manifest.json`` listing (size, SHA-256) every file under ``directory``, with the
    JSON fields of ``extra`` (e.g. ``convert``'s ``"source"``) beside them."""
    directory = Path(directory)
    files = {}
    for p in _files_under(directory):
        rel = p.relative_to(directory).as_posix()
        if rel in (MANIFEST, PARTIAL_MARKER):
            continue
        files[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    clash = sorted(_RESERVED & set(extra or {}))
    if clash:
        raise ValueError(f"write_manifest: extra may not set {clash}")
    body: dict[str, Any] = {**(extra or {}), "format": MANIFEST_FORMAT, "version": 1, "tool": tool,
                            "algorithm": "sha256", "files": files}
    body["self_sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    out = directory / MANIFEST
    out.write_bytes(_layout(body))
    return out


def _layout(body: dict) -> bytes:
    """The manifest file's exact bytes (read back byte for byte: a changed space is damage too)."""
    return (json.dumps(body, indent=1, sort_keys=True, ensure_ascii=True) + "\n").encode()


def read_manifest(directory: str | Path) -> dict | None:
    """The manifest of ``directory`` (``None`` when it has none).

    Raises:
        IntegrityError: the manifest is unreadable, not the manifest format, or its self digest does not match.
    """
    file = Path(directory) / MANIFEST
    if not file.is_file():
        return None
    fix = f"the manifest is damaged: re-create {Path(directory)} with the tool that wrote it"
    try:
        raw = file.read_bytes()
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as exc:
        raise IntegrityError(f"{file}: cannot read the manifest ({exc}); {fix}") from None
    ok = (isinstance(body, dict) and body.get("format") == MANIFEST_FORMAT and body.get("version") == 1
          and body.get("algorithm") == "sha256" and isinstance(body.get("files"), dict)
          and isinstance(body.get("self_sha256"), str))
    if ok:
        rest = {k: v for k, v in body.items() if k != "self_sha256"}
        ok = hashlib.sha256(_canonical(rest)).hexdigest() == body["self_sha256"] and raw == _layout(body)
    if ok:
        for rel, entry in body["files"].items():
            parts = PurePosixPath(rel).parts
            if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                    or not isinstance(entry.get("bytes"), int) or not parts or rel.startswith("/")
                    or any(part in ("..", "") for part in parts) or "\\" in rel):
                ok = False
                break
    if not ok:
        raise IntegrityError(f"{file}: not a valid {MANIFEST_FORMAT} (its contents, layout or self digest do not "
                             f"match); {fix}")
    return body


def verify_manifest(directory: str | Path, *, required: bool = False, skip: Iterable[str] = (),
                    only: Iterable[str] | None = None, cached: bool = True) -> dict | None:
    """Check every file listed in ``directory``'s manifest (size, then SHA-256); return the manifest, or ``None``
    when there is none (an :class:`IntegrityError` with ``required``).

    ``skip`` / ``only`` restrict the check to some of the listed files (relative paths), so a loader can check
    the weights first and ``config.json`` once it knows the files fit it. ``cached=False`` hashes every file
    afresh instead of reusing digests of unchanged files (:func:`file_digest`).

    Raises:
        IntegrityError: naming the first file that is missing, of another size or of another digest.
    """
    directory = Path(directory)
    body = read_manifest(directory)
    if body is None:
        if required:
            raise IntegrityError(f"{directory} has no {MANIFEST}: nothing to verify against (compare files with a "
                                 f"publisher's digests with --expect-sha256 instead)")
        return None
    for problem in manifest_mismatches(directory, body, skip=skip, only=only, cached=cached):
        raise problem
    return body


def manifest_mismatches(directory: str | Path, body: dict, *, skip: Iterable[str] = (),
                        only: Iterable[str] | None = None, cached: bool = True) -> Iterator[IntegrityError]:
    """An :class:`IntegrityError` for each file the manifest ``body`` (:func:`read_manifest`) lists that is
    missing, of another size or of another digest, in path order (lazily: :func:`verify_manifest` stops at the
    first, ``inspect`` reports all)."""
    directory = Path(directory)
    hint = (f"the file is damaged or was changed after {body.get('tool', 'the tool')} wrote it: re-download or "
            f"re-create the checkpoint (if you changed it on purpose, delete {MANIFEST}, or load with verify=False)")
    skip = set(skip)
    only = None if only is None else set(only)
    for rel, entry in sorted(body["files"].items()):
        if rel in skip or (only is not None and rel not in only):
            continue
        path = directory / rel
        if not path.is_file():
            yield IntegrityError(f"{directory}: {rel} is listed in {MANIFEST} but missing; {hint}")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            yield IntegrityError(f"{directory}: {rel} has {size} bytes, its manifest says {entry['bytes']} "
                                 f"(truncated or extended); {hint}")
            continue
        try:
            digest = file_digest(path, cached=cached)
        except OSError as exc:
            yield IntegrityError(f"{directory}: cannot read {rel} to check its digest ({exc.strerror or exc})")
            continue
        if digest != entry["sha256"]:
            yield IntegrityError(f"{directory}: {rel} has SHA-256 {digest}, its manifest says {entry['sha256']}; "
                                 f"{hint}")


def written_by_diffspec(directory: str | Path) -> bool:
    """Every file under ``directory`` is listed in its (valid) manifest with matching size and digest: the
    directory holds nothing but a diffspec tool's output, which may be replaced."""
    directory = Path(directory)
    try:
        body = read_manifest(directory)
    except IntegrityError:
        return False
    if body is None:
        return False
    listed = body["files"]
    for p in _files_under(directory):
        rel = p.relative_to(directory).as_posix()
        if rel == MANIFEST:
            continue
        entry = listed.get(rel)
        if entry is None or p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
            return False
    return True


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(directory).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in _files_under(directory)}


def _resolve(path: str | Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser())).resolve()


class OutputDir:
    """Write a tool's output directory safely (see the module docstring).

    Use as a context manager: the checks run on entry, which returns the directory to write into
    (``<out>.partial``); a clean exit writes the manifests and renames it to ``out``; an exception leaves ``out``
    as it was (the partial directory is removed, or kept with ``keep_on_error`` / ``resume``).

    Args:
        out: the output directory (``--out``).
        tool: the tool's name, recorded in the manifests.
        inputs: paths the tool reads (``None`` entries are skipped): ``out`` may not be one of them, lie inside one
            or contain one.
        overwrite: replace a non-empty ``out`` that no diffspec tool wrote (moved to ``<out>.replaced-<time>``).
        manifests: subdirectories (relative to ``out``; ``"."`` = ``out`` itself) that get a manifest.
        resume: keep a partial directory left by an interrupted run of the same tool (training checkpoints there
            resume), and keep it again when this run fails.
        keep_on_error: keep the partial directory when the run fails (for inspection; the next run clears it).
        option: the option name used in messages.
    Raises:
        OutputDirError: on entry (nothing written) for an output that would lose or damage files.
    """

    def __init__(self, out: str | Path, *, tool: str, inputs: Iterable[str | Path | None] = (), overwrite: bool = False,
                 manifests: Iterable[str] = (".",), resume: bool = False, keep_on_error: bool = False,
                 option: str = "--out"):
        self.given = Path(out)
        self.out = _resolve(out)
        self.tool, self.overwrite, self.resume, self.keep_on_error = tool, bool(overwrite), resume, keep_on_error
        self.inputs = [Path(p) for p in inputs if p is not None]
        self.manifests = sorted(set(manifests), key=lambda s: (-len(Path(s).parts), s))
        self.option = option
        self.partial = self.out.parent / f"{self.out.name}.partial"
        self.replaced: Path | None = None
        self._existing: str | None = None
        self._snap: dict | None = None
        self._checked = False
        #: JSON fields the tool adds to the manifests it writes (``convert``: ``"source"``), set before exit
        self.extra: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------ checks
    def check(self) -> None:
        """Every refusal (no side effects)."""
        self._existing, self._snap = None, None
        out, opt = self.out, self.option
        if out == Path(out.anchor) or not out.name:
            raise OutputDirError(f"{opt} {self.given} is a file system root; choose a new directory")
        cwd = _resolve(Path.cwd())
        if out == cwd or out in cwd.parents:
            raise OutputDirError(f"{opt} {self.given} contains the current directory, which the output would "
                                 f"replace; choose a new directory")
        for given in self.inputs:
            inp = _resolve(given)
            if inp == out:
                raise OutputDirError(f"{opt} {self.given} is the input {given} itself: the output would overwrite "
                                     f"it (an input may not lie inside {opt}, nor {opt} inside an input); choose "
                                     f"another {opt}")
            if inp in out.parents:
                raise OutputDirError(f"{opt} {self.given} lies inside the input {given}: writing there would change "
                                     f"the input; choose a directory outside it")
            if out in inp.parents:
                raise OutputDirError(f"the input {given} lies inside {opt} {self.given}, which the output replaces; "
                                     f"choose another {opt} (or move the input out of it)")
            if inp == self.partial or self.partial in inp.parents:
                raise OutputDirError(f"the input {given} lies inside {self.partial}, the directory the output is "
                                     f"written to first; move it or choose another {opt}")
        if out.exists() and not out.is_dir():
            raise OutputDirError(f"{opt} {self.given} exists and is not a directory; choose a new directory")
        if out.is_dir() and any(out.iterdir()):
            if written_by_diffspec(out):
                self._existing, self._snap = "ours", _snapshot(out)
            elif self.overwrite:
                self._existing = "foreign"
            else:
                raise OutputDirError(
                    f"{opt} {self.given} is not empty and was not written by a diffspec-jax tool (no {MANIFEST} "
                    f"listing its files); choose a new directory, or pass --overwrite to replace it (its contents are "
                    f"moved to {out.name}.replaced-<time> beside it; nothing is deleted)")
        if self.partial.exists():
            if not self.partial.is_dir():
                raise OutputDirError(f"{self.partial} (where the output is written first) exists and is not a "
                                     f"directory; remove it or choose another {opt}")
            if not (self.partial / PARTIAL_MARKER).exists() and any(self.partial.iterdir()):
                raise OutputDirError(f"{self.partial} (where the output is written first) exists and was not made by "
                                     f"a diffspec-jax tool; remove it or choose another {opt}")
        self._checked = True

    # ------------------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Path:
        if not self._checked:
            self.check()
        if self.partial.exists() and (self.partial / PARTIAL_MARKER).exists() and not self.resume:
            shutil.rmtree(self.partial)  # an earlier run's partial output (ours: it carries the marker)
        self.partial.mkdir(parents=True, exist_ok=True)
        (self.partial / PARTIAL_MARKER).write_text(json.dumps(
            {"tool": self.tool, "out": str(self.out), "pid": os.getpid(), "started": time.time()}) + "\n")
        return self.partial

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.commit()
        else:
            note = self.abort()
            if note and isinstance(exc, BaseException):
                exc.add_note(note)  # shown by tracebacks and by the CLIs' one-line messages
        return False

    def commit(self) -> Path:
        """Write the manifests and move the partial directory to ``out``; returns ``out``."""
        marker = self.partial / PARTIAL_MARKER
        for sub in self.manifests:
            d = self.partial / sub
            if d.is_dir():
                write_manifest(d, self.tool, self.extra)
        marker.unlink(missing_ok=True)
        out = self.out
        try:
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                os.rename(self.partial, out)
                return out
            if self._existing == "ours" and _snapshot(out) == self._snap:
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                os.rename(out, old)
                try:
                    os.rename(self.partial, out)
                except OSError:
                    os.rename(old, out)
                    raise
                shutil.rmtree(old)  # only files a diffspec tool wrote (checked on entry, unchanged since)
                return out
            if self._existing is None and not self.overwrite:
                raise OutputDirError(f"{self.option} {self.given} was created by someone else while this run wrote "
                                     f"its output; the output is in {self.partial}")
            backup = _free_name(out.parent, f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            os.rename(out, backup)
            os.rename(self.partial, out)
            self.replaced = backup
            print(f"note: the previous contents of {self.given} were moved to {backup}", file=sys.stderr)
            return out
        except BaseException:
            if self.partial.exists():
                marker.write_text(json.dumps({"tool": self.tool, "out": str(self.out)}) + "\n")
            raise

    def abort(self) -> str | None:
        """After a failed run: remove the partial directory, or keep it (``resume`` / ``keep_on_error``, when it
        holds anything) and return a note saying where."""
        if not self.partial.exists():
            return None
        written = [p for p in self.partial.rglob("*") if p.name != PARTIAL_MARKER]
        if written and (self.resume or self.keep_on_error):
            what = "run the same command again to continue from it" if self.resume else "the next run replaces it"
            return f"{self.option} {self.given} is unchanged; the unfinished output is kept in {self.partial} ({what})"
        shutil.rmtree(self.partial, ignore_errors=True)
        return None


# ------------------------------------------------------------------------------------------ single files
#: the key of a JSON output's mark: ``{"tool": ..., "sha256": <SHA-256 of the canonical JSON of the other keys>}``
MARK_KEY = "diffspec_output"
#: PNG outputs carry ``Software: diffspec-jax <tool>`` (a ``tEXt`` chunk)
PNG_SOFTWARE = "diffspec-jax"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _json_digest(payload: dict) -> str:
    rest = json.loads(json.dumps({k: v for k, v in payload.items() if k != MARK_KEY}))  # as a reader sees it
    return hashlib.sha256(_canonical(rest)).hexdigest()


def mark_json(payload: dict, tool: str) -> dict:
    """``payload`` with its mark under :data:`MARK_KEY` (first): which tool wrote it and a digest of the rest, so
    a later run can tell its own unchanged output from anyone else's file."""
    rest = {k: v for k, v in payload.items() if k != MARK_KEY}
    return {MARK_KEY: {"tool": tool, "sha256": _json_digest(rest)}, **rest}


def png_metadata(tool: str) -> dict[str, str]:
    """The ``metadata`` of ``savefig`` for a PNG output: marks it as written by ``tool``."""
    return {"Software": f"{PNG_SOFTWARE} {tool}"}


def _png_software(data: bytes) -> str | None:
    """The ``Software`` text of a PNG (``None`` for anything else)."""
    if not data.startswith(_PNG_SIGNATURE):
        return None
    at = len(_PNG_SIGNATURE)
    while at + 8 <= len(data):
        size, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + size]
        if kind == b"tEXt" and body.startswith(b"Software\x00"):
            return body[len(b"Software\x00"):].decode("latin-1")
        if kind in (b"IDAT", b"IEND"):  # matplotlib writes its text chunks before the image data
            return None
        at += 12 + size
    return None


def file_written_by_diffspec(path: str | Path) -> bool:
    """Whether ``path`` is a file a diffspec tool wrote and nobody changed since: a JSON object whose mark's digest
    matches the rest, or a PNG marked by :func:`png_metadata`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError:
        return False
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        software = _png_software(data)
        return software is not None and software.startswith(PNG_SOFTWARE + " ")
    mark = body.get(MARK_KEY) if isinstance(body, dict) else None
    return isinstance(mark, dict) and mark.get("sha256") == _json_digest(body)


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class OutputFile:
    """Write one output file (a benchmark's JSON or figure) with :class:`OutputDir`'s policy:

    * :meth:`check` runs first, before any work: ``path`` may not be a directory or another non-regular file; an
      existing non-empty file is refused unless a diffspec tool wrote it (:func:`file_written_by_diffspec`) or
      ``overwrite`` is given;
    * each write goes to a temporary sibling, renamed into place, so a reader never sees half a file; the run may
      rewrite its own file as often as it likes (a benchmark after every shape: a run cut short keeps what it
      measured);
    * nothing the tool did not write is deleted: with ``overwrite`` a foreign file is moved to
      ``<name>.replaced-<time>`` at the first write; a file changed by someone else while the run wrote it is
      left alone (the run's output then stays in the temporary file, named in the error).

    Raises:
        OutputDirError: from :meth:`check` (nothing written) and from a write that would lose someone's file.
    """

    def __init__(self, path: str | Path, *, tool: str, overwrite: bool = False, option: str = "--out"):
        self.given, self.path = Path(path), _resolve(path)
        self.tool, self.overwrite, self.option = tool, bool(overwrite), option
        self.replaced: Path | None = None
        self._expect: tuple | None = None  # the file as last seen (checked or written); None = absent
        self._foreign = False
        self._checked = False

    def __str__(self) -> str:
        return str(self.given)

    @property
    def name(self) -> str:
        return self.path.name

    def check(self) -> None:
        """Every refusal (no side effects)."""
        path, opt = self.path, self.option
        if path.is_dir():
            raise OutputDirError(f"{opt} {self.given} is a directory; give a file name")
        if path.exists() and not path.is_file():
            raise OutputDirError(f"{opt} {self.given} exists and is not a regular file; choose another path")
        self._foreign = False
        if path.is_file() and path.stat().st_size and not file_written_by_diffspec(path):
            if not self.overwrite:
                raise OutputDirError(
                    f"{opt} {self.given} exists and was not written by a diffspec-jax tool; choose another path, "
                    f"or pass --overwrite to replace it (it is moved to {path.name}.replaced-<time> beside it; "
                    f"nothing is deleted)")
            self._foreign = True
        self._expect = _signature(path)
        self._checked = True

    def write_bytes(self, data: bytes) -> Path:
        """Write ``data`` to the file (temporary sibling, then rename); returns the path."""
        if not self._checked:
            self.check()
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.partial-{os.getpid()}"
        tmp.write_bytes(data)
        try:
            if _signature(path) != self._expect:
                raise OutputDirError(f"{self.option} {self.given} was changed by someone else while this run wrote "
                                     f"it, and is left as it is; this run's output is in {tmp}")
            if self._foreign and path.exists():
                self.replaced = _free_name(path.parent, f"{path.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
                os.rename(path, self.replaced)
                print(f"note: the previous {self.given} was moved to {self.replaced}", file=sys.stderr)
            self._foreign = False
            os.replace(tmp, path)
        except OutputDirError:
            raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._expect = _signature(path)
        return path

    def write_json(self, payload: dict) -> Path:
        """Write ``payload`` as indented JSON, marked as this tool's output (:func:`mark_json`)."""
        return self.write_bytes((json.dumps(mark_json(payload, self.tool), indent=2) + "\n").encode())


def _free_name(parent: Path, name: str) -> Path:
    candidate, n = parent / name, 1
    while candidate.exists():
        candidate, n = parent / f"{name}-{n}", n + 1
    return candidate
