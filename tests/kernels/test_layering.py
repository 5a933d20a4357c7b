"""The module import graph of cbrun/kernels/, cbrun/engine/, cbrun/jobs/, cbrun/bench/ and benchmarks/, built with
``ast``: no cycles and no import of a higher layer (benchmarks -> bench -> jobs -> engine -> kernels), counting imports
inside functions, which a cycle or a layer breach would otherwise hide behind."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Lowest first: a module may import its own layer's modules and the layers before it.
LAYERS = ("cbrun.kernels", "cbrun.engine", "cbrun.jobs", "cbrun.bench", "benchmarks")


def find_modules(root: Path, packages=LAYERS) -> dict[str, Path]:
    """{dotted module name: file} of every module of ``packages`` under ``root`` (a package is its __init__)."""
    found = {}
    for package in packages:
        for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere in its file (module level or inside functions).

    ``from a.b import c`` counts ``a.b.c`` when that is a module, else ``a.b``; an import of a name no module of
    ``modules`` has (a third-party package) is skipped; relative imports are resolved.
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: None if path.name == "__init__.py" else -1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module itself
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = REPO, packages=LAYERS) -> dict[str, set[str]]:
    modules = find_modules(root, packages)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan 1972), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_rank(module: str, layers=LAYERS) -> int:
    """The index in ``layers`` of the layer holding ``module`` (its longest dotted prefix among them)."""
    return max(i for i, layer in enumerate(layers) if module == layer or module.startswith(layer + "."))


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return sorted(
        f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_rank(b, layers) > layer_rank(a, layers)
    )


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 100 and "cbrun.jobs.cli" in graph and "cbrun.bench.cli" in graph
    assert cycles(graph) == []


def test_no_layer_imports_a_higher_one():
    # cbrun.kernels imports nothing above it; no runtime package imports cbrun.bench or benchmarks/ (``cbrun bench`` is
    # registered as an entry point, see cbrun.jobs.cli.commands.COMMAND_ENTRY_POINTS)
    assert upward_imports(import_graph()) == []


def test_the_graph_sees_cycles_and_breaches_inside_functions(tmp_path):
    (tmp_path / "pkg" / "engine").mkdir(parents=True)
    (tmp_path / "pkg" / "jobs").mkdir()
    (tmp_path / "pkg" / "engine" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "engine" / "a.py").write_text("import torch\n\ndef f():\n    from pkg.engine.b import g\n")
    (tmp_path / "pkg" / "engine" / "b.py").write_text("from . import a\n\ndef g():\n    import pkg.jobs.c\n")
    (tmp_path / "pkg" / "jobs" / "c.py").write_text("from pkg.engine.a import f\n")
    layers = ("pkg.engine", "pkg.jobs")
    graph = import_graph(tmp_path, layers)
    assert graph == {
        "pkg.engine": set(),
        "pkg.engine.a": {"pkg.engine.b"},
        "pkg.engine.b": {"pkg.engine.a", "pkg.jobs.c"},
        "pkg.jobs.c": {"pkg.engine.a"},
    }
    assert cycles(graph) == [["pkg.engine.a", "pkg.engine.b", "pkg.jobs.c"]]
    assert upward_imports(graph, layers) == ["pkg.engine.b -> pkg.jobs.c"]
