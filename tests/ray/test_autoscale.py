"""`m2d run` on Ray's own autoscaler (tests/ray/autoscale.py): scale from zero, nodes lost mid-run, and the
node types of cluster.yaml.

A fake autoscaling cluster in private PID, mount and network namespaces; its worker node types are derived from
cluster.yaml. Runs of the same tiny config: plain, and asking stage 2 for a GPU no node type has (it fails, exit 2)
in the default suite (~6 min here); slow (`-m slow`, ~12 min on a cluster of their own, beside a plain run to compare
with): a node reclaimed in each stage (calibration, stage 1, stage 2, stage 3; ray.max_failures=1), and
ray.max_failures=0 with a node reclaimed during stage 2 (that student fails, the run goes on). Node loss mid-run stays
in the default suite through tests/ray/test_multinode.py's driver SIGKILL and resume.
"""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from autoscale import FAKE_GPU, FAKE_HEAD, IDLE_MINUTES, autoscaler_config, node_types
from conftest import ROOT, multinode_unavailable, script_env

HERE = Path(__file__).resolve().parent
WORKER_TYPES = set(node_types()[1])
VOLATILE = {
    "tokens_per_s",
    "peak_rss_bytes",
    "peak_cuda_bytes",
    "peak_work_bytes",
    "eval_s",
    "attempt",
}  # wall times, memory peaks, attempt ids


# ---- cluster.yaml and the test's node types (no Ray) -------------------------------------------------
def test_node_types_are_cluster_yamls(tmp_path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = cfg["available_node_types"]
    head, workers = node_types()
    assert set(workers) == set(types) - {cfg["head_node_type"]} and workers
    for name, t in workers.items():
        want = {k: v for k, v in types[name]["resources"].items() if k != "GPU"} | (
            {FAKE_GPU: types[name]["resources"]["GPU"]} if types[name]["resources"].get("GPU") else {}
        )
        assert {k: v for k, v in t["resources"].items() if k != "object_store_memory"} == want, name
        assert types[name].get("min_workers", 0) == t["min_workers"] == 0, f"{name}: the cluster scales from zero"
        assert t["resources"]["CPU"] >= 2, f"{name}: a stage-2 student (trial + Train worker) must fit one node"
    assert head["CPU"] == 0 and not types[cfg["head_node_type"]]["resources"].get("GPU"), "no GPU work on the head"
    # Ray's own schema accepts the fake cluster's config
    validate_config(prepare_config(autoscaler_config(workers, head)))
    # a change to cluster.yaml's types changes the test's
    changed = tmp_path / "cluster.yaml"
    first = sorted(workers)[0]
    types[first]["resources"]["CPU"] += 1
    types["gpu_new_type"] = {**types[first], "resources": {"CPU": 4, "GPU": 2, "accelerator_type:L4": 1}}
    changed.write_text(yaml.safe_dump(cfg))
    head2, workers2 = node_types(changed)
    assert workers2[first]["resources"]["CPU"] == workers[first]["resources"]["CPU"] + 1
    assert workers2["gpu_new_type"]["resources"] == {
        "CPU": 4,
        FAKE_GPU: 2,
        "accelerator_type:L4": 1,
        "object_store_memory": 300_000_000,
    }
    assert FAKE_HEAD not in workers2


# ---- the runs ----------------------------------------------------------------------------------------
def _autoscaled(tmp_path_factory, runs: list[str]) -> tuple[Path, dict]:
    """The `runs` of tests/ray/autoscale.py on a fake autoscaling cluster of their own: (work dir, results)."""
    why = multinode_unavailable()
    if why:
        pytest.skip(why)
    if shutil.which("ip") is None:
        pytest.skip("needs ip (iproute2) to bring up the loopback of a network namespace")
    probe = subprocess.run(
        ["unshare", "-pfn", "--mount-proc", "ip", "link", "set", "lo", "up"], capture_output=True, text=True
    )
    if probe.returncode:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr[:200]}")
    work = tmp_path_factory.mktemp("autoscale")
    with (work / "autoscale.stderr").open("w") as err:  # progress (each run's console lines) on stdout: shown with -s
        proc = subprocess.run(
            ["unshare", "-pfn", "--kill-child", "--mount-proc", sys.executable, str(HERE / "autoscale.py"), str(work)]
            + runs,
            env=script_env(),
            stderr=err,
            timeout=2700,
        )
    results = json.loads((work / "results.json").read_text()) if (work / "results.json").exists() else {}
    assert proc.returncode == 0 and set(runs) <= set(results), (work / "autoscale.stderr").read_text()[-3000:]
    for name in [n for n in runs if n != "unservable"]:  # the autoscaler's record, per stage (shown with -s)
        r = results[name]
        print(
            f"\n{name}: rc {r['rc']}, {r['wall_s']} s, nodes gone {r['scale_down_s']} s after the run; kills: "
            f"{[k['when'] for k in r['kills']]}"
        )
        for stage, p in r["phases"].items():
            print(
                f"  {stage:12s} {p['wall_s']:6.1f} s  nodes up at start {p['up_at_start']}  launched {p['launched']}  "
                f"removed {p['removed']}"
            )
    return work, results


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory):
    return _autoscaled(tmp_path_factory, ["plain", "unservable"])


@pytest.fixture(scope="module")
def autoscaled_faults(tmp_path_factory):
    return _autoscaled(tmp_path_factory, ["plain", "lost", "failed"])


def _line(r: dict) -> str:
    return next(line for _, line in reversed(r["lines"]) if line.startswith("run done: "))


def _ledger(run_dir: Path, sub: str, name: str) -> dict:
    """A ledger's records without wall times and with the run's own storage path made neutral."""
    out = {}
    for p in sorted((run_dir / sub).glob("*.json")):
        r = {k: v for k, v in json.loads(p.read_text()).items() if k not in VOLATILE}
        out[p.stem] = json.loads(json.dumps(r).replace(f"/shared/{name}/", "/shared/RUN/"))
    return out


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _mlflow(run_dir: Path) -> dict:
    """Nested MLflow runs by trial tag (each once), with each student's val_ppl history."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    try:
        client = mlflow.MlflowClient()
        runs = mlflow.search_runs(experiment_names=["m2d-tiny"], output_format="list")
        trials = [x.data.tags["m2d.trial"] for x in runs if "m2d.trial" in x.data.tags]
        assert len(trials) == len(set(trials)), trials  # nothing logged twice
        assert len([x for x in runs if "mlflow.parentRunId" not in x.data.tags]) == 1
        return {
            x.data.tags["m2d.trial"]: [
                (m.step, round(m.value, 6)) for m in client.get_metric_history(x.info.run_id, "val_ppl")
            ]
            for x in runs
            if "m2d.trial" in x.data.tags
        }
    finally:
        mlflow.set_tracking_uri(None)


def test_scale_from_zero(autoscaled):
    work, results = autoscaled
    r = results["plain"]
    assert r["rc"] == 0, r["lines"][-20:]
    assert r["up_before"] == 0 and r["kills"] == []
    phases = r["phases"]
    assert list(phases)[:4] == ["calibration", "stage1", "stage2", "stage3"]
    assert phases["calibration"]["up_at_start"] == 0 and phases["calibration"]["launched"], (
        phases
    )  # launched for calibration
    for stage in (
        "calibration",
        "stage1",
        "stage2",
        "stage3",
    ):  # the head has no CPUs: each stage ran on launched nodes
        assert phases[stage]["up_at_start"] + len(phases[stage]["launched"]) > 0, (stage, phases)
    launched = [e["type"] for e in r["events"] if e["event"] == "launch"]
    assert launched and set(launched) <= WORKER_TYPES, launched
    # every node goes away after idle_timeout_minutes (+ the autoscaler's 1 s updates)
    assert r["scale_down_s"] is not None and r["scale_down_s"] <= IDLE_MINUTES * 60 + 30, r["scale_down_s"]
    removed = [e for e in r["events"] if e["event"] == "remove"]
    assert sum(e["n"] for e in removed) == len(launched) and {e["why"] for e in removed} == {"idle"}, removed
    # the same outcome as on a fixed cluster: every promoted student distilled and evaluated, the teacher too
    run_dir = work / "hidden" / "plain"
    assert (
        _line(r) == "run done: students: 2 ok, 0 pruned, 0 failed, 0 diverged; 2 students evaluated; teacher evaluated"
    )
    promoted = {p["key"] for p in json.loads((run_dir / "promotions.json").read_text())["pairs"].values()}
    assert set(_ledger(run_dir, "stage2/trials", "plain")) == promoted
    stored = {
        p.name for p in (work / "shared" / "plain" / "data").rglob("*.txt")
    }  # the head's text reached the nodes through the storage
    assert stored == {"train.txt", "valid.txt"}, stored


def _retried_from(work: Path, name: str) -> dict[str, list[int]]:
    """Per student, the steps its Train runs resumed from (every report carries `resumed_from`), from Tune's results in
    the storage."""
    out: dict[str, set[int]] = {}
    for f in (work / "shared" / name / "stage2" / "tune").rglob("result.json"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if "resumed_from" in rec and "student" in rec.get("config", {}):
                out.setdefault(rec["config"]["student"]["key"], set()).add(rec["resumed_from"])
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.slow
def test_lost_nodes_are_replaced_and_their_trials_retried(autoscaled_faults):
    work, results = autoscaled_faults
    r, plain = results["lost"], results["plain"]
    assert r["rc"] == 0, r["lines"][-20:]
    assert [k["when"] for k in r["kills"]] == ["in_calibration", "in_stage1", "in_stage2", "in_stage3"] and not r[
        "missed_kills"
    ], r["kills"]
    titles = [
        "ray::MapWorker",
        "ray::ImplicitFunc",
        "ray::ImplicitFunc",
        "ray::_evaluate_task",
    ]  # the work that was on the node
    assert all(k["trial_process"].startswith(t) for k, t in zip(r["kills"], titles)), r["kills"]
    phases = r["phases"]
    for stage in ("stage1", "stage2"):  # the autoscaler replaced the reclaimed node in that stage
        assert any(x.endswith("(reclaimed)") for x in phases[stage]["removed"]) and phases[stage]["launched"], (
            stage,
            phases,
        )
    for stage in ("calibration", "stage3"):  # lost there too (its work was retried on the nodes left or launched)
        assert any(x.endswith("(reclaimed)") for x in phases[stage]["removed"]), (stage, phases)
    # the stage-2 student on the lost node went on from its checkpoint (step 40), not from step 0
    assert any(40 in steps for steps in _retried_from(work, "lost").values()), _retried_from(work, "lost")
    assert not any(s != [0] for s in _retried_from(work, "plain").values())
    # nothing recorded is lost or duplicated: the same tables, ledgers and MLflow runs as without the kills
    a, b = work / "hidden" / "plain", work / "hidden" / "lost"
    assert _line(r) == _line(plain)
    for f in ("stage1.csv", "promotions.json"):
        assert (a / f).read_text() == (b / f).read_text(), f
    for sub in ("trials", "stage2/trials", "stage3/results"):
        x, y = _ledger(a, sub, "plain"), _ledger(b, sub, "lost")
        assert _close(x, y), (sub, x, y)

    def rows(d):
        return [
            {k: v for k, v in row.items() if k not in VOLATILE} for row in csv.DictReader((d / "stage2.csv").open())
        ]

    assert [row.pop("student_path").replace("/plain/", "/") for row in rows(a)] == [
        row.pop("student_path").replace("/lost/", "/") for row in rows(b)
    ]
    assert _close(_mlflow(a), _mlflow(b))


@pytest.mark.slow
def test_a_node_lost_more_often_than_max_failures_fails_that_student_only(autoscaled_faults):
    work, results = autoscaled_faults
    r = results["failed"]
    assert r["rc"] == 0, r["lines"][-20:]
    assert [k["when"] for k in r["kills"]] == ["in_stage2"], r["kills"]
    ledger = _ledger(work / "hidden" / "failed", "stage2/trials", "failed")
    status = sorted(x["status"] for x in ledger.values())
    assert status == ["failed", "ok"], ledger
    failed = next(x for x in ledger.values() if x["status"] == "failed")
    # in the user's words, Ray's own error in the run's log
    assert re.match(
        r"node 127\.0\.0\.\d+ lost during stage 2 \(spot reclaim or crash\); retried 0 of 0 times \(Ray's error: "
        r".*\.log\)$",
        failed["error"],
    ), failed["error"]
    assert (
        _line(r) == "run done: students: 1 ok, 0 pruned, 1 failed, 0 diverged; 1 students evaluated; teacher evaluated"
    ), _line(r)
    # the student that was not on the lost node is the plain run's
    ok = next(k for k, x in ledger.items() if x["status"] == "ok")
    assert _close(_ledger(work / "hidden" / "plain", "stage2/trials", "plain")[ok], ledger[ok])


def test_a_request_no_node_type_holds_fails_its_stage_on_the_autoscaler_s_word(autoscaled):
    """distill.gpus_per_worker=1 on a CPU-only autoscaling cluster whose node types the driver cannot read: stage 2
    fails within about a minute of waiting, with one line, exit 2, and stage 3 never starts; its first request is
    the d2d baseline's search task, which goes through the stage's waiter like every other."""
    work, results = autoscaled
    r = results["unservable"]
    assert r["rc"] == 2, r["lines"][-20:]
    last = r["lines"][-1][1]
    assert last.startswith("m2d: error: stage2: the autoscaler reports that no node type can hold {CPU: 1, GPU: 1}"), (
        last
    )
    assert "distill.gpus_per_worker" in last and any(t in last for t in WORKER_TYPES), (
        last
    )  # the keys, and the types it runs
    start2 = next(t for t, line in r["lines"] if line.startswith("== stage2 =="))
    assert r["t1"] - start2 < 150, r["t1"] - start2  # the autoscaler reports every 30 s; no waiting for ever
    assert not any(line.startswith("== stage3 ==") for _, line in r["lines"])
    assert any("d2d: pruning" in line for _, line in r["lines"])  # it was the search that waited
