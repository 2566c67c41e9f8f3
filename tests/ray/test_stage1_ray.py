"""Stage 1 on a local Ray (started once per session): Ray Data statistics, the grid end to end with
MLflow, dedupe + early stopping against the unpruned grid, failures, and resume after SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from m2d_ray.calibrate import calibrate
from m2d_ray.config import load_config
from m2d_ray.data.synthetic import corpus_text
from m2d_ray.data.text import calibration_set
from m2d_ray.pipeline import run_stages
from m2d_ray.shipped import EXPERIMENTS

TINY = EXPERIMENTS / "tiny.yaml"
#: a small, fast version of m2d_ray/experiments/tiny.yaml: 2 x 2 x 2 x K in {2, 4, 8, 16} = 32 configs
SMALL = [
    "calib.max_tokens=4096",
    "calib.seq_len=128",
    "eval.max_chars=40000",
    "eval.seq_len=128",
    "eval.chunks=4",
    "grid.scoring=[sf,do-acp]",
    "grid.grouping=[rr,oc]",
]


def _mlflow_runs(run_dir: Path) -> list:
    """All runs of the sweep's experiment, through mlflow.search_runs on the run directory's store."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    try:
        return mlflow.search_runs(experiment_names=["m2d-tiny"], output_format="list")
    finally:
        mlflow.set_tracking_uri(None)


def _cfg(*extra: str):
    return load_config(TINY, [*SMALL, *extra])


def _with_stats(src: Path, dst: Path) -> Path:
    """A new run directory that starts with `src`'s statistics (reused when they match: saves a calibration)."""
    dst.mkdir(parents=True)
    shutil.copytree(src / "stats", dst / "stats")
    return dst


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_ray_data_statistics_equal_single_process(ray_address, tiny_teacher_dir, tiny_teacher, tmp_path, stream):
    from m2d_ray.calibrate.ray_data import calibrate_ray

    tokens = calibration_set(
        tiny_teacher.tokenizer, corpus_text("valid", max_chars=30_000), seq_len=64, max_tokens=3000
    )
    tokens.mask[-1, 40:] = 0  # padding inside the last sequence must be masked alike
    single, _ = calibrate(tiny_teacher, tokens, "x", out=tmp_path / "single", batch_size=4, progress=False)
    dist, reused = calibrate_ray(
        str(tiny_teacher_dir), tokens, "x", tmp_path / "ray", batch_size=4, actors=2, stream=stream
    )
    assert (
        not reused
        and dist.manifest["model"] == single.manifest["model"]
        and dist.manifest["data"] == single.manifest["data"]
    )
    for i, st in single.layers.items():
        for name, a in st.to_tensors("").items():
            b = dist.layers[i].to_tensors("")[name]
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12 * float(a.abs().max())), (i, name)
    assert int(dist.layers[0].tokens) == tokens.n_tokens
    if not stream:  # the actors' partial sums are added in the blocks' order: the same bits on every run
        again, _ = calibrate_ray(
            str(tiny_teacher_dir), tokens, "x", tmp_path / "ray2", batch_size=4, actors=2, stream=stream
        )
        assert again.checksum == dist.checksum
    # the single-process artifact is reused by the Ray path (same contract)
    assert calibrate_ray(str(tiny_teacher_dir), tokens, "x", tmp_path / "single", batch_size=4)[1]


@pytest.fixture(scope="module")
def pruned_run(ray_address, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stage1") / "run"
    return run_stages(_cfg(), run_dir, "calibrate", "stage1")["stage1"]


def test_grid_end_to_end_with_mlflow(pruned_run):
    import mlflow

    res, run_dir = pruned_run, pruned_run.run_dir
    assert len(res.records) == 32 and len({r["key"] for r in res.records}) == 32
    for name in (
        "stage1.csv",
        "stage1.md",
        "stage1_heatmap.png",
        "promotions.json",
        "mlflow.db",
        "stats/manifest.json",
    ):
        assert (run_dir / name).exists(), name
    assert len((run_dir / "stage1.csv").read_text().splitlines()) == 1 + 8  # rows: 2 x 2 x 2, columns K
    promos = json.loads((run_dir / "promotions.json").read_text())["pairs"]
    assert set(promos) == {"sf/rr", "sf/oc", "do-acp/rr", "do-acp/oc"}

    client = mlflow.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = _mlflow_runs(run_dir)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1 and len(children) == 32
    assert parents[0].data.params["stats_sha256"] == json.loads((run_dir / "stats/manifest.json").read_text())["sha256"]
    assert {a.path for a in client.list_artifacts(parents[0].info.run_id)} >= {
        "stage1.csv",
        "stage1.md",
        "stage1_heatmap.png",
        "promotions.json",
    }
    by_key = {r.data.tags["m2d.trial"]: r for r in children}
    for rec in res.records:
        run = by_key[rec["key"]]
        assert run.data.params["scoring"] == rec["scoring"] and run.data.params["K"] == str(rec["K"])
        assert run.data.tags["status"] == rec["status"]
        if rec["status"] == "ok":
            assert run.data.metrics["perplexity"] == pytest.approx(rec["ppl"])
        if rec["duplicate_of"]:
            assert run.data.tags["duplicate_of"] == rec["duplicate_of"]
    partial = client.get_metric_history(by_key[res.records[0]["key"]].info.run_id, "partial_perplexity")
    assert len(partial) >= 1


def test_dedupe_and_early_stopping_keep_the_unpruned_winners(pruned_run, tmp_path):
    full = run_stages(
        _cfg("search.dedupe=false", "search.early_stop=false"),
        _with_stats(pruned_run.run_dir, tmp_path / "full"),
        "calibrate",
        "stage1",
    )["stage1"]
    assert full.evaluated == full.full_evaluations == 32
    statuses = [r["status"] for r in pruned_run.records]
    assert pruned_run.probed < 32 and statuses.count("pruned") > 0  # dedupe and pruning both acted
    assert pruned_run.full_evaluations < full.full_evaluations and pruned_run.chunks_evaluated < full.chunks_evaluated

    def win(res):
        return {p: (v["K"], v["scaling"]) for p, v in res.promotions.items()}

    assert win(pruned_run) == win(full)
    full_ppl = {r["key"]: r["ppl"] for r in full.records}
    for r in pruned_run.records:  # shared results equal the ones evaluated separately
        if r["status"] == "ok":
            assert r["ppl"] == pytest.approx(full_ppl[r["key"]], rel=1e-9)


def test_failed_and_diverged_trials_are_recorded_and_the_sweep_goes_on(pruned_run, tmp_path):
    cfg = _cfg(
        "grid.scoring=[sf]",
        "grid.grouping=[rr]",
        "grid.scaling=[uniform]",
        "grid.K=[2,4,8]",
        "faults.raise_in=[sf_rr_uniform_K4]",
        "faults.nan_in=[sf_rr_uniform_K8]",
    )
    res = run_stages(cfg, _with_stats(pruned_run.run_dir, tmp_path / "faults"), "calibrate", "stage1")["stage1"]
    status = {r["key"]: r for r in res.records}
    assert status["sf_rr_uniform_K2"]["status"] == "ok"
    assert (
        status["sf_rr_uniform_K4"]["status"] == "failed" and "injected failure" in status["sf_rr_uniform_K4"]["error"]
    )
    assert status["sf_rr_uniform_K8"]["status"] == "diverged" and status["sf_rr_uniform_K8"]["ppl"] is None
    assert "| -- |" in (res.run_dir / "stage1.md").read_text()
    assert res.promotions["sf/rr"]["K"] == 2


def test_resume_after_sigkill(ray_address, tmp_path):
    run_dir = tmp_path / "killed"  # a new run: `--out` refuses a directory m2d did not make
    args = [
        sys.executable,
        "-m",
        "m2d_ray.cli",
        "sweep",
        str(TINY),
        "--out",
        str(run_dir),
        *SMALL,
        "ray.max_concurrent_trials=1",
    ]
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    trials, deadline = run_dir / "trials", time.time() + 240
    while time.time() < deadline and proc.poll() is None and len(list(trials.glob("*.json"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {p.stem: p.read_text() for p in trials.glob("*.json")}
    assert proc.returncode == -signal.SIGKILL and 3 <= len(before) < 32, (
        proc.returncode,
        len(before),
        proc.stderr.read()[-2000:],
    )

    out = subprocess.run(
        [sys.executable, "-m", "m2d_ray.cli", "sweep", "--resume", str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    after = {p.stem: p.read_text() for p in trials.glob("*.json")}
    assert len(after) == 32 and summary["configs"] == 32
    changed = [k for k, v in before.items() if after[k] != v]
    assert not changed, (changed, before[changed[0]], after[changed[0]])  # finished trials were not re-run
    new = [json.loads(v) for k, v in after.items() if k not in before]
    assert {r["attempt"].rsplit("-", 1)[1] for r in new if r["duplicate_of"] not in before} == {"2"}

    runs = _mlflow_runs(run_dir)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    keys = [r.data.tags["m2d.trial"] for r in runs if "m2d.trial" in r.data.tags]
    assert len(parents) == 1 and sorted(keys) == sorted(after)  # one run per config, no duplicates
    running = [
        (r.data.tags.get("mlflow.runName"), r.data.tags.get("status")) for r in runs if r.info.status == "RUNNING"
    ]
    assert not running, (running, out.stderr[-3000:])


def test_named_recipes_skip_the_search_and_are_promoted_in_their_order(ray_address, tmp_path):
    """stage2.recipes: calibration, then the recipes planned from its statistics (one Ray task) and promoted as named,
    with no trial; stage 2's students are the recipes (in their order) and the baselines; the plan has no stage-1
    work and counts the recipes' students."""
    from m2d_ray import pipeline
    from m2d_ray.models import default_teacher, model_config
    from m2d_ray.plan.run_plan import Devices
    from m2d_ray.run_dir import RunDir
    from m2d_ray.stages.students import todo

    cfg = _cfg("stage2.recipes=[sf/oc/K8/proportional,do-acp/rr/K2/uniform]", "plan.cpu_flops=1e9")
    run_stages(cfg, tmp_path / "run", "calibrate", "stage1")
    rd = RunDir(tmp_path / "run")
    promotions = rd.read_promotions()
    assert promotions["order"] == ["sf/oc", "do-acp/rr"] and promotions["criterion"].startswith("named")
    sf = promotions["pairs"]["sf/oc"]
    assert (sf["K"], sf["scaling"], sf["ppl"], sf["key"]) == (8, "proportional", None, "sf_oc_proportional_K8")
    plans = rd.read_plans()["plans"]
    assert set(plans) == {"sf_oc_proportional_K8", "do-acp_rr_uniform_K2"}
    assert sf["signature"] == plans["sf_oc_proportional_K8"]["signature"]
    assert rd.stage1_ledger().records() == []  # no search: no trial ran
    keys = [s.key for s in todo(rd, cfg).all]
    assert keys == ["sf_oc_proportional_K8", "do-acp_rr_uniform_K2", *(f"baseline-{b}" for b in cfg.stage2.baselines)]
    plan = pipeline.plan(cfg, model_config(default_teacher()), Devices(host_memory=8 << 30))
    assert "stage1" not in plan.cost.by_name() and plan.cost.by_name()["stage2"].units == len(keys)
