"""Matplotlib on the Agg backend (no display) and atomic PNG writes, for every report figure."""

from __future__ import annotations

from pathlib import Path

# Imported inside functions: matplotlib (only where a figure is drawn).


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, dpi: int = 130) -> Path:
    """Write `fig` through a temp file + rename (a reader never sees half a PNG) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    pyplot().close(fig)
    tmp.replace(path)
    return path
