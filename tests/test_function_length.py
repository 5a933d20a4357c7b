"""Small functions, held by a tool: functions (and methods) of more than ``MAX_LINES`` lines in cbrun/, counted with
``ast`` (first line of the ``def`` to its last line, docstring included), at most ``LIMIT``.

The long functions of rooms that were being reworked while this rule came in are named in ``BACKLOG``; the list
only shrinks: a function on it that is short now must leave it, and one not on it must be short.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "cbrun"
MAX_LINES = 50
LIMIT = 8

#: "file:function" of the long functions in the engine's and the kernels' rooms, split by concept when those rooms
#: are reworked (issue 41); by file name, so that a file moved to another room keeps its entry. Never add to it.
BACKLOG: frozenset[str] = frozenset()


def long_functions(root: Path = ROOT, max_lines: int = MAX_LINES) -> dict[str, int]:
    """{"file name:function": its length in lines} of every function under ``root`` longer than ``max_lines``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > max_lines:
                    found[f"{path.name}:{node.name}"] = length
    return found


def test_no_new_function_is_long():
    new = {name: length for name, length in long_functions().items() if name not in BACKLOG}
    assert not new, f"functions over {MAX_LINES} lines (split them by concept): {new}"


def test_the_backlog_only_shrinks():
    found = long_functions()
    gone = sorted(name for name in BACKLOG if name not in found)
    assert not gone, f"no longer over {MAX_LINES} lines: take them out of BACKLOG: {gone}"


def test_at_most_limit_long_functions_besides_the_backlog():
    assert len(set(long_functions()) - BACKLOG) <= LIMIT
    assert len(long_functions()) <= LIMIT + len(BACKLOG)


def test_the_count_sees_a_long_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass A:\n    def long(self):\n{body}\n")
    assert long_functions(tmp_path) == {"m.py:long": MAX_LINES + 1}
