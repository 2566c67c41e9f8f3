"""The example configs that ship inside the package (m2d_ray/experiments/): found by name from any directory, as
torchtune finds its recipes' configs, so an installed wheel runs its own demo (`m2d run tiny`, `m2d plan tiny`).

    experiments/NAME.yaml                a run's config (`_*.yaml`: a base that others include, not listed)
    experiments/configs/ORG--MODEL/      a published model's config.json alone: `m2d plan` reads it for the hub name
                                         ORG/MODEL, offline

Nothing here reads the checkout's layout: the files are the package's own data (pyproject's package-data).
"""

from __future__ import annotations

import difflib
from importlib.resources import files
from pathlib import Path

from m2d_ray.errors import M2DError

#: where the shipped configs live (a real directory: the package is installed unzipped)
EXPERIMENTS = Path(str(files("m2d_ray") / "experiments"))
SHAPES = EXPERIMENTS / "configs"
SUFFIXES = (".yaml", ".yml")


def configs() -> dict[str, Path]:
    """Every shipped run config by name (`tiny`), in name order; the included bases (`_paper`) are not runs."""
    return {p.stem: p for p in sorted(EXPERIMENTS.glob("*.yaml"), key=lambda p: p.stem) if not p.name.startswith("_")}


def find(name: str | Path) -> Path:
    """A config: a file that exists wins; else a shipped name (`named`)."""
    path = Path(name).expanduser()
    return path if path.is_file() else named(str(name))


def named(name: str) -> Path:
    """A shipped config by name (`tiny`, `tiny.yaml`), else one line naming the shipped ones, the closest first."""
    shipped = configs()
    path = Path(name)
    stem = path.stem if path.suffix in SUFFIXES else path.name
    if path.parent == Path(".") and stem in shipped:
        return shipped[stem]
    close = difflib.get_close_matches(stem, list(shipped), n=1, cutoff=0.5)
    hint = f" did you mean {close[0]}?" if close else ""
    raise M2DError(
        f"config {name} not found (neither a file nor a shipped config);{hint} shipped: {', '.join(shipped)} "
        "(`m2d configs` lists them, `m2d cp NAME my.yaml` copies one to edit)"
    )


def first_comment(path: Path) -> str:
    """A config's first comment line: what it is (every shipped config opens with one)."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def shape(model: str) -> Path | None:
    """The shipped config.json directory of a hub name (`Qwen/Qwen3-30B-A3B`), or None: the plan reads a model's
    shape from it without the hub."""
    if "/" not in model or Path(model).expanduser().exists():
        return None
    path = SHAPES / model.replace("/", "--")
    return path if (path / "config.json").is_file() else None
