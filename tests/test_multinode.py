"""`m2d run` on a two-node Ray cluster whose worker node cannot see the driver's disk (tests/multinode.py).

One cluster for the module, in a private PID namespace: a head with no CPUs and a worker in its own
mount namespace with the runs' driver directories hidden under a tmpfs. Storage on a shared directory,
then on S3 (moto on 127.0.0.1) with the teacher on the driver's disk and the driver SIGKILLed mid-run.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _can_simulate() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ray") is None:
        return "needs unshare and the ray CLI"
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return "needs moto[server] (pip install -e '.[test]')"
    from importlib.metadata import version

    if tuple(int(x) for x in version("moto").split(".")[:3]) < (5, 2, 5):
        return "needs moto >= 5.2.5 (5.2.1's CompleteMultipartUpload reply breaks pyarrow): pip install -e '.[test]'"
    probe = subprocess.run(["unshare", "-pf", "--mount-proc", "unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    return None if probe.returncode == 0 else f"cannot make PID/mount namespaces here (root needed): {probe.stderr.decode()[:200]}"


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory):
    why = _can_simulate()
    if why:
        pytest.skip(why)
    work = tmp_path_factory.mktemp("multinode")
    proc = subprocess.run(["unshare", "-pf", "--mount-proc", sys.executable, str(HERE / "multinode.py"), str(work)],
                          capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((work / "results.json").read_text())
    return work, results


def _rows(run_dir: Path, name: str) -> list[dict]:
    return list(csv.DictReader((run_dir / name).open()))


def _every_student_distilled_and_evaluated(run_dir: Path) -> set[str]:
    promotions = json.loads((run_dir / "promotions.json").read_text())["pairs"]
    keys = {p["key"] for p in promotions.values()} | {"baseline-random-init"}
    ledger = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stage2" / "trials").glob("*.json")}
    assert set(ledger) == keys and {r["status"] for r in ledger.values()} == {"ok"}, {k: (r["status"], r["error"]) for k, r in ledger.items()}
    results = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stage3" / "results").glob("*.json")}
    assert set(results) == keys | {"teacher"} and {r["status"] for r in results.values()} == {"ok"}, results
    report = _rows(run_dir / "report", "distill.csv")
    assert {r["stage 2"] for r in report if r["scoring"] != "teacher"} == {"ok @ 4"} and all(r["mean acc"] for r in report)
    assert len(report) == len(keys) + 1
    return keys


def test_shared_storage(cluster_runs):
    work, results = cluster_runs
    r = results["shared"]
    assert r["rc"] == 0, r["stderr"][-3000:]
    run_dir = work / "hidden" / "shared-run"
    keys = _every_student_distilled_and_evaluated(run_dir)
    for key in keys:  # the students live in the storage, not in the driver's run directory
        assert (work / "shared" / "run" / "stage2" / "students" / key / "model.safetensors").exists()
    assert not (run_dir / "stage2" / "students").exists() and not (run_dir / "stage2" / "init").exists()
    last = r["stderr"].strip().splitlines()[-3:]
    assert any(line.startswith(f"run done: students: {len(keys)} ok, 0 pruned, 0 failed, 0 diverged; {len(keys)} students evaluated") for line in last), last


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
        assert f"run/stage2/students/{key}/model.safetensors" in objects and f"run/stage2/init/{key}/model.safetensors" in objects
    assert any(o.startswith("run/teacher/teacher-") and o.endswith("model.safetensors") for o in objects)  # copied once for the workers
    assert any(o.startswith("run/stage2/train/") for o in objects) and any(o.startswith("run/tune/") for o in objects)
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
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-4 * a[k] for k in a), (a, b)
