"""`m2d run` end to end: the demo config (experiments/tiny.yaml) with shortened budgets, on the session's Ray.

calibrate (Ray Data) -> stage 1 (Tune) -> promote -> stage 2 (Train) -> stage 3 (lm-eval as Ray tasks)
-> report, under one MLflow parent run; then a resume that redoes nothing.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

from m2d_ray.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "tiny.yaml"
SHORT = [
    "calib.max_tokens=4096", "calib.seq_len=128", "eval.max_chars=20000", "eval.seq_len=128", "eval.chunks=1",
    "grid.scoring=[sf,do-acp]", "grid.grouping=[rr]", "grid.scaling=[uniform]", "grid.K=[2,4]",
    "distill.steps=4", "distill.eval_every=2", "distill.seq_len=64", "distill.batch_size=4", "distill.eval_max_tokens=2048",
    "distill.warmup_steps=1", "stage2.baselines=[random-init]", "stage3.limit=24",
]


def test_m2d_run_whole_pipeline_then_resume(ray_address, tmp_path, capfd):
    import mlflow

    run_dir = tmp_path / "demo"
    assert main(["run", str(TINY), "--out", str(run_dir), *SHORT]) == 0
    captured = capfd.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert len(captured.out.strip().splitlines()) == 1  # stdout: the result line only

    # the console shows the platform's own lines only; Ray/Tune/MLflow output is in RUN_DIR/logs/
    logs = list((run_dir / "logs").glob("m2d-run-*.log"))
    assert len(logs) == 1
    log = logs[0].read_text()
    ours = {ln.removeprefix("[m2d] ") for ln in log.splitlines() if ln.startswith("[m2d] ")}
    shown = captured.err.strip().splitlines()
    assert shown and set(shown) <= ours, [ln for ln in shown if ln not in ours]
    assert "== stage3 ==" in shown and any(ln.startswith("[stage 2 ") for ln in shown)
    assert "Configuration for experiment" in log and "Configuration for experiment" not in captured.err
    assert set(out["stages"]) == {"stage1", "stage2", "stage3", "report"} and "mlflow ui --backend-store-uri sqlite:///" in out["mlflow_ui"]

    # every promoted pair and the baseline were distilled, and every student + the teacher evaluated
    promotions = json.loads((run_dir / "promotions.json").read_text())["pairs"]
    keys = {p["key"] for p in promotions.values()} | {"baseline-random-init"}
    results = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stage3" / "results").glob("*.json")}
    assert set(results) == keys | {"teacher"}
    for r in results.values():
        assert r["status"] == "ok" and {t["n"] for t in r["tasks"].values()} == {24}
        assert r["mean"] == sum(t["score"] for t in r["tasks"].values()) / 2
    assert results["teacher"]["mean"] > results["baseline-random-init"]["mean"]

    # the report: tables with one row per pair + baseline + teacher, and every figure it links to
    report = run_dir / "report"
    rows = list(csv.DictReader((report / "distill.csv").open()))
    assert [r["scoring"] for r in rows] == ["SF", "DO-ACP", "random-init", "teacher"] and all(r["mean acc"] for r in rows)
    page = (report / "index.html").read_text()
    for name in ("stage1_heatmap.png", "marginal.png", "curves.png", "overlap.png", "erank.png"):
        assert (report / name).stat().st_size > 5000 and f'src="{name}"' in page, name

    # one MLflow parent: stage-1, stage-2 and stage-3 runs nested under it; the report is its artifact
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    try:
        runs = mlflow.search_runs(experiment_names=["m2d-tiny"], output_format="list")
        parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        assert len(parents) == 1
        stages = {r.data.tags["m2d.trial"].split("/")[0] for r in runs if r.data.tags.get("m2d.trial", "").startswith("stage")}
        assert stages == {"stage2", "stage3"} and len(runs) > 1 + len(keys) + len(results)
        names = {a.path for a in mlflow.MlflowClient().list_artifacts(parents[0].info.run_id, "report")}
        assert "report/index.html" in names and "report/distill.csv" in names
    finally:
        mlflow.set_tracking_uri(None)

    # resume of a finished run: nothing is trained or evaluated again
    before = {p.name: p.stat().st_mtime for p in (run_dir / "stage3" / "results").iterdir()}
    t0 = time.time()
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert time.time() - t0 < 60
    assert {p.name: p.stat().st_mtime for p in (run_dir / "stage3" / "results").iterdir()} == before
    # a changed suite on resume is refused (it would mix two suites in one table)
    assert main(["run", "--resume", str(run_dir), "stage3.limit=10"]) == 2
    assert "another suite" in capfd.readouterr().err
