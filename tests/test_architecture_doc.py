"""ARCHITECTURE.md held to the code, where that is cheap: every file it names exists, every ``cbrun.x.y`` name
imports, every other code name it spells (``FIFOScheduler``, ``OutputDir.start``, ``sources.open_source``) is defined
in ``cbrun/``, every module its jobs rooms list is in that room, every link resolves, and its drawing of the layers
is the order ``tests/kernels/test_layering.py`` enforces. (``tests/test_docs_imports.py`` runs the docs' import lines; this checks names, not imports.)"""

from __future__ import annotations

import ast
import builtins
import importlib
import keyword
import re
from functools import cache
from pathlib import Path

import pytest

from tests.kernels.test_layering import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["ARCHITECTURE.md"]
#: Packages outside cbrun a page may name (``torch.library``): not checked.
EXTERNAL = {"torch", "triton", "numpy", "pyarrow", "transformers", "fsspec", "ray", "os", "ast", "ctypes"}
_FENCE = re.compile(r"```.*?\n(.*?)```", re.S)
_INLINE = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_FILE_SUFFIXES = (".py", ".c", ".md", ".toml", ".json", ".jsonl", ".parquet")


class _Index:
    """What ``cbrun/`` defines, read with ``ast``: per module file name (``scheduler``) every name defined anywhere in
    it, per class its members (methods, class attributes, ``self.x`` assignments, its bases' members), and every
    string constant (``"_SUCCESS"``)."""

    def __init__(self, root: Path) -> None:
        self.modules: dict[str, set[str]] = {}
        self.classes: dict[str, set[str]] = {}
        self.bases: dict[str, list[str]] = {}
        self.strings: set[str] = set()
        self.files: set[str] = set()
        for path in sorted((root / "cbrun").rglob("*")):
            self.files.add(path.name)
            if path.is_dir():
                self.modules.setdefault(path.name, set()).update(p.stem for p in path.iterdir())
            elif path.suffix == ".py":
                self._read(path)

    def _read(self, path: Path) -> None:
        tree = ast.parse(path.read_text(), filename=str(path))
        names = self.modules.setdefault(path.stem if path.stem != "__init__" else path.parent.name, set())
        for node in ast.walk(tree):
            names.update(_defined(node))
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                self.strings.add(node.value)
            if isinstance(node, ast.ClassDef):
                members = self.classes.setdefault(node.name, set())
                for inner in ast.walk(node):
                    members.update(_defined(inner))
                self.bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def members(self, owner: str) -> set[str]:
        """The names defined in module ``owner`` or class ``owner`` (with its bases'); empty when neither exists."""
        found = set(self.modules.get(owner, ()))
        for cls in [owner]:
            found |= self.classes.get(cls, set())
            for base in self.bases.get(cls, []):
                found |= self.members(base)
        return found

    def defines(self, name: str) -> bool:
        return name in self.modules or name in self.classes or any(name in m for m in self.modules.values())


def _defined(node: ast.AST) -> set[str]:
    """The names one ``ast`` node defines: a function, a class, an assigned name or ``self.x`` attribute."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # and a kernel's constexprs (``PAGE_SIZE``)
        return {node.name} | {a.arg for a in node.args.args + node.args.kwonlyargs if a.arg.isupper()}
    if isinstance(node, ast.ClassDef):
        return {node.name}
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    found = set()
    for target in targets:
        for leaf in ast.walk(target):
            if isinstance(leaf, ast.Name):
                found.add(leaf.id)
            elif isinstance(leaf, ast.Attribute):
                found.add(leaf.attr)
    return found


@cache
def index() -> _Index:
    return _Index(ROOT)


def problem(token: str, index: _Index) -> str | None:
    """Why the code name or path ``token`` (one backticked span) does not hold against the tree; None when it does
    or when it is not a name (a setting line, a command)."""
    token = token.removesuffix("()")
    if token.endswith("/") and token.count("/") == 1:  # a room: a folder of cbrun/
        return None if token[:-1] in index.files or (ROOT / token).is_dir() else f"no folder {token}"
    if "/" in token:
        return None if list(ROOT.glob(token.rstrip("/"))) else f"no file or folder {token}"
    if token.endswith(_FILE_SUFFIXES):
        if token.endswith((".py", ".c")):
            return None if token in index.files else f"no file named {token} in cbrun/"
        return None if any(token in s for s in index.strings) else f"{token} appears nowhere in cbrun/"
    if not _NAME.fullmatch(token) or keyword.iskeyword(token) or hasattr(builtins, token):
        return None
    if token.startswith("cbrun."):  # a module or what it defines; or a name cbrun uses (an entry-point group)
        return None if token in index.strings else _import_problem(token)
    owner, _, rest = token.partition(".")
    if owner in EXTERNAL:
        return None
    if not rest:
        return None if index.defines(token) or token in index.strings else f"{token} is defined nowhere in cbrun/"
    member = rest.split(".")[0]
    if owner not in index.modules and owner not in index.classes:
        return f"{owner} (in {token}) is no module or class of cbrun/"
    return None if member in index.members(owner) else f"{owner} defines no {member} (in {token})"


def _import_problem(dotted: str) -> str | None:
    """``dotted`` imported as its longest module prefix, the rest read as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(value, name):
                return f"{'.'.join(parts[:cut])} has no {name} (in {dotted})"
            value = getattr(value, name)
        return None
    return f"{dotted} does not import"


def names_of(text: str) -> list[str]:
    """The backticked spans outside code blocks, and the ``Class.member`` names inside them (a row's path)."""
    blocks = _FENCE.findall(text)
    prose = _FENCE.sub("", text).replace("\n", " ")  # a span may wrap onto the next line
    spans = _INLINE.findall(prose)
    spans += [m for block in blocks for m in re.findall(r"\b[A-Z]\w*\.\w+", block)]
    return spans


CASES = [(page, token) for page in PAGES for token in dict.fromkeys(names_of((ROOT / page).read_text()))]


def test_the_scan_finds_the_names():
    tokens = {token for _, token in CASES}
    assert {"FIFOScheduler", "OutputDir.start", "cbrun.jobs.run.resources.MODES"} <= tokens


@pytest.mark.parametrize(("page", "token"), CASES)
def test_a_named_thing_exists(page, token):
    assert problem(token, index()) is None, f"{page}: {problem(token, index())}"


def test_a_renamed_thing_is_caught():
    idx = index()
    for token in (
        "FIFOSchedulr",
        "OutputDir.begin",
        "sources.open_sources",
        "cbrun.jobs.run.resources.MODE",
        "cbrun/engine/cores/",
        "schedulr.py",
        "Nowhere.step",
        "cores/",
    ):
        assert problem(token, idx) is not None, token


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    for target in _LINK.findall((ROOT / page).read_text()):
        if not target.startswith(("http://", "https://", "#")):
            assert (ROOT / page).parent.joinpath(target.split("#")[0]).exists(), target


def test_the_jobs_rooms_hold_the_modules_named():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = text[text.index("`cbrun/jobs/`") :]
    block = _FENCE.search(block).group(1)
    named, room = {}, None
    for line in block.splitlines():
        if not line.startswith(" "):
            room, _, line = line.partition("/")
        for item in re.split(r"[,/;]", re.sub(r"\([^)]*\)", "", line)):
            if item.strip():
                named.setdefault(room, []).append(item.strip())
    assert len(named) >= 10 and "output_dir" in named["output"]
    for room, modules in named.items():
        for module in modules:
            path = ROOT / "cbrun/jobs" / room / module
            assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), f"cbrun/jobs/{room}/{module}"


def test_the_drawn_layers_are_the_enforced_ones():
    drawing = _FENCE.findall((ROOT / "ARCHITECTURE.md").read_text())[0]
    drawn = [line.split()[0].rstrip("/").replace("/", ".") for line in drawing.splitlines() if line.strip()]
    assert drawn[::-1] == list(LAYERS)
