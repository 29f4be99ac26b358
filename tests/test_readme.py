"""The README's Python example runs as written, on the embedded demo pair."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def code_blocks(doc: Path, language: str) -> list[str]:
    """The fenced code blocks of ``doc`` in ``language`` (```` ```python ```` ... ```` ``` ````), in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", doc.read_text(encoding="utf-8"), flags=re.M | re.S)


def test_code_blocks_are_found():
    assert code_blocks(ROOT / "docs" / "api.md", "bash") and not code_blocks(ROOT / "README.md", "rust")


def test_readme_python_blocks_run_verbatim():
    """Each python block of the README runs unchanged (in one namespace, in order): the demo pair's directories,
    its tokenizer, generate(..., tokenizer=) filling result.texts."""
    blocks = code_blocks(ROOT / "README.md", "python")
    assert blocks and "demo.target_dir()" in blocks[0]
    namespace: dict = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, block in enumerate(blocks):
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    result, tokenizer = namespace["result"], namespace["tokenizer"]
    assert 0 < len(result.tokens[0]) <= 16 and result.stats.mean_acceptance_length >= 1
    assert result.texts[0] == tokenizer.decode(result.tokens[0], skip_special_tokens=True) and result.texts[0]
    assert out.getvalue().startswith(result.texts[0] + "\n")
