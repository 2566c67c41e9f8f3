"""`m2d run` end to end: the demo config (m2d_ray/experiments/tiny.yaml) with shortened budgets, on the session's Ray.

calibrate (Ray Data) -> stage 1 (Tune) -> promote -> stage 2 (Train) -> stage 3 (lm-eval as Ray tasks)
-> report, under one MLflow parent run; then a resume that redoes nothing.

Where the machine can build tests/ray/multinode.py's two-node cluster, test_multinode.py runs this same
pipeline end to end (and checks all of this) there instead: the suite's time is spent once.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest
from conftest import multinode_unavailable

from m2d_ray.cli import main
from m2d_ray.config import load_config
from m2d_ray.shipped import EXPERIMENTS

TINY = EXPERIMENTS / "smoke.yaml"
SHORT = [  # overrides of m2d_ray/experiments/smoke.yaml: more data, two scorings and two K, the baselines
    "calib.max_tokens=4096",
    "eval.max_chars=20000",
    "grid.scoring=[sf,do-acp]",
    "grid.K=[2,4]",
    "distill.eval_max_tokens=2048",
    "stage2.baselines=[random-init,d2d]",
    "stage3.limit=24",
]


def check_d2d(run_dir: Path, report: Path) -> None:
    """The d2d baseline: the promoted candidate of the search is what was distilled, from the dense twin, and the
    matched-parameter table compares it with the best MoE-to-dense student at (almost) the same size."""
    from transformers import AutoConfig

    from m2d_ray.models import default_dense_teacher, default_teacher
    from m2d_ray.prune.search import moe_student_params

    cands = list(csv.DictReader((report / "d2d_candidates.csv").open()))
    assert len(cands) >= 4 and [c["promoted"] for c in cands].count("yes") == 1
    best = next(c for c in cands if c["promoted"] == "yes")
    assert min(float(c["ppl before distillation"]) for c in cands) == float(best["ppl before distillation"])
    rec = json.loads(next((run_dir / "stage2" / "trials").glob("baseline-d2d*.json")).read_text())
    assert rec["status"] == "ok" and rec["student_params"] == int(best["params"])
    assert abs(rec["student_params"] / moe_student_params(default_teacher()) - 1) < 0.01
    assert rec["teacher_active_params"] == 555_712  # the whole dense twin: distilled from it, not from the MoE teacher
    cfg = AutoConfig.from_pretrained(rec["student_path"])
    assert cfg.architectures == ["Qwen3ForCausalLM"] and (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
    ) == (int(best["d"]), int(best["FFN"]), int(best["layers"]))
    assert AutoConfig.from_pretrained(default_dense_teacher()).num_hidden_layers >= cfg.num_hidden_layers
    matched = list(csv.DictReader((report / "matched.csv").open()))
    assert [r["student"] for r in matched][:2] == ["best MoE-to-dense", "d2d"]
    assert all(
        float(r["s / training step"]) > 0 and float(r["final val ppl"]) > 0 and r["stage-3 mean acc"] for r in matched
    )
    moe = next(r for r in matched if r["student"] == "best MoE-to-dense")
    assert int(moe["teacher active params"]) < 300_000  # the MoE teacher: top-2 of its 16 experts per token


def check_analysis(run_dir: Path, models: set[str]) -> None:
    """What the models write: every evaluated model answered the 12 offline questions (tiny.yaml: 2 per corpus
    domain), each answer in one category; the report shows the figure and tables; MLflow has a run per model with the
    category rates and the answers as its artifact."""
    import mlflow

    records = {p.stem: json.loads(p.read_text()) for p in (run_dir / "analysis" / "results").glob("*.json")}
    assert set(records) == models and {r["status"] for r in records.values()} == {"ok"}, records
    for key, r in records.items():
        lines = [json.loads(x) for x in (run_dir / r["responses"]).read_text().splitlines()]
        assert len(lines) == r["n"] == 12 and sum(r["counts"].values()) == 12
        assert {x["category"] for x in lines} == {c for c, n in r["counts"].items() if n}
        assert all(x["model"] == key and x["finish"] in ("stop", "length") for x in lines)
    report = run_dir / "report"
    page = (report / "index.html").read_text()
    assert (report / "categories.png").stat().st_size > 5000 and 'src="categories.png"' in page
    assert len(list(csv.DictReader((report / "answer_groups.csv").open()))) == len(models)
    settings = json.loads((run_dir / "analysis" / "settings.json").read_text())
    assert (settings["questions"], settings["per_subject"], settings["max_new_tokens"]) == ("local", 2, 64)
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    try:
        runs = mlflow.search_runs(
            experiment_names=["m2d-tiny"], filter_string="tags.stage = 'analysis'", output_format="list"
        )
        assert {r.data.tags["m2d.trial"] for r in runs} == {f"analysis/{k}" for k in models}
        assert all("share.correct" in r.data.metrics and r.data.tags["judge"] == "teacher" for r in runs)
        assert [a.path for a in mlflow.MlflowClient().list_artifacts(runs[0].info.run_id)] == [
            runs[0].data.tags["m2d.trial"].split("/")[1] + ".jsonl"
        ]
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.skipif(multinode_unavailable() is None, reason="the same pipeline runs end to end in test_multinode.py")
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
    assert (
        list(out["stages"]) == ["calibrate", "stage1", "stage2", "stage3", "analysis", "report"]
        and "mlflow ui --backend-store-uri sqlite:///" in out["mlflow_ui"]
    )

    # distill.checkpointing=auto was decided by the plan before any work, said once, and the run's config records it
    assert load_config(run_dir / "config.yaml").distill.checkpointing == "none"  # a CPU host: every rank fits
    assert sum("distill.checkpointing=auto: none" in ln for ln in shown) == 1

    # every promoted pair and the baselines were distilled, and every student + both teachers evaluated
    promotions = json.loads((run_dir / "promotions.json").read_text())["pairs"]
    keys = {p["key"] for p in promotions.values()} | {"baseline-random-init", "baseline-d2d"}
    results = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stage3" / "results").glob("*.json")}
    assert set(results) == keys | {"teacher", "teacher-d2d"}
    for r in results.values():
        assert r["status"] == "ok" and {t["n"] for t in r["tasks"].values()} == {24}
        assert r["mean"] == sum(t["score"] for t in r["tasks"].values()) / 2
    assert results["teacher"]["mean"] > results["baseline-random-init"]["mean"]

    # the report: tables with one row per pair + baseline + teacher, and every figure it links to
    report = run_dir / "report"
    rows = list(csv.DictReader((report / "distill.csv").open()))
    assert [r["scoring"] for r in rows] == ["SF", "DO-ACP", "random-init", "d2d", "teacher", "dense teacher"] and all(
        r["mean acc"] for r in rows
    )
    check_d2d(run_dir, report)
    check_analysis(run_dir, set(results))
    page = (report / "index.html").read_text()
    for name in ("stage1_heatmap.png", "marginal.png", "curves.png", "overlap.png", "erank.png"):
        assert (report / name).stat().st_size > 5000 and f'src="{name}"' in page, name

    # one MLflow parent: stage-1, stage-2 and stage-3 runs nested under it; the report is its artifact
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    try:
        runs = mlflow.search_runs(experiment_names=["m2d-tiny"], output_format="list")
        parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        assert len(parents) == 1
        stages = {
            r.data.tags["m2d.trial"].split("/")[0] for r in runs if r.data.tags.get("m2d.trial", "").startswith("stage")
        }
        assert stages == {"stage2", "stage3"} and len(runs) > 1 + len(keys) + len(results)
        names = {a.path for a in mlflow.MlflowClient().list_artifacts(parents[0].info.run_id, "report")}
        assert "report/index.html" in names and "report/distill.csv" in names
    finally:
        mlflow.set_tracking_uri(None)

    # resume of a finished run: nothing is trained or evaluated again
    before = {p.name: p.stat().st_mtime for p in (run_dir / "stage3" / "results").iterdir()}
    answered = {p.name: p.stat().st_mtime for p in (run_dir / "analysis" / "results").iterdir()}
    first = json.loads((run_dir / "run.json").read_text())["stages"]
    t0 = time.time()
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert time.time() - t0 < 60
    assert {p.name: p.stat().st_mtime for p in (run_dir / "stage3" / "results").iterdir()} == before
    assert {p.name: p.stat().st_mtime for p in (run_dir / "analysis" / "results").iterdir()} == answered
    again = json.loads((run_dir / "run.json").read_text())[
        "stages"
    ]  # the resume's seconds are added, the first run's kept
    assert (
        again["calibrate"] == first["calibrate"]
        and again["stage1"] == first["stage1"]
        and again["stage3"]["runs"] == 2
        and again["stage3"]["wall_s"] >= first["stage3"]["wall_s"]
    )
    # a changed suite on resume is refused (it would mix two suites in one table)
    assert main(["run", "--resume", str(run_dir), "stage3.limit=10"]) == 2
    assert "another suite" in capfd.readouterr().err
