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
    if (model := _teacher_dir(command)) and not (ROOT / model).exists():
        pytest.skip(f"needs {model}, a teacher the tutorial builds (experiments/train_text_teacher.py)")
    argv = [sys.executable, "-m", "m2d_ray.cli", *shlex.split(command.replace(" runs/", f" {scratch}/runs/"))[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)


def _teacher_dir(command: str) -> str | None:
    """The teacher directory of the command's config when it is one the user makes (teachers/...)."""
    from m2d_ray.config import load_config
    from m2d_ray.shipped import configs

    config = next((a for a in shlex.split(command) if a in configs() or a.endswith(".yaml")), None)
    model = load_config(config).model if config else None
    return model if model and str(model).startswith("teachers/") else None


def test_the_tutorials_have_commands():
    assert {t for t, _ in FAST} >= {"demo", "cluster"} and any("m2d run tiny" in c for _, c in SLOW)


@pytest.mark.parametrize("tutorial,command", FAST, ids=[f"{t}: {c[:60]}" for t, c in FAST])
def test_a_tutorial_s_plan_runs_as_written(tutorial, command, tmp_path):
    out = run(command, tmp_path)
    assert out.returncode == 0, (command, out.stderr[-2000:])
    assert "memory plan" in out.stdout and "the bill" in out.stdout  # the table and the bill, for people
    assert ('"stages"' in out.stdout) == ("--json" in command)  # the JSON line only when asked


@pytest.mark.slow
@pytest.mark.parametrize("tutorial", sorted({t for t, _ in SLOW}))
def test_a_tutorial_s_runs_run_as_written(tutorial, tmp_path):
    """Every command of the tutorial, in its order, in one scratch directory (a resume finds its run)."""
    for t, command in SLOW:
        if t == tutorial:
            out = run(command, tmp_path)
            assert out.returncode == 0, (command, out.stderr[-3000:])


def test_the_real_text_tutorial_s_own_teachers_recipe_runs(tmp_path, monkeypatch):
    """For whoever has no ../shared: the tutorial's recipe lines, as written but for a few steps on a small text (the
    hub's WikiText-2 is not reached here), build both teachers, and the page's config plans on them."""
    import importlib.util

    from m2d_ray.cli import main
    from m2d_ray.data.synthetic import corpus_text

    page = (ROOT / "docs" / "tutorials" / "real-text-teacher.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", page, flags=re.S) if "train_text_teacher.py" in b)
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    spec = importlib.util.spec_from_file_location("train_text_teacher", ROOT / "experiments" / "train_text_teacher.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    text = tmp_path / "train.txt"
    text.write_text(corpus_text("train")[:60000])
    monkeypatch.chdir(tmp_path)  # teachers/ and runs/ as the tutorial makes them, from here
    small = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--vocab", "300", "--threads", "1"]
    trained = [shlex.split(line)[2:] for line in lines if line.startswith("python experiments/train_text_teacher.py")]
    assert len(trained) == 2 and "--dense" in trained[1]
    for argv in trained:
        assert recipe.main([str(text) if a == "wikitext2:train" else a for a in argv] + small) == 0
    assert any("wikitext2:test" in line and "teachers/wiki.test.raw" in line for line in lines)
    Path("teachers/wiki.test.raw").write_text(corpus_text("test")[:20000])  # what that line writes from the hub
    run = next(line for line in lines if line.startswith("m2d run "))
    config = shlex.split(run)[2]
    assert main(["plan", config]) in (0, None)
