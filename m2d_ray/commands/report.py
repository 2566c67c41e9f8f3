"""`m2d report`: RUN_DIR/report/ (HTML + CSV/Markdown tables + PNG figures), also logged to the run's MLflow parent."""

from __future__ import annotations

import json

from m2d_ray import pipeline
from m2d_ray.commands.runs import existing_run
from m2d_ray.config import load_config
from m2d_ray.console import emit, say
from m2d_ray.runtime.context import RunContext


def report(run_dir: str, tracking_uri: str | None = None) -> dict:
    rd = existing_run(run_dir)
    ctx = RunContext(load_config(rd.config), rd, tracking_uri, tuple(pipeline.STAGES))
    return pipeline.STAGES["report"].run(ctx)


def main(args) -> None:
    result = report(args.run_dir, args.tracking_uri)
    say(f"report: {result['report']}")
    say(f"MLflow: {result['mlflow_url']}  (with mlflow ui running on the run's store)")
    emit(json.dumps(result))
