"""`m2d run` on a two-node Ray cluster whose worker node cannot see the driver's disk (tests/ray/multinode.py).

One cluster for the module, in a private PID namespace: a head with no CPUs and a worker in its own
mount namespace with the runs' driver directories hidden under a tmpfs. Storage the worker cannot see (its
trials fail with one line), on a shared directory, then on S3 (moto on 127.0.0.1) with the teacher on the driver's disk
and the driver SIGKILLed mid-run.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import multinode_unavailable, script_env
from test_run_e2e import check_analysis, check_d2d

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory):
    why = multinode_unavailable()
    if why:
        pytest.skip(why)
    work = tmp_path_factory.mktemp("multinode")
    proc = subprocess.run(
        ["unshare", "-pf", "--kill-child", "--mount-proc", sys.executable, str(HERE / "multinode.py"), str(work)],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((work / "results.json").read_text())
    return work, results


def _rows(run_dir: Path, name: str) -> list[dict]:
    return list(csv.DictReader((run_dir / name).open()))


def _every_student_distilled_and_evaluated(run_dir: Path, baselines: tuple[str, ...] = ()) -> set[str]:
    promotions = json.loads((run_dir / "promotions.json").read_text())["pairs"]
    keys = {p["key"] for p in promotions.values()} | {f"baseline-{b}" for b in baselines}
    teachers = {"teacher"} | ({"teacher-d2d"} if "d2d" in baselines else set())
    ledger = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stage2" / "trials").glob("*.json")}
    assert set(ledger) == keys and {r["status"] for r in ledger.values()} == {"ok"}, {
        k: (r["status"], r["error"]) for k, r in ledger.items()
    }
    results = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stage3" / "results").glob("*.json")}
    assert set(results) == keys | teachers and {r["status"] for r in results.values()} == {"ok"}, results
    report = _rows(run_dir / "report", "distill.csv")
    assert {r["stage 2"] for r in report if "teacher" not in r["scoring"]} == {"ok @ 4"} and all(
        r["mean acc"] for r in report
    )
    assert len(report) == len(keys) + len(teachers)
    check_analysis(run_dir, keys | teachers)
    return keys


def test_shared_storage(cluster_runs):
    import mlflow

    work, results = cluster_runs
    r = results["shared"]
    assert r["rc"] == 0, r["stderr"][-3000:]
    run_dir = work / "hidden" / "shared-run"
    keys = _every_student_distilled_and_evaluated(run_dir, ("d2d",))
    check_d2d(
        run_dir, run_dir / "report"
    )  # searched on a worker, pruned by rank 0 into the storage, distilled from the dense twin
    for key in keys:  # the students live in the storage, not in the driver's run directory
        assert (work / "shared" / "run" / "stage2" / "students" / key / "model.safetensors").exists()
    assert not (run_dir / "stage2" / "students").exists() and not (run_dir / "stage2" / "init").exists()
    targets = [p for p in (work / "shared" / "run" / "targets").glob("*") if (p / "manifest.json").exists()]
    assert len(targets) == 2  # one targets pass per teacher (the MoE teacher, and the d2d baseline's dense teacher)
    timed = json.loads((run_dir / "run.json").read_text())[
        "stages"
    ]  # the targets pass is a stage of its own: the plan's targets row
    assert timed["targets"]["wall_s"] > 0 and timed["targets"]["runs"] == 1 and timed["stage2"]["runs"] == 2, (
        timed
    )  # + the resume below
    stored = {
        p.name for p in (work / "shared" / "run" / "data").rglob("*.txt")
    }  # the head's text files, through the storage
    assert stored == {"train.txt", "valid.txt", "test.txt"}, (
        stored
    )  # distillation, validation, and the d2d search's calibration/evaluation
    last = r["stderr"].strip().splitlines()[-3:]
    assert any(
        line.startswith(
            f"run done: students: {len(keys)} ok, 0 pruned, 0 failed, 0 diverged; {len(keys)} students evaluated"
        )
        for line in last
    ), last

    # the console shows the platform's own lines only; Ray/Tune/MLflow (and the workers') output is in RUN_DIR/logs/
    out = r["stdout"].strip().splitlines()
    assert len(out) == 1 and list(json.loads(out[0])["stages"]) == [
        "calibrate",
        "stage1",
        "targets",
        "stage2",
        "stage3",
        "analysis",
        "report",
    ]
    log = sorted((run_dir / "logs").glob("m2d-run-*.log"))[0].read_text()
    ours = {ln.removeprefix("[m2d] ") for ln in log.splitlines() if ln.startswith("[m2d] ")}
    shown = r["stderr"].strip().splitlines()
    assert set(shown) <= ours, [ln for ln in shown if ln not in ours]
    assert "== stage3 ==" in shown and "Configuration for experiment" in log and "RayTrainWorker" in log

    # one MLflow parent: stage-2 and stage-3 runs nested under it; the report is its artifact
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    try:
        runs = mlflow.search_runs(experiment_names=["m2d-tiny"], output_format="list")
        parents = [x for x in runs if "mlflow.parentRunId" not in x.data.tags]
        trials = {x.data.tags["m2d.trial"] for x in runs if "m2d.trial" in x.data.tags}
        assert (
            len(parents) == 1
            and {f"stage2/{k}" for k in keys} | {f"stage3/{k}" for k in keys} | {"stage3/teacher"} <= trials
        )
        names = {a.path for a in mlflow.MlflowClient().list_artifacts(parents[0].info.run_id, "report")}
        assert {"report/index.html", "report/distill.csv"} <= names
    finally:
        mlflow.set_tracking_uri(None)
    page = (run_dir / "report" / "index.html").read_text()
    for name in ("stage1_heatmap.png", "marginal.png", "curves.png", "overlap.png", "erank.png"):
        assert (run_dir / "report" / name).stat().st_size > 5000 and f'src="{name}"' in page, name

    # resuming the finished run redoes nothing; a resume with another stage-3 suite is refused
    again = results["shared_resume"]
    assert again["rc"] == 0 and not again["redone"] and again["wall_s"] < 90, again["stderr"][-2000:]
    other = results["shared_other_suite"]
    assert other["rc"] == 2 and "another suite" in other["stderr"]


def test_s3_storage_teacher_from_the_driver_and_resume_after_sigkill(cluster_runs):
    import mlflow

    work, results = cluster_runs
    r = results["s3"]
    assert r["killed_after"] and r["first_rc"] == -9, r  # killed during stage 2, after a first student
    assert r["rc"] == 0, r["stderr"][-3000:]
    assert "to distil" in r["stderr"]
    run_dir = work / "hidden" / "s3-run"
    keys = _every_student_distilled_and_evaluated(run_dir)
    objects = r["objects"]
    for key in keys:
        assert (
            f"run/stage2/students/{key}/model.safetensors" in objects
            and f"run/stage2/init/{key}/model.safetensors" in objects
        )
    assert any(
        o.startswith("run/teacher/teacher-") and o.endswith("model.safetensors") for o in objects
    )  # copied once for the workers
    assert {o.rsplit("/", 1)[1] for o in objects if o.startswith("run/data/") and not o.endswith("/")} == {
        "valid.txt"
    }  # the head's text, once
    assert "corpus/part-00000.parquet" in objects  # the distillation corpus: read from its S3 prefix, never copied
    assert all(f"run/analysis/{key}/batch-00000.jsonl" in objects for key in keys)  # the answers went to the storage
    # the stream tokenised once and the teacher's final hidden states computed once, in S3; the students read them from
    # there
    assert sum(o.startswith("run/tokens/") and o.endswith("manifest.json") for o in objects) == 1
    assert sum(o.startswith("run/targets/") and o.endswith("manifest.json") for o in objects) == 1
    assert any(o.startswith("run/targets/") and o.endswith(".safetensors") for o in objects)
    records = [json.loads(p.read_text()) for p in (run_dir / "stage2" / "trials").glob("*.json")]
    assert {r["targets"] for r in records} == {"hidden"} and all(r["peak_rss_bytes"] > 0 for r in records)
    assert any(o.startswith("run/tune/") for o in objects)
    # every student ended ok: its training state went once its distilled model was in S3 (the kill and resume included)
    assert not any(o.startswith(f"run/stage2/train/{key}/checkpoint_") for o in objects for key in keys)
    assert not (run_dir / "stage2" / "students").exists() and not (run_dir / "tune").exists()
    # one MLflow run per student and model across the kill and the resume
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    try:
        runs = mlflow.search_runs(experiment_names=["m2d-tiny"], output_format="list")
        trials = [x.data.tags["m2d.trial"] for x in runs if "m2d.trial" in x.data.tags]
        assert len(trials) == len(set(trials)) and {f"stage2/{k}" for k in keys} <= set(trials)
        assert len([x for x in runs if "mlflow.parentRunId" not in x.data.tags]) == 1
    finally:
        mlflow.set_tracking_uri(None)


def test_storage_does_not_change_the_results(cluster_runs):
    work, _ = cluster_runs
    shared, s3 = work / "hidden" / "shared-run", work / "hidden" / "s3-run"
    assert (shared / "stage1.csv").read_text() == (s3 / "stage1.csv").read_text()
    a = {p.stem: json.loads(p.read_text())["val_ppl"] for p in (shared / "stage2" / "trials").glob("*.json")}
    b = {p.stem: json.loads(p.read_text())["val_ppl"] for p in (s3 / "stage2" / "trials").glob("*.json")}
    a.pop("baseline-d2d")  # the d2d baseline runs on the shared-path run only
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-4 * a[k] for k in a), (a, b)


def test_a_node_that_cannot_see_the_storage_fails_its_units_with_one_line(cluster_runs):
    """The worker node has no view of a storage under the head's hidden directory: it finds no mark there the first
    time it works for the run, and each stage-1 trial it runs is recorded failed with one line naming the node and
    the storage; the run says so and produced nothing (exit 1)."""
    work, results = cluster_runs
    r = results["blind"]
    storage = work / "hidden" / "blind-storage"
    records = [json.loads(p.read_text()) for p in (work / "hidden" / "blind-run" / "trials").glob("*.json")]
    assert records and {x["status"] for x in records} == {"failed"}, records
    for x in records:
        assert re.match(
            rf"node [\d.]+ cannot see the run's storage {re.escape(str(storage))} \(Ray node [0-9a-f]{{12}}\); give "
            r"--storage",
            x["error"],
        ), x["error"]
    assert "'failed': 2" in r["stderr"] and r["rc"] == 1, r["stderr"][-2000:]
