"""The package's import graph (read from the source, AST): no cycles and no import against the layer
order written in the package docstring (m2d_ray/__init__.py); arch/'s registration idiom excepted."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


#: the repository's top-level packages that the wheel does not ship: the package never imports them
WORKSHOP = ("workshop", "benchmarks", "tests", "conftest")


def test_the_package_never_imports_the_workshop():
    """Test and benchmark scaffolding lives in workshop/ at the repository's root, outside the wheel: an import of it
    (or of benchmarks/ or tests/) from m2d_ray, at the top of a module or inside a function, would fail where the
    package is installed."""
    found = sorted(
        (name, imported)
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        for imported in (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        if imported.split(".")[0] in WORKSHOP
    )
    assert not found, found
    assert (PKG.parent / "workshop" / "__init__.py").is_file() and not (PKG / "random_models.py").exists()


def test_the_checks_find_what_they_look_for():
    """The checks are live: a cycle and an upward edge in a made-up graph are found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert layers()["errors"] < layers()["stages"] < layers()["commands"]


# ---- imports inside functions -------------------------------------------------------------------------
#: what a module may import inside a function instead of at its top: packages that cost seconds to import or that a
#: process must not load (`m2d plan` reads every stage without Ray, and without torch where its counts are arithmetic),
#: and the package modules that pull them
LAZY = {"ray", "lm_eval", "mlflow", "deepspeed", "matplotlib", "datasets", "torch", "safetensors"}
#: transformers' model classes (its modelling code: seconds of imports); its configs and tokenizers are not
MODELS = "transformers models"
#: transformers' experts integration and weight-conversion machinery: they load the kernels hub and torch._dynamo
INTEGRATIONS = "transformers integrations"
REASON = "# Imported inside functions:"


def _units(name: str) -> set[str]:
    """The LAZY units an imported name loads (transformers' top level is lazy: a config class or a tokenizer loads no
    modelling code, a model class does; and all but its top level and its tokenizers load torch, its configs too)."""
    root = name.split(".")[0]
    if root in LAZY:
        return {root}
    if root != "transformers" or name == "transformers" or "Tokenizer" in name.rpartition(".")[2]:
        return set()
    if "Model" in name.rpartition(".")[2] or ".modeling" in name:
        return {MODELS, "torch"}
    if any(p in name for p in (".integrations", ".core_model_loading", ".conversion")):
        return {INTEGRATIONS, "torch"}
    return {"torch"}


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
                if _units(n):
                    out |= _units(n)
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
                    if _units(n):
                        need |= _units(n)
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


# ---- the light core ------------------------------------------------------------------------------------
#: what every process reads first: the config, the CLI's parsing, the registries' names and docs
LIGHT = (
    "m2d_ray.config",
    "m2d_ray.cli",
    "m2d_ray.catalog.methods",
    "m2d_ray.catalog.distill",
    "m2d_ray.catalog.targets",
    "m2d_ray.catalog.evaluate",
)
HEAVY = ("torch", "transformers", "ray", "mlflow", "datasets", "deepspeed", "lm_eval")


def _loaded_by(code: str) -> list[str]:
    """The HEAVY packages a fresh interpreter holds after running `code`."""
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_the_light_core_imports_no_heavy_library():
    """`m2d --help`, a config's checks and the registries' names and docs load none of the libraries that cost
    seconds: every CLI call, test subprocess and Ray worker that only reads a config pays nothing for them."""
    code = "\n".join(f"import {m}" for m in LIGHT) + (
        f"\nfrom m2d_ray.config import load_config\ncfg = load_config({str(PKG / 'experiments/tiny.yaml')!r})\n"
        "from m2d_ray.cli import parser\nparser().format_help()\n"
        "from m2d_ray.catalog.methods import SCORINGS\nfrom m2d_ray.catalog.distill import KL_KERNELS\n"
        "[SCORINGS.doc(n) for n in SCORINGS]; [KL_KERNELS.doc(n) for n in KL_KERNELS]"
    )
    assert _loaded_by(code) == []
    assert "torch" in _loaded_by("import m2d_ray.scoring.methods"), "the probe sees a heavy import"


def test_the_plan_of_the_paper_run_builds_no_model():
    """`m2d plan` of the paper's run counts its models by arithmetic (arch/counts.py) and loads no modelling code of
    transformers (seconds of imports; the plan was 4.9 s): only its configs. The probe sees it load when it does."""
    root = PKG.parent
    code = (
        "from m2d_ray.config import load_config\nfrom m2d_ray.pipeline import plan_run\n"
        f"plan_run(load_config({str(root / 'm2d_ray/experiments/qwen3_30b_a3b.yaml')!r}), "
        f"model={str(root / 'm2d_ray/experiments/configs/Qwen--Qwen3-30B-A3B')!r})\n"
        "import m2d_ray.commands.plan\n"
        "assert 'transformers.modeling_utils' not in sys.modules, 'modelling code loaded'"
    )
    _loaded_by(code)  # raises (check=True) when the assertion fails
    with pytest.raises(subprocess.CalledProcessError):
        _loaded_by(code.replace("import m2d_ray.commands.plan", "from transformers import PreTrainedModel"))


def test_planning_the_paper_run_and_importing_the_loss_import_no_dynamo(tmp_path):
    """`m2d plan qwen3_30b_a3b` (the CLI, in a fresh interpreter) and importing the losses load no torch._dynamo
    (1.35 s, as long as torch): the head's exclusion from torch.compile is applied when a compiler traces it
    (numerics.eager), not at import. Every Ray worker that imports the loss and every plan paid for it."""
    code = (
        "from m2d_ray.cli import main\nassert main(['plan', 'qwen3_30b_a3b']) in (0, None)\n"
        "import m2d_ray.distill.losses, m2d_ray.distill.kernels, m2d_ray.evaluate.perplexity\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'none')"
    )
    probe = f"import sys\n{code}"
    env = {**os.environ, "PYTHONPATH": str(PKG.parent)}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path, env=env
    )
    assert out.stdout.split()[-1] == "none", "torch._dynamo imported by the plan or the loss"


def lazy_registries() -> dict[str, object]:
    from m2d_ray.catalog.distill import KL_KERNELS, PRECISIONS
    from m2d_ray.catalog.methods import GROUPINGS, RANDOM_BASELINES, SCALINGS, SCORINGS

    return {
        "scoring": SCORINGS,
        "grouping": GROUPINGS,
        "scaling": SCALINGS,
        "random baseline": RANDOM_BASELINES,
        "precision": PRECISIONS,
        "kl kernel": KL_KERNELS,
    }


def test_every_declared_entry_is_registered_by_its_module_and_nothing_else():
    """A lazily declared name resolves to what its module registers, and a module registers only what its registry
    declares (else `m2d --help` and the config checks would not know a built-in name); a function's own docstring
    opens with the doc the registry declares."""
    import importlib
    import inspect

    for kind, reg in lazy_registries().items():
        declared = reg.declared()
        for module in set(declared.values()):
            importlib.import_module(module)
        assert list(reg._items) == list(declared), kind  # registered in the declared order, nothing more
        for name, obj in reg.load_all().items():
            if inspect.isfunction(obj) and obj.__doc__:
                assert " ".join(inspect.getdoc(obj).split("\n\n")[0].split()) == reg.doc(name), (kind, name)


def test_the_cuda_only_kernels_are_declared_as_such():
    from m2d_ray.catalog.distill import CUDA_ONLY_KERNELS, KL_KERNELS

    assert {n for n, k in KL_KERNELS.load_all().items() if k.cuda_only} == CUDA_ONLY_KERNELS


def test_a_lazy_registry_imports_its_module_at_the_first_lookup_only(tmp_path, monkeypatch):
    from m2d_ray.errors import M2DError
    from m2d_ray.registry import Registry

    (tmp_path / "m2d_fake_methods.py").write_text(
        "from m2d_ray.registry import Registry\nimport m2d_fake_reg\n"
        "@m2d_fake_reg.R.register('alpha')\ndef alpha():\n    'Alpha.'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("method", lazy={"alpha": ("m2d_fake_methods", "The first."), "beta": ("m2d_fake_methods", "B.")})
    monkeypatch.setitem(sys.modules, "m2d_fake_reg", type(sys)("m2d_fake_reg"))
    sys.modules["m2d_fake_reg"].R = reg
    assert reg.names() == ["alpha", "beta"] and "beta" in reg and reg.doc("alpha") == "The first."
    assert "m2d_fake_methods" not in sys.modules
    assert reg["alpha"].__doc__ == "Alpha." and "m2d_fake_methods" in sys.modules
    with pytest.raises(RuntimeError, match="does not register the declared method 'beta'"):
        reg["beta"]
    with pytest.raises(M2DError, match="did you mean 'alpha'"):
        reg["alpah"]
    monkeypatch.delitem(sys.modules, "m2d_fake_methods")
