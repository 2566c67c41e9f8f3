"""The package's import graph (read from the source, AST): no cycles and no import against the layer
order written in the package docstring (m2d_ray/__init__.py); arch/'s registration idiom excepted."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import m2d_ray

PKG = Path(m2d_ray.__file__).parent
ALLOWED_CYCLE = "m2d_ray.arch"  # arch/__init__ imports its family modules, which import arch to register


def layers() -> dict[str, int]:
    """Top-level module or package name -> its layer, from the package docstring."""
    out = {}
    for line in m2d_ray.__doc__.splitlines():
        m = re.match(r"\s+(\d+)\. (.+)$", line)
        if m:
            out.update({name.strip(): int(m.group(1)) for name in m.group(2).split(",")})
    return out


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (at module level or inside functions)."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "m2d_ray":
                deps |= {resolve(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "m2d_ray"}
        out[name] = {d for d in deps if d and d != name}
    return out


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_top_level_module_has_a_layer():
    names = {top(m) for m in modules()} - {""}
    assert names == set(layers()), (names - set(layers()), set(layers()) - names)


def test_no_import_cycles_except_the_arch_registration():
    bad = [c for c in cycles(graph()) if not all(m == ALLOWED_CYCLE or m.startswith(ALLOWED_CYCLE + ".") for m in c)]
    assert not bad, bad


def test_no_import_reaches_a_higher_layer():
    rank = layers()
    upward = sorted((m, d) for m, deps in graph().items() for d in deps if top(m) and rank[top(d)] > rank[top(m)])
    assert not upward, upward


def test_the_checks_find_what_they_look_for():
    """The checks are live: a cycle and an upward edge in a made-up graph are found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert layers()["errors"] < layers()["stages"] < layers()["commands"]


# ---- imports inside functions -------------------------------------------------------------------------
#: what a module may import inside a function instead of at its top: packages that cost seconds to import or that a
#: process must not load (`m2d plan` reads every stage without Ray), and the package modules that pull them
LAZY = {"ray", "lm_eval", "mlflow", "deepspeed", "matplotlib", "datasets"}
REASON = "# Imported inside functions:"


def _top_level(tree: ast.Module) -> list:
    """The module's own imports (at its top, in a module-level if/try; not a TYPE_CHECKING block)."""
    out = []

    def walk(body) -> None:
        for n in body:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                out.append(n)
            elif isinstance(n, ast.If) and "TYPE_CHECKING" not in ast.unparse(n.test):
                walk(n.body)
                walk(n.orelse)
            elif isinstance(n, ast.Try):
                for b in (n.body, n.orelse, n.finalbody, *[h.body for h in n.handlers]):
                    walk(b)

    walk(tree.body)
    return out


def _names(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [f"{node.module}.{a.name}" for a in node.names]


def lazy_packages() -> dict[str, set[str]]:
    """Module -> the LAZY packages its top-level imports load (through the package's own modules too)."""
    mods, trees = modules(), {m: ast.parse(p.read_text()) for m, p in modules().items()}

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    direct = {m: [n for node in _top_level(t) for n in _names(node)] for m, t in trees.items()}
    memo: dict[str, set[str]] = {}

    def pulls(m: str, seen: frozenset = frozenset()) -> set[str]:
        if m not in memo:
            out = set()
            for n in direct[m]:
                if n.split(".")[0] in LAZY:
                    out.add(n.split(".")[0])
                elif n.startswith("m2d_ray") and (r := resolve(n)) and r != m and r not in seen:
                    out |= pulls(r, seen | {m})
            memo[m] = out
        return memo[m]

    return {m: pulls(m) for m in mods}


def needless_lazy_imports() -> list[str]:
    """Imports inside functions that need not be there: what they load the module loads already, or it is not
    LAZY (imports in a `try`, of what may be missing, are left alone)."""
    mods, have = modules(), lazy_packages()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    bad = []
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        for fn in [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            guarded = {id(n) for t in ast.walk(fn) if isinstance(t, ast.Try) for s in t.body for n in ast.walk(s)}
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in guarded:
                    continue
                need = set()
                for n in _names(node):
                    if n.split(".")[0] in LAZY:
                        need.add(n.split(".")[0])
                    elif n.startswith("m2d_ray") and (r := resolve(n)):
                        need |= have[r]
                if not need - have[m]:
                    bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_imports_stay_at_the_top_but_where_they_must_be_lazy():
    assert needless_lazy_imports() == []


def test_a_module_with_lazy_imports_says_why_once():
    mods = modules()
    lazy = {
        m
        for m, p in mods.items()
        if any(
            isinstance(n, (ast.Import, ast.ImportFrom))
            for f in ast.walk(ast.parse(p.read_text()))
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
        )
    }
    silent = sorted(m for m in lazy if mods[m].read_text().count(REASON) != 1)
    assert silent == [], f"each of these modules imports inside a function: say why, once, in a line '{REASON} ...'"


def test_the_lazy_import_check_finds_a_needless_one(tmp_path, monkeypatch):
    """The check is live: a made-up module importing json inside a function is named."""
    pkg = tmp_path / "m2d_ray"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text(
        "def f():\n    import json\n    return json\n\n\ndef g():\n    import ray\n    return ray\n"
    )
    monkeypatch.setattr(__import__(__name__), "PKG", pkg)
    assert needless_lazy_imports() == ["m2d_ray/x.py:2 import json"]
