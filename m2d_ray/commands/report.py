"""`m2d report`: RUN_DIR/report/ (HTML + CSV/Markdown tables + PNG figures), also logged to the run's MLflow parent."""

from __future__ import annotations

import json

from m2d_ray.commands.runs import existing_run
from m2d_ray.config import load_config
from m2d_ray.console import emit, say
from m2d_ray.report.run import write_report
from m2d_ray.track import NOTE_TAG, run_description, run_tracker, sweep_parent


def report(run_dir: str, tracking_uri: str | None = None) -> dict:
    rd = existing_run(run_dir)
    index = write_report(rd.path)
    cfg = load_config(rd.config)
    tracker = run_tracker(cfg, rd, tracking_uri)
    parent = sweep_parent(tracker, rd, cfg.name)
    description = run_description(cfg.name, rd, rd.read_promotions()["teacher"], len(rd.stage1_ledger().records()))
    tracker.log(parent, tags={NOTE_TAG: description})  # a run of an older m2d gets it too
    tracker.client.log_artifacts(parent, str(index.parent), artifact_path="report")
    tracker.finish(parent)
    return {"report": str(index), "mlflow_url": tracker.ui_url(), "files": sorted(p.name for p in index.parent.iterdir() if not p.name.startswith("."))}


def main(args) -> None:
    result = report(args.run_dir, args.tracking_uri)
    say(f"report: {result['report']}")
    say(f"MLflow: {result['mlflow_url']}  (with mlflow ui running on the run's store)")
    emit(json.dumps(result))
