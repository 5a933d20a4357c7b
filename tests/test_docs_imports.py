"""Every import a page of the docs shows a user runs: the README's and docs/*.md's Python blocks and inline
``import ...`` spans name modules that exist under the one import name ``cbrun`` (a snippet still naming the old
top-level ``engine`` / ``jobs`` packages fails here, not in a new user's shell)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_IMPORT_LINE = re.compile(r"^\s*(from [\w.]+ import [\w, ()]+|import [\w.]+(?: as \w+)?)\s*$")
_INLINE = re.compile(r"`(import [\w.]+|from [\w.]+ import [\w, ]+)`")


def _imports(page: Path) -> list[str]:
    """The import statements ``page`` shows: each line of a Python block that is one, and inline code spans."""
    text = page.read_text()
    lines = [line.strip() for block in _BLOCK.findall(text) for line in block.splitlines()]
    return [line for line in lines if _IMPORT_LINE.match(line)] + _INLINE.findall(text)


CASES = [(page.relative_to(ROOT).as_posix(), statement) for page in PAGES for statement in _imports(page)]


def test_the_docs_show_cbrun_imports():
    assert any("cbrun.engine" in statement for _, statement in CASES)  # the scan finds the snippets at all


@pytest.mark.parametrize(("page", "statement"), CASES)
def test_a_documented_import_runs(page, statement):
    exec(statement, {})  # noqa: S102 - the statement is one import line from our own docs
