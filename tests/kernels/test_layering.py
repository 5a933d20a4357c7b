"""The layers import downwards only: kernels/ imports nothing from engine/, jobs/ or benchmarks/, and the runtime
packages import nothing from benchmarks/ (``cbrun bench`` imports it inside the CLI function that runs it)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def imported_packages(path: Path, top_level_only: bool = False) -> set[str]:
    """First components of every module ``path`` imports (relative imports excluded: they stay in the package).

    Args:
        top_level_only: only imports at module level (not inside functions), i.e. what importing the module runs.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_kernels_import_nothing_above_them():
    files = sorted((REPO / "kernels").glob("*.py"))
    assert files
    offending = {f.name: sorted(imported_packages(f) & {"engine", "jobs", "benchmarks"}) for f in files}
    assert {name: bad for name, bad in offending.items() if bad} == {}


def test_runtime_packages_do_not_import_benchmarks_at_module_level():
    files = [f for package in ("engine", "jobs", "kernels") for f in sorted((REPO / package).glob("*.py"))]
    assert [f.name for f in files if "benchmarks" in imported_packages(f, top_level_only=True)] == []


def test_the_scan_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import torch\n\ndef f():\n    from engine.request import Request\n    import jobs.job\n")
    assert imported_packages(module) == {"torch", "engine", "jobs"}
    assert imported_packages(module, top_level_only=True) == {"torch"}
