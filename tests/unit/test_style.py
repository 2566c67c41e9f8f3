"""The habits .ci/run holds the code to (pyproject.toml's [tool.ruff]): the linter passes and the formatter would
change nothing. Run here too, so the README's test command checks them wherever it runs."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import ROOT


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(args):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    out = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]


def test_a_slow_mark_stands_on_a_test():
    """`@pytest.mark.slow` on anything but a test marks nothing that pytest skips: a helper put between the mark and
    its test once left two 80-s tests in the default run."""
    import ast

    stray = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("test_"):
                marks = [ast.unparse(d) for d in node.decorator_list]
                if "pytest.mark.slow" in marks:
                    stray.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert stray == []
