"""Every command in README.md, docs/ and benchmarks/RESULTS.md that runs a benchmark still resolves: its module (or
script) exists, and the flags it gives are ones the benchmark's parser declares (read from its source, no import: this
test stays fast and torch-free)."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex

from conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", ROOT / "benchmarks" / "README.md"]
DOCS += sorted((ROOT / "docs").rglob("*.md"))
COMMAND = re.compile(
    r"(?:python3? -m (?P<module>benchmarks(?:\.\w+)+)|(?:python3? )(?P<script>benchmarks/[\w/]+\.py)"
    r"|bash (?P<shell>benchmarks/[\w/]+\.sh))(?P<rest>[^`\n|]*)"
)


def commands() -> list[tuple[str, str, str, list[str]]]:
    """(document, module or path, kind, the flags the command gives) of every benchmark command in the documents."""
    out = []
    for doc in DOCS:
        for m in COMMAND.finditer(doc.read_text()):
            kind = next(k for k in ("module", "script", "shell") if m.group(k))
            rest = m.group("rest").split("#")[0]
            try:
                words = shlex.split(rest)
            except ValueError:
                words = rest.split()
            flags = [w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)]
            out.append((doc.relative_to(ROOT).as_posix(), m.group(kind), kind, flags))
    return out


def declared_flags(module: str) -> set[str] | None:
    """The --flags `add_argument` declares in the module's source (literal first arguments), or None where the parser
    builds its flags from data (its flags cannot be read without running it)."""
    tree = ast.parse(importlib.util.find_spec(module).origin and open(importlib.util.find_spec(module).origin).read())
    flags, dynamic = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            lit = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            flags |= {x for x in lit if x.startswith("--")}
            dynamic |= not lit
    return None if dynamic else flags


def test_the_documents_name_benchmarks():
    found = commands()
    assert len(found) > 30 and {k for _, _, k, _ in found} == {"module", "shell"}, found


def test_every_benchmark_command_resolves_and_its_flags_are_known():
    bad = []
    for doc, target, kind, flags in commands():
        if kind != "module":
            if not (ROOT / target).is_file():
                bad.append(f"{doc}: {target} does not exist")
            continue
        if importlib.util.find_spec(target) is None:
            bad.append(f"{doc}: no module {target}")
            continue
        known = declared_flags(target)
        unknown = sorted(set(flags) - known) if known is not None else []
        if unknown:
            bad.append(f"{doc}: {target} does not declare {unknown}")
    assert not bad, "\n".join(bad)


def test_no_document_runs_a_benchmark_by_its_old_path():
    old = re.compile(r"python3? benchmarks/\w+\.py|benchmarks/(?:p\d+_|s\d_|_common|gpu_acceptance\.py)")
    hits = [f"{d.relative_to(ROOT)}: {m.group(0)}" for d in DOCS for m in old.finditer(d.read_text())]
    assert not hits, hits


def _python_files(*folders: str):
    return [p for f in folders for p in sorted((ROOT / f).rglob("*.py"))]


def test_no_test_imports_a_benchmark_or_puts_benchmarks_on_the_path():
    """Editing a benchmark cannot break a unit test: a test runs a benchmark as `python -m benchmarks...` when it
    tests one, and never imports it or adds benchmarks/ to sys.path."""
    bad = []
    for path in _python_files("tests"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and "sys.path" in ast.unparse(node.func):
                names = ["benchmarks"] if "benchmarks" in ast.unparse(node) else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "benchmarks"]
    assert bad == []


def test_a_random_qwen3_moe_config_is_built_in_one_place():
    """Tests, benchmarks and the package build their random Qwen3-MoE teachers' configs through
    arch/qwen3_moe.moe_config (issue 57: at most 2 files construct the config class)."""
    building = {
        str(p.relative_to(ROOT))
        for p in _python_files("tests", "benchmarks", "m2d_ray")
        if re.search(r"\bQwen3MoeConfig\(", p.read_text())
    }
    assert len(building) <= 2 and "m2d_ray/arch/qwen3_moe.py" in building, building
