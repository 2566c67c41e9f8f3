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
