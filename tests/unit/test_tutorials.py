"""The tutorials' commands (docs/tutorials/*.md, their ```bash blocks) run as written from the repository's root, their
run directories (`runs/...`) in a scratch directory: the plans in the default suite (seconds each), the runs
slow-marked (minutes). A command that needs a cluster (`ray ...`) or a server (`mlflow ui`) is not run here; one that
reads ../shared skips without it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
SHARED = ROOT.parent / "shared"


def commands() -> list[tuple[str, str]]:
    """(tutorial, command) of every `m2d ...` line of the tutorials' bash blocks, in their order."""
    out = []
    for path in TUTORIALS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            text = re.sub(r"\\\n\s*", " ", block)  # continued lines joined
            for line in text.splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("m2d "):
                    out.append((path.stem, line))
    return out


FAST = [(t, c) for t, c in commands() if c.startswith("m2d plan ")]
SLOW = [(t, c) for t, c in commands() if not c.startswith("m2d plan ")]


def run(command: str, scratch: Path) -> subprocess.CompletedProcess:
    """`command` from the repository's root, its `runs/` in `scratch`."""
    if ("../shared" in command or "wiki4" in command) and not SHARED.exists():
        pytest.skip("needs ../shared (the real-text teachers and WikiText)")
    argv = [sys.executable, "-m", "m2d_ray.cli", *shlex.split(command.replace(" runs/", f" {scratch}/runs/"))[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)


def test_the_tutorials_have_commands():
    assert {t for t, _ in FAST} >= {"demo", "cluster"} and any("m2d run experiments/tiny.yaml" in c for _, c in SLOW)


@pytest.mark.parametrize("tutorial,command", FAST, ids=[f"{t}: {c[:60]}" for t, c in FAST])
def test_a_tutorial_s_plan_runs_as_written(tutorial, command, tmp_path):
    out = run(command, tmp_path)
    assert out.returncode == 0, (command, out.stderr[-2000:])
    assert '"stages"' in out.stdout.strip().splitlines()[-1]  # the plan's JSON line


@pytest.mark.slow
@pytest.mark.parametrize("tutorial", sorted({t for t, _ in SLOW}))
def test_a_tutorial_s_runs_run_as_written(tutorial, tmp_path):
    """Every command of the tutorial, in its order, in one scratch directory (a resume finds its run)."""
    for t, command in SLOW:
        if t == tutorial:
            out = run(command, tmp_path)
            assert out.returncode == 0, (command, out.stderr[-3000:])
