"""The stored small run (tests/data/small_run: the ledgers and plans of a real `m2d run`) made whole again
without Ray: its MLflow store rebuilt from the ledgers by the stages' own recorders, and its report written,
as `m2d run` leaves them."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

from conftest import ROOT

STORED = ROOT / "tests" / "data" / "small_run"


def finished_run(dest: Path) -> tuple[Path, dict]:
    """A copy of the stored run at `dest` with its MLflow store (sqlite, RUN_DIR/mlflow.db) and report;
    returns (run dir, `m2d report`'s result)."""
    from m2d_ray.commands.report import report
    from m2d_ray.config import load_config
    from m2d_ray.run_dir import Ledger, RunDir
    from m2d_ray.runtime.record import StageRecorder
    from m2d_ray.stages import analysis, stage1_tune, stage2_tune, stage3
    from m2d_ray.track import run_tracker

    rd = RunDir(shutil.copytree(STORED, dest))
    cfg = load_config(rd.config)
    tracker = run_tracker(cfg, rd)
    promotions = rd.read_promotions()
    parent = tracker.parent_run(
        rd.sweep_id(), cfg.name, params={"model": promotions["teacher"]}, tags={"run_dir": str(rd)}
    )
    for ledger, stage, prefix in (
        (rd.stage1_ledger(), stage1_tune, ""),
        (rd.stage2_ledger(), stage2_tune, "stage2/"),
        (Ledger(rd.stage3_results), stage3, "stage3/"),
    ):
        StageRecorder(ledger, tracker, parent, stage.mlflow_fields, prefix).reconcile()
    StageRecorder(
        Ledger(rd.analysis_results), tracker, parent, partial(analysis.mlflow_fields, rd), "analysis/"
    ).reconcile()
    stage1_tune.tag_promoted(tracker, parent, promotions["pairs"])
    return rd.path, report(str(rd))
