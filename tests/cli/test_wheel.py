"""The package as users install it: the wheel built from this checkout, installed into a fresh environment without the
checkout on the path, plans the demo by its shipped name from an empty directory, lists and copies the shipped configs,
holds none of the workshop and requires no pytest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

#: the test and benchmark scaffolding: in workshop/ at the repository's root, never in the wheel
WORKSHOP = ("workshop/", "tests/", "benchmarks/")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the fresh environment's bin/) : built from a copy of the package (a build writes build/ and
    *.egg-info beside its sources; the checkout stays clean) with the system's setuptools (offline), installed with
    --no-deps into a venv that sees the system's torch, Ray and the rest."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copytree(ROOT / "m2d_ray", src / "m2d_ray", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)], check=True)
    (wheel,) = (tmp / "dist").glob("m2d_ray-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp / "venv")], check=True)
    bin_ = tmp / "venv" / "bin"
    subprocess.run([str(bin_ / "python"), "-m", "pip", "-q", "install", "--no-deps", str(wheel)], check=True)
    return wheel, bin_


def m2d(bin_: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """`m2d` of the installed wheel, from `cwd`, with nothing of the checkout on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", PATH=f"{bin_}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run([str(bin_ / "m2d"), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_plans_the_demo_by_name_from_an_empty_directory(installed, tmp_path):
    wheel, bin_ = installed
    where = subprocess.run(
        [str(bin_ / "python"), "-c", "import m2d_ray; print(m2d_ray.__file__)"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(ROOT) not in where and str(bin_.parent) in where  # the wheel's copy, not the checkout's

    listed = m2d(bin_, tmp_path, "configs")
    assert listed.returncode == 0, listed.stderr
    assert {line.split()[0] for line in listed.stdout.splitlines()} >= {"tiny", "smoke", "qwen3_30b_a3b"}

    planned = m2d(bin_, tmp_path, "plan", "tiny")
    assert planned.returncode == 0, planned.stderr
    assert '"stages"' not in planned.stdout and "memory plan" in planned.stdout and "the bill" in planned.stdout
    planned = m2d(bin_, tmp_path, "plan", "tiny", "--json")
    assert '"stages": {"calibrate"' in planned.stdout.splitlines()[-1] and "memory plan" in planned.stdout

    paper = m2d(bin_, tmp_path, "plan", "qwen3_30b_a3b", "--model", "Qwen/Qwen3-30B-A3B", "--json")  # offline
    assert '"stages"' in paper.stdout, paper.stderr

    copied = m2d(bin_, tmp_path, "cp", "tiny", "mine.yaml")
    assert copied.returncode == 0 and (tmp_path / "mine.yaml").read_text().startswith("# The whole pipeline")
    again = m2d(bin_, tmp_path, "cp", "tiny", "mine.yaml")
    assert again.returncode == 2 and "never overwrites" in again.stderr and len(again.stderr.splitlines()) == 1
    unknown = m2d(bin_, tmp_path, "plan", "tiyn")
    assert unknown.returncode == 2 and "did you mean tiny?" in unknown.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]  # a plan writes nothing


def test_the_wheel_holds_no_workshop_and_requires_no_pytest(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [ln for ln in z.read(meta).decode().splitlines() if ln.startswith("Requires-Dist:")]
    assert not [n for n in names if n.startswith(WORKSHOP)]
    scaffolding = ("random_models", "trajectories", "local_group", "time_budget", "measured_write", "asha_ray")
    assert not [n for n in names if n.rsplit("/", 1)[-1].removesuffix(".py") in scaffolding]
    assert "m2d_ray/experiments/tiny.yaml" in names and "m2d_ray/experiments/_paper.yaml" in names
    assert "m2d_ray/experiments/configs/Qwen--Qwen3-30B-A3B/config.json" in names
    assert all('extra == "test"' in ln for ln in requires if ln.split()[1].startswith("pytest"))
