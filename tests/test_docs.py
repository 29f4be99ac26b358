"""The documentation: a short README, no citation of the old method document, and no dangling repository paths.

Fast and without JAX: it only reads files.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIXES = ("diffspec_jax/", "benchmarks/", "pallas_kernels/", "checkpoints_tools/", "tests/", "docs/")
SKIP_DIRS = {".venv", ".git", ".snap", "shared", "node_modules", "__pycache__", ".pytest_cache", "build"}
OLD_NAME = "DIFFSPEC" + ".md"  # split so this file does not mention it either


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def repo_files(suffixes=(".py", ".md")) -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.suffix in suffixes and path.is_file():
            out.append(path)
    return out


def expand_braces(text: str) -> list[str]:
    """``a/{b,c}.json`` -> ``["a/b.json", "a/c.json"]`` (several groups multiply)."""
    parts = re.split(r"\{([^{}]*)\}", text)
    literals, groups = parts[0::2], [g.split(",") for g in parts[1::2]]
    out = []
    for choice in itertools.product(*groups):
        out.append("".join(lit + (choice[i] if i < len(choice) else "") for i, lit in enumerate(literals)))
    return out


def cited_paths(doc: Path) -> list[tuple[str, Path]]:
    """Repository paths cited in backticks or as markdown link targets, resolved against the repository root."""
    text = doc.read_text(encoding="utf-8")
    found: list[tuple[str, Path]] = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for token in span.split():
            token = token.strip("()[],;:'\"")
            if token.startswith(PREFIXES):
                found.extend((token, ROOT / p) for p in expand_braces(token))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith(("#", "mailto:")):
            continue
        target = target.split("#", 1)[0]
        if not target:
            continue
        resolved = (doc.parent / target).resolve()
        rel = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else target
        if rel.startswith(PREFIXES) or doc.parent != ROOT:
            found.append((target, resolved))
    return found


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; move detail into docs/"


def test_docs_folder_exists():
    assert (ROOT / "docs" / "method.md").is_file()
    assert len(doc_files()) > 2


def test_no_file_cites_the_old_method_document():
    offenders = [str(p.relative_to(ROOT)) for p in repo_files() if OLD_NAME in p.read_text(encoding="utf-8",
                                                                                             errors="replace")]
    assert not offenders, f"{OLD_NAME} is cited in {offenders}; cite docs/method.md sections instead"


def test_cited_paths_exist():
    missing = []
    for doc in doc_files():
        for written, path in cited_paths(doc):
            if not path.exists():
                missing.append(f"{doc.relative_to(ROOT)}: {written}")
    assert not missing, "paths cited in the docs that do not exist:\n" + "\n".join(missing)


def test_method_sections_cited_in_code_exist():
    """Every ``docs/method.md section N`` (or ``sections N, M and K``) cited anywhere names a heading of method.md."""
    method = (ROOT / "docs" / "method.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", method, flags=re.M))
    cited = set()
    for path in repo_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"docs/method\.md\)?`?,? sections? ([\d. ,toand]+)", text):
            cited.update(re.findall(r"\d+(?:\.\d+)?", m.group(1)))
    cited = {c.rstrip(".") for c in cited}
    assert cited, "no citation of docs/method.md found"
    assert cited <= headings, f"cited sections without a heading: {sorted(cited - headings)}"


def test_readme_lists_every_diffspec_command():
    from diffspec_jax.cli import COMMANDS  # no JAX import

    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    listing = re.search(r"`diffspec --help` lists ([^)]*)\)", text)
    assert listing, "the README's list of diffspec commands is gone"
    assert set(re.findall(r"`([\w-]+)`", listing.group(1))) == set(COMMANDS)
