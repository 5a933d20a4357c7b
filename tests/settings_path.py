"""The path of a job's settings through cbrun, followed statically with ``ast`` (issue 41's measure).

Start at ``cbrun.jobs.run.job.run_job`` with its ``manifest`` parameter. In each function reached, walk its calls in
source order; a call is followed when one of its arguments is a settings value (``mentions``: the manifest, one of its
sections, a resolved job, an engine config, held by a parameter that received one, a local assigned one, or ``self``
of an object constructed with one; a scalar read from them, such as a path, is not followed), and its callee resolves inside cbrun: a function imported by name (``from M import f``, also inside a
function), a module attribute (``M.f`` of an imported module), a class (its ``__init__``), ``self.method`` of the
current class, or ``var.method`` of a local built from a followed class. Each function is entered once.

The trace is the sequence of modules entered, in call order. ``modules``: how many distinct modules it visits;
``returns``: how many times the settings come back to a module they had left: a function entered in a module
visited before, none of whose calls is still in progress (a module calling its own helper between calls out has
not been left; one entered again after its calls all returned has).

Run: ``PYTHONPATH=. python -m tests.settings_path`` prints the trace and both counts.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(os.environ.get("CBRUN_TREE") or Path(__file__).resolve().parents[1])


@dataclass
class Module:
    name: str
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> "module" or "module:attr"
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)  # "f" or "Class.f"
    classes: set[str] = field(default_factory=set)


_modules: dict[str, Module | None] = {}


def load(name: str) -> Module | None:
    """The parsed module ``name`` (``cbrun....``); None outside cbrun or when it is a package without code."""
    if name in _modules:
        return _modules[name]
    path = ROOT / (name.replace(".", "/") + ".py")
    if not path.is_file():
        path = ROOT / name.replace(".", "/") / "__init__.py"
    module = None
    if name.startswith("cbrun.") and path.is_file():
        tree = ast.parse(path.read_text())
        module = Module(name, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    is_module = (ROOT / (target.replace(".", "/") + ".py")).is_file() or (
                        ROOT / target.replace(".", "/")
                    ).is_dir()
                    module.imports[alias.asname or alias.name] = target if is_module else f"{node.module}:{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        module.imports[alias.asname] = alias.name
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                module.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                module.classes.add(node.name)
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        module.functions[f"{node.name}.{item.name}"] = item
    _modules[name] = module
    return module


def resolve_attr(module: Module, ref: str) -> tuple[Module, str] | None:
    """``"m:attr"`` (or a re-export through a package ``__init__``) as (module, function or class name)."""
    mod_name, _, attr = ref.partition(":")
    target = load(mod_name)
    for _ in range(3):  # follow re-exports
        if target is None:
            return None
        if attr in target.functions or attr in target.classes:
            return target, attr
        ref = target.imports.get(attr) or _lazy_export(target, attr)
        if ref is None or ":" not in ref:
            return None
        mod_name, _, attr = ref.partition(":")
        target = load(mod_name)
    return None


#: Attributes that hold settings: the manifest's sections, the manifest or resolved job an object keeps, the engine's
#: settings (``ResolvedJob.engine``).
SETTINGS_ATTRS = frozenset(
    {"model", "input", "sampling", "engine", "output", "cluster", "storage", "manifest", "job", "engine_config"}
)


#: Return types of functions whose result holds settings.
SETTINGS_TYPES = frozenset({"JobManifest", "ResolvedJob", "EngineConfig", "SamplingParams"})


def _lazy_export(module: Module, attr: str) -> str | None:
    """A package's lazy export (``{"LLMEngine": "cbrun.engine.llm_engine"}`` read by its ``__getattr__``)."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == attr and isinstance(value, ast.Constant):
                    if str(value.value).startswith("cbrun."):
                        return f"{value.value}:{attr}"
    return None


def mentions(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` is a settings value: a name holding settings, a settings attribute of one (``manifest.input``,
    ``self.job``), or ``replace(settings, ...)``; a scalar read from settings (a path, a count) is not."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute):
        return node.attr in SETTINGS_ATTRS and mentions(node.value, names)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "replace" and node.args:
        return mentions(node.args[0], names)
    return False


class Tracer:
    def __init__(self) -> None:
        self.trace: list[str] = []
        self.entered: set[tuple[str, str]] = set()
        self.stack: list[str] = []  # the modules of the calls in progress
        self.returns: list[str] = []  # modules entered again after every call into them had returned

    def enter(self, module: Module, qualname: str, carrying: set[str]) -> None:
        key = (module.name, qualname)
        if key in self.entered:
            return
        self.entered.add(key)
        if module.name in self.trace and module.name not in self.stack:
            self.returns.append(module.name)
        self.trace.append(module.name)
        self.stack.append(module.name)
        try:
            self._follow(module, qualname, carrying)
        finally:
            self.stack.pop()

    def _follow(self, module: Module, qualname: str, carrying: set[str]) -> None:
        func = module.functions[qualname]
        cls = qualname.split(".")[0] if "." in qualname else None
        names = set(carrying)
        objects: dict[str, tuple[Module, str]] = {}  # local -> (module, class) of an object built from settings
        if cls is not None:
            objects["self"] = (module, cls)
        for arg in func.args.args + func.args.kwonlyargs:  # a parameter annotated with a cbrun class
            if arg.arg in names and arg.annotation is not None:
                annotated = self._class_named(module, ast.unparse(arg.annotation).split(" | ")[0])
                if annotated is not None:
                    objects[arg.arg] = annotated
        for stmt in ast.walk(func):
            if not isinstance(stmt, ast.Assign):
                continue
            pairs = [
                (t, v)
                for target in stmt.targets
                if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple)
                for t, v in zip(target.elts, stmt.value.elts)
            ]
            for t, v in pairs:  # ``a, b = x.engine, x.tokenizer``
                if isinstance(t, ast.Name) and mentions(v, names):
                    names.add(t.id)
            built = self._settings_object(module, stmt.value, names)
            if built is None and not mentions(stmt.value, names):
                continue
            for target in stmt.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
                        if built is not None:
                            objects[n.id] = built
        calls = sorted((n for n in ast.walk(func) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
        for call in calls:
            args = [*call.args, *(k.value for k in call.keywords)]
            if not any(mentions(a, names) for a in args) and not self._self_call(call, names):
                continue
            target = self.callee(module, cls, call.func, objects)
            if target is None:
                continue
            callee_module, callee_name = target
            callee = callee_module.functions[callee_name]
            params = [a.arg for a in callee.args.args]
            bound = {"self"} if params and params[0] == "self" and self._self_call(call, names) else set()
            offset = 1 if params and params[0] in ("self", "cls") else 0
            for i, arg in enumerate(call.args):
                if mentions(arg, names) and i + offset < len(params):
                    bound.add(params[i + offset])
            for kw in call.keywords:
                if kw.arg and mentions(kw.value, names):
                    bound.add(kw.arg)
            if callee_name.endswith(".__init__") or callee_name.split(".")[0] in callee_module.classes:
                bound.add("self")
            self.enter(callee_module, callee_name, bound)

    def _settings_object(self, module: Module, value: ast.expr, names: set[str]) -> tuple[Module, str] | None:
        """(module, class) of an object built from settings: a cbrun class constructed with a settings argument,
        or what a function annotated to return a settings type returns (``resolve_job -> ResolvedJob``)."""
        if not isinstance(value, ast.Call):
            return None
        if not any(mentions(a, names) for a in [*value.args, *(k.value for k in value.keywords)]):
            return None
        funcs = [value.func.body, value.func.orelse] if isinstance(value.func, ast.IfExp) else [value.func]
        for func in funcs:
            found = self.callee(module, None, func, {})
            if found is None:
                continue
            target_module, name = found
            if name.endswith(".__init__"):
                return target_module, name.split(".")[0]
            returns = target_module.functions[name].returns
            if returns is not None and ast.unparse(returns) in SETTINGS_TYPES:
                ref = target_module.imports.get(ast.unparse(returns))
                if ast.unparse(returns) in target_module.classes:
                    return target_module, ast.unparse(returns)
                if ref and ":" in ref and (found := resolve_attr(target_module, ref)) is not None:
                    return found
        return None

    @staticmethod
    def _self_call(call: ast.Call, names: set[str]) -> bool:
        func = call.func
        return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names

    def callee(self, module: Module, cls: str | None, func: ast.expr, objects: dict[str, tuple[Module, str]]):
        if isinstance(func, ast.Name):
            if func.id in module.functions:
                return module, func.id
            if func.id in module.classes:
                return self._init(module, func.id)
            ref = module.imports.get(func.id)
            if ref and ":" in ref:
                found = resolve_attr(module, ref)
                if found is None:
                    return None
                target_module, name = found
                return self._init(target_module, name) if name in target_module.classes else found
            return None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner == "self" and cls is not None:
                return self._method(module, cls, func.attr)
            if owner in objects:
                target_module, class_name = objects[owner]
                return self._method(target_module, class_name, func.attr)
            ref = module.imports.get(owner)
            if ref and ":" not in ref:
                target = load(ref)
                if target is not None and func.attr in target.functions:
                    return target, func.attr
            owner_class = self._class_named(module, owner)
            if owner_class is not None:  # a class's own constructor (``LLMEngine.from_pretrained``)
                return self._method(*owner_class, func.attr)
        return None

    @staticmethod
    def _class_named(module: Module, name: str) -> tuple[Module, str] | None:
        """(module, class) that ``name`` names in ``module`` (its own class, or one imported, also inside a
        function); None otherwise."""
        if name in module.classes:
            return module, name
        ref = module.imports.get(name)
        if ref and ":" in ref and (found := resolve_attr(module, ref)) is not None and found[1] in found[0].classes:
            return found
        return None

    @staticmethod
    def _init(module: Module, cls: str):
        return (module, f"{cls}.__init__") if f"{cls}.__init__" in module.functions else None

    @staticmethod
    def _method(module: Module, cls: str, name: str):
        """``cls.name`` in ``module``, or in a base class defined in ``module``."""
        if f"{cls}.{name}" in module.functions:
            return module, f"{cls}.{name}"
        for node in module.tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for base in node.bases:
                    if isinstance(base, ast.Name) and f"{base.id}.{name}" in module.functions:
                        return module, f"{base.id}.{name}"
        return None


def settings_path(start: str = "cbrun.jobs.run.job", function: str = "run_job") -> tuple[list[str], int, int]:
    """(the trace of modules entered, distinct modules, returns to a module left before)."""
    _modules.clear()
    tracer = Tracer()
    module = load(start)
    assert module is not None and function in module.functions
    tracer.enter(module, function, {"manifest"})
    return tracer.trace, len(set(tracer.trace)), len(tracer.returns)


if __name__ == "__main__":
    trace, modules, returns = settings_path()
    for step in trace:
        print(step)
    print(f"modules {modules}, returns {returns}", file=sys.stderr)
