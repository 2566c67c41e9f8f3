"""A benchmark that names the repository by its own place (`Path(__file__).parents[N]`) names the repository root:
the move of benchmarks/ into parts left four of them one folder short (the paper plan's config "not found")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_benchmark_reaches_the_repository_root_by_its_own_depth():
    wrong = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        depth = len(path.relative_to(ROOT).parts) - 1  # folders between the repository and the file
        for m in re.finditer(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d+)\]\s*(?:#.*)?$", path.read_text(), re.M):
            line = path.read_text()[: m.start()].count("\n") + 1
            if int(m.group(1)) != depth and "REPO" in path.read_text().splitlines()[line - 1]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} parents[{m.group(1)}], the root is parents[{depth}]")
    assert wrong == []
