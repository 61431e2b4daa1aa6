"""Every use that Python sources make of the kvikio package, checked against the installed one.

    python tests/snapshot/kvikio_uses.py agent        # JSON on stdout; exit 0

Run it in a fresh interpreter (tests/snapshot/test_kvikio_api.py does): what resolves depends on
what has been imported.  It first performs every kvikio import the sources contain (``import
kvikio``, ``import kvikio.defaults``, ``from kvikio... import ...``, wherever they are), as the
import system does, and nothing else; then it follows, statement by statement through each
function, the values that come from the package:

* the package itself: ``import kvikio``, a parameter, variable or attribute named ``kvikio``
  (``buffer.kvikio``), a call of ``load_kvikio()``;
* attribute chains on it (``kvikio.defaults.is_compat_mode_preferred``), each resolved with
  ``getattr`` on the real package: a name that exists only as a submodule nobody imported is
  reported as such (``import kvikio`` does not make ``kvikio.defaults`` an attribute);
* what calls return: an instance of the class called (``kvikio.CuFile(...)``), or of the
  class a function's or method's return annotation names (``CuFile.pread -> IOFuture``), so
  ``f.pread(...).get()`` is checked on ``IOFuture``; ``with X as f`` takes ``__enter__``'s;
* containers of them (dict/list comprehensions and literals, ``.append``), their items
  (subscripts, ``for``, ``.values()``), and module-level helper functions of the same file
  called with them (their parameters bound to what was passed).

Each call is bound to the real signature (``inspect.signature(...).bind``): a keyword the real
function lacks, or too many positional arguments, is a problem.  ``kvikio.defaults.set`` and
``get`` with literal keys are called for real here (throwaway process): an unknown key, a dict
holding a key kvikio refuses in a dict, or a literal value it refuses is a problem.
``if hasattr(x, "name"):`` guards a version difference: the branch the installed kvikio does
not take is followed as a fallback (reported, not failed), and a guard naming what the
installed kvikio lacks leaves its own branch dead (a problem).

Output: ``{"version", "imports", "uses": [[file, line, use]], "problems": [...],
"fallbacks": [...]}``, each problem ``[file, line, text]``.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import inspect
import json
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Obj:
    """A real object reached from the package: module, class, function, constant."""
    value: Any
    path: str


@dataclass(frozen=True)
class Inst:
    """An instance of ``cls`` (a kvikio class, or a builtin a kvikio call is annotated with)."""
    cls: type
    path: str


@dataclass(frozen=True)
class Method:
    inst: Inst
    func: Any
    path: str


@dataclass(frozen=True)
class Many:
    """A container whose items are ``item``."""
    item: Any


Value = Obj | Inst | Method | Many | None


def perform_imports(trees: dict[str, ast.Module]) -> tuple[list[str], list[list]]:
    """Execute every kvikio import statement found in the sources, as written."""
    done, problems = [], []
    for file, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "kvikio" or alias.name.startswith("kvikio."):
                        text = f"import {alias.name}"
                        try:
                            __import__(alias.name)
                        except ImportError as exc:
                            problems.append([file, node.lineno, f"{text}: {exc}"])
                        done.append(text)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == "kvikio" or node.module.startswith("kvikio.")):
                names = [a.name for a in node.names]
                text = f"from {node.module} import {', '.join(names)}"
                try:
                    __import__(node.module, fromlist=names)
                except ImportError as exc:
                    problems.append([file, node.lineno, f"{text}: {exc}"])
                done.append(text)
    return sorted(set(done)), problems


def _annotation_class(func: Any) -> type | None:
    """The class a callable's return annotation names (None for Union of several, Any...)."""
    try:
        ann = typing.get_type_hints(func).get("return")
    except Exception:  # noqa: BLE001 - Cython functions: string annotations, no __globals__
        ann = getattr(func, "__annotations__", {}).get("return")
        if isinstance(ann, str):
            module = sys.modules.get(getattr(func, "__module__", "") or "")
            scope = {**vars(builtins), **(vars(module) if module else {})}
            try:
                ann = eval(ann, scope)
            except Exception:  # noqa: BLE001 - an annotation we cannot evaluate
                return None
    if isinstance(ann, type):
        return ann
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    return args[0] if len(args) == 1 and isinstance(args[0], type) else None


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


class FileChecker:
    """Walks one file; appends to the shared ``uses``, ``problems`` and ``fallbacks``."""

    def __init__(self, file: str, tree: ast.Module, package: types.ModuleType, out: dict) -> None:
        self.file, self.tree, self.package, self.out = file, tree, package, out
        self.functions = {n.name: n for n in tree.body
                          if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        self.fallback = False
        self.walked: set[tuple] = set()

    # --- reporting -----------------------------------------------------------------------------
    def use(self, node: ast.AST, text: str) -> None:
        self.out["fallbacks" if self.fallback else "uses"].append(
            [self.file, getattr(node, "lineno", 0), text])

    def problem(self, node: ast.AST, text: str) -> None:
        self.out["fallbacks" if self.fallback else "problems"].append(
            [self.file, getattr(node, "lineno", 0), text])

    # --- statements ----------------------------------------------------------------------------
    def run(self) -> None:
        self.block(self.tree.body, {})

    def block(self, body: list[ast.stmt], env: dict) -> None:
        was = self.fallback
        for stmt in body:
            if isinstance(stmt, ast.If):
                # a guard whose taken branch ends in return/raise: the rest is the other branch
                self.fallback = self.branch(stmt, env) or self.fallback
            else:
                self.stmt(stmt, env)
        self.fallback = was

    def function(self, node: ast.FunctionDef | ast.AsyncFunctionDef, env: dict,
                 bound: dict | None = None) -> None:
        inner = dict(env)
        args = node.args
        for a in args.posonlyargs + args.args + args.kwonlyargs + [x for x in (args.vararg, args.kwarg) if x]:
            inner[a.arg] = Obj(self.package, "kvikio") if a.arg == "kvikio" else None
        inner.update(bound or {})
        self.block(node.body, inner)

    def stmt(self, node: ast.stmt, env: dict) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for d in node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults if d]:
                self.expr(d, env)
            self.function(node, env)
            env[node.name] = None
        elif isinstance(node, ast.ClassDef):
            self.block(node.body, dict(env))
            env[node.name] = None
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top == "kvikio":
                    env[alias.asname or "kvikio"] = (self.chain(node, alias.name) if alias.asname
                                                     else Obj(self.package, "kvikio"))
                else:
                    env[alias.asname or top] = None
        elif isinstance(node, ast.ImportFrom):
            kvikio = node.level == 0 and node.module and node.module.split(".")[0] == "kvikio"
            for alias in node.names:
                env[alias.asname or alias.name] = (self.chain(node, f"{node.module}.{alias.name}")
                                                   if kvikio else None)
        elif isinstance(node, ast.Assign):
            value = self.expr(node.value, env)
            for target in node.targets:
                self.bind(target, value, env)
                if isinstance(target, ast.Name):
                    env[f"#dict:{target.id}"] = self.dict_of(node.value, env)
        elif isinstance(node, ast.AnnAssign):
            self.bind(node.target, self.expr(node.value, env) if node.value else None, env)
        elif isinstance(node, ast.AugAssign):
            self.expr(node.value, env)
            self.bind(node.target, None, env)
        elif isinstance(node, ast.For | ast.AsyncFor):
            it = self.expr(node.iter, env)
            self.bind(node.target, it.item if isinstance(it, Many) else None, env)
            self.block(node.body, env)
            self.block(node.orelse, env)
        elif isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                value = self.expr(item.context_expr, env)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, self.enter(item.context_expr, value), env)
            self.block(node.body, env)
        elif isinstance(node, ast.If):
            self.branch(node, env)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child, env)
                elif isinstance(child, ast.stmt):
                    self.stmt(child, env)
                elif isinstance(child, ast.excepthandler):
                    if child.type is not None:
                        self.expr(child.type, env)
                    if child.name:
                        env[child.name] = None
                    self.block(child.body, env)
                elif isinstance(child, ast.match_case):
                    self.block(child.body, env)

    def branch(self, node: ast.If, env: dict) -> bool:
        """``if [not] hasattr(x, "name")`` on a kvikio value: the branch the installed kvikio
        does not take is a fallback for another version.  True when the statements after
        this one are that branch (the taken one ends in return or raise, no else)."""
        test, negated = node.test, False
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, negated = test.operand, True
        taken = None
        if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "hasattr"
                and len(test.args) == 2 and isinstance(test.args[1], ast.Constant)
                and isinstance(test.args[1].value, str)):
            target = self.expr(test.args[0], env)
            if isinstance(target, Obj | Inst):
                real = target.value if isinstance(target, Obj) else target.cls
                present = hasattr(real, test.args[1].value)
                if not present:
                    self.problem(node, f"hasattr({target.path}, {test.args[1].value!r}) is False in "
                                       f"kvikio {self.package.__version__}: the code for when it is "
                                       "there never runs")
                taken = present != negated
        else:
            self.expr(node.test, env)
        for body, live in ((node.body, taken is not False), (node.orelse, taken is not True)):
            was = self.fallback
            self.fallback = was or not live
            self.block(body, env)
            self.fallback = was
        ends = bool(node.body) and isinstance(node.body[-1], ast.Return | ast.Raise)
        return taken is True and ends and not node.orelse

    def bind(self, target: ast.expr, value: Value, env: dict) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, ast.Tuple | ast.List):
            for elt in target.elts:
                self.bind(elt.value if isinstance(elt, ast.Starred) else elt, None, env)
        elif isinstance(target, ast.Subscript):
            self.expr(target.slice, env)
            if isinstance(target.value, ast.Name) and value is not None:
                env[target.value.id] = Many(value)     # handles[name] = kvikio.CuFile(...)
            else:
                self.expr(target.value, env)
        elif isinstance(target, ast.Attribute):
            self.expr(target.value, env)

    # --- expressions ---------------------------------------------------------------------------
    def expr(self, node: ast.expr | None, env: dict) -> Value:
        if node is None:
            return None
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            return Obj(self.package, "kvikio") if node.id == "kvikio" else None
        if isinstance(node, ast.Attribute):
            base = self.expr(node.value, env)
            if base is None and node.attr == "kvikio":
                return Obj(self.package, "kvikio")
            return self.attr(base, node.attr, node)
        if isinstance(node, ast.Call):
            return self.call(node, env)
        if isinstance(node, ast.Subscript):
            base = self.expr(node.value, env)
            self.expr(node.slice, env)
            if isinstance(base, Many):
                return base if isinstance(node.slice, ast.Slice) else base.item
            return None
        if isinstance(node, ast.IfExp):
            self.expr(node.test, env)
            a, b = self.expr(node.body, env), self.expr(node.orelse, env)
            return a if a is not None else b
        if isinstance(node, ast.BoolOp):
            values = [self.expr(v, env) for v in node.values]
            return next((v for v in values if v is not None), None)
        if isinstance(node, ast.NamedExpr):
            value = self.expr(node.value, env)
            self.bind(node.target, value, env)
            return value
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            inner = dict(env)
            for gen in node.generators:
                it = self.expr(gen.iter, inner)
                self.bind(gen.target, it.item if isinstance(it, Many) else None, inner)
                for cond in gen.ifs:
                    self.expr(cond, inner)
            if isinstance(node, ast.DictComp):
                self.expr(node.key, inner)
                item = self.expr(node.value, inner)
            else:
                item = self.expr(node.elt, inner)
            return Many(item) if item is not None else None
        if isinstance(node, ast.List | ast.Tuple | ast.Set | ast.Dict):
            parts = node.values if isinstance(node, ast.Dict) else node.elts
            if isinstance(node, ast.Dict):
                for k in node.keys:
                    self.expr(k, env)
            values = [self.expr(v, env) for v in parts]
            item = next((v for v in values if v is not None), None)
            return Many(item) if item is not None else None
        if isinstance(node, ast.Lambda):
            inner = dict(env)
            for a in node.args.args:
                inner[a.arg] = None
            self.expr(node.body, inner)
            return None
        if isinstance(node, ast.Await | ast.Starred):
            return self.expr(node.value, env)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.expr(child, env)
        return None

    def chain(self, node: ast.AST, dotted: str) -> Value:
        """``a.b.c`` from the package, attribute by attribute (``from kvikio.x import y``)."""
        value: Value = Obj(self.package, "kvikio")
        for name in dotted.split(".")[1:]:
            value = self.attr(value, name, node)
        return value

    def attr(self, base: Value, name: str, node: ast.AST) -> Value:
        if isinstance(base, Obj):
            real = base.value
            path = f"{base.path}.{name}"
            if not hasattr(real, name):
                why = ""
                if isinstance(real, types.ModuleType) and getattr(real, "__path__", None) is not None \
                        and importlib.util.find_spec(f"{real.__name__}.{name}") is not None:
                    why = (f": {real.__name__}.{name} is a submodule that is never imported here "
                           f"(`import {real.__name__}` does not import it)")
                self.problem(node, f"{path}: no such attribute in kvikio "
                                   f"{self.package.__version__}{why}")
                return None
            self.use(node, path)
            return Obj(getattr(real, name), path)
        if isinstance(base, Inst):
            path = f"{base.path}.{name}"
            try:
                static = inspect.getattr_static(base.cls, name)
            except AttributeError:
                self.problem(node, f"{path}: {base.cls.__module__}.{base.cls.__qualname__} has no "
                                   f"attribute {name!r}")
                return None
            self.use(node, path)
            if isinstance(static, property):
                cls = _annotation_class(static.fget)
                return Inst(cls, path) if cls else None
            if callable(static):
                return Method(base, getattr(base.cls, name), path)
            return None
        return None

    def enter(self, node: ast.AST, value: Value) -> Value:
        if isinstance(value, Inst):
            method = self.attr(value, "__enter__", node)
            if isinstance(method, Method):
                cls = _annotation_class(method.func)
                return Inst(cls, f"{value.path}.__enter__()") if cls else None
        return None

    def call(self, node: ast.Call, env: dict) -> Value:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        args = [self.expr(a, env) for a in node.args]
        for kw in node.keywords:
            self.expr(kw.value, env)
        if name == "load_kvikio":
            self.expr(func, env)
            return Obj(self.package, "kvikio")
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
                func.attr in ("append", "add", "extend", "values", "get") and \
                isinstance(env.get(func.value.id), Many | type(None)):
            held = env.get(func.value.id)
            if func.attr in ("append", "add") and args and args[0] is not None:
                env[func.value.id] = Many(args[0])
            elif func.attr == "extend" and args and isinstance(args[0], Many):
                env[func.value.id] = args[0]
            elif func.attr == "values" and isinstance(held, Many):
                return held
            elif func.attr == "get" and isinstance(held, Many):
                return held.item
            return None
        callee = self.expr(func, env)
        if callee is None and isinstance(func, ast.Name) and func.id in self.functions \
                and any(a is not None for a in args):
            self.helper(self.functions[func.id], node, args)
            return None
        if isinstance(callee, Obj):
            real = callee.value
            self.check_call(node, real, callee.path, bound=False)
            self.settings(node, real, env)
            if isinstance(real, type):
                return Inst(real, f"{callee.path}()")
            cls = _annotation_class(real) if callable(real) else None
            return Inst(cls, f"{callee.path}()") if cls else None
        if isinstance(callee, Method):
            static = inspect.getattr_static(callee.inst.cls, callee.path.rsplit(".", 1)[1])
            self.check_call(node, callee.func, callee.path,
                            bound=not isinstance(static, staticmethod | classmethod))
            cls = _annotation_class(callee.func)
            return Inst(cls, f"{callee.path}()") if cls else None
        return None

    def helper(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, node: ast.Call, args: list) -> None:
        """Walk a same-file helper with the kvikio values it was called with."""
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        bound = {p: v for p, v in zip(params, args, strict=False) if v is not None}
        key = (fn.name, tuple(sorted((k, repr(v)) for k, v in bound.items())))
        if key in self.walked or len(self.walked) > 200:
            return
        self.walked.add(key)
        self.function(fn, {}, bound)

    def check_call(self, node: ast.Call, func: Any, path: str, *, bound: bool) -> None:
        try:
            sig = inspect.signature(func)
        except (TypeError, ValueError):
            self.use(node, f"{path}(...) [no signature to check]")
            return
        starred = any(isinstance(a, ast.Starred) for a in node.args)
        kwstar = any(kw.arg is None for kw in node.keywords)
        positional = [object()] * (len(node.args) + (1 if bound else 0))
        keywords = {kw.arg: object() for kw in node.keywords if kw.arg is not None}
        text = f"{path}({', '.join(['_'] * len(node.args) + [f'{k}=' for k in keywords])})"
        if starred or kwstar:
            takes_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
            for k in keywords:
                if k not in sig.parameters and not takes_kw:
                    self.problem(node, f"{text}: no parameter {k!r} in {path}{sig}")
            self.use(node, text)
            return
        try:
            sig.bind(*positional, **keywords)
        except TypeError as exc:
            self.problem(node, f"{text}: {exc} (kvikio {self.package.__version__}: {path}{sig})")
            return
        self.use(node, text)

    def dict_of(self, node: ast.expr, env: dict) -> ast.Dict | None:
        """The dict literal ``node`` evaluates to: itself, a name assigned one, or a call of a
        same-file function whose one ``return`` returns one (``set(kvikio_settings(...))``)."""
        if isinstance(node, ast.Dict):
            return node
        if isinstance(node, ast.Name):
            return env.get(f"#dict:{node.id}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.functions:
            returns = [n for n in ast.walk(self.functions[node.func.id]) if isinstance(n, ast.Return)]
            if len(returns) == 1 and isinstance(returns[0].value, ast.Dict):
                return returns[0].value
        return None

    def settings(self, node: ast.Call, func: Any, env: dict) -> None:
        """``kvikio.defaults.set``/``get`` with literal keys: called for real."""
        defaults = sys.modules.get("kvikio.defaults")
        if defaults is None or func not in (getattr(defaults, "set", None), getattr(defaults, "get", None)):
            return
        if func is defaults.get:
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                self._real(node, defaults.get, node.args[0].value)
            return
        literal = self.dict_of(node.args[0], env) if len(node.args) == 1 else None
        if literal is not None:
            config = {}
            for k, v in zip(literal.keys, literal.values, strict=True):
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    ok, value = _literal(v)
                    config[k.value] = value if ok else self._current(node, defaults, k.value)
            if config:
                self._real(node, defaults.set, config)
        elif len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            ok, value = _literal(node.args[1])
            key = node.args[0].value
            self._real(node, defaults.set, key, value if ok else self._current(node, defaults, key))

    def _current(self, node: ast.AST, defaults: Any, key: str) -> Any:
        try:
            return defaults.get(key)
        except Exception:  # noqa: BLE001 - set() then reports the same refusal
            return 1

    def _real(self, node: ast.Call, func: Any, *args: Any) -> None:
        text = f"kvikio.defaults.{func.__name__}({', '.join(map(repr, args))})"
        try:
            result = func(*args)
        except Exception as exc:  # noqa: BLE001 - kvikio's refusal is the finding
            self.problem(node, f"{text}: kvikio {self.package.__version__} raises "
                               f"{type(exc).__name__}: {exc}")
            return
        if hasattr(result, "__exit__"):
            result.__exit__(None, None, None)   # put the old values back
        self.use(node, text)


def check(roots: list[Path]) -> dict:
    """Parse every ``*.py`` under ``roots`` that mentions kvikio, import as they do, walk them."""
    trees = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            text = path.read_text()
            if "kvikio" in text:
                trees[str(path)] = ast.parse(text, filename=str(path))
    imports, problems = perform_imports(trees)
    out: dict = {"imports": imports, "uses": [], "problems": problems, "fallbacks": []}
    package = sys.modules.get("kvikio")
    if package is None:
        out["problems"].append(["-", 0, "no source imports kvikio, or the import failed"])
        out["version"] = None
        return out
    out["version"] = package.__version__
    for file, tree in trees.items():
        FileChecker(file, tree, package, out).run()
    for key in ("uses", "problems", "fallbacks"):
        out[key] = sorted({tuple(x) for x in out[key]})
    return out


if __name__ == "__main__":
    print(json.dumps(check([Path(p) for p in sys.argv[1:]]), indent=1))
