"""Stage 2 on the session's Ray: real DeepSpeed ZeRO-2 on 2 CPU workers, kill + resume, and the stage-2
sweep (ASHA, ledger, MLflow, native students) on a finished stage 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from m2d_ray.config import load_config
from m2d_ray.pipeline import run_stages
from m2d_ray.shipped import EXPERIMENTS

TINY = EXPERIMENTS / "tiny.yaml"
SMALL_DISTILL = ["distill.seq_len=64", "distill.batch_size=4", "distill.eval_max_tokens=2048", "distill.warmup_steps=2"]


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def _distill(out: Path, steps: int, *more: str) -> list[str]:
    """`m2d distill` of a random-FFN student on the synthetic corpus into `out`, `steps` steps, and `more`."""
    data = ["--train-data", "synthetic:train", "--eval-data", "synthetic:valid"]
    cmd = [sys.executable, "-m", "m2d_ray.cli", "distill", "--student", "random-ffn", *data]
    return [*cmd, "--steps", str(steps), "--out", str(out), *more]


@pytest.mark.slow
@pytest.mark.parametrize("shard", [[], ["--shard-teacher"]], ids=["online", "sharded"])
def test_deepspeed_zero2_on_two_cpu_workers_killed_and_resumed(ray_address, ds_env, tmp_path, shard):
    """`m2d distill` on two Ray Train workers with ZeRO-2, SIGKILLed and resumed (~2 min each here: slow), its teacher
    whole on each rank or sharded over them (a frozen teacher is read again from its checkpoint on resume, not saved).
    In the default run: ZeRO-2 over two ranks in test_distill_ranks.py, a sharded run's resume without Ray in
    test_sharded_teacher.py, a killed run's resume in test_multinode.py (`m2d run`'s driver SIGKILLed in stage 2)."""
    out = tmp_path / "distill"
    args = _distill(
        out,
        24,
        "--workers",
        "2",
        "--deepspeed",
        *shard,
        "lr=3e-3",
        "eval_every=4",
        "seq_len=64",
        "batch_size=2",
        "eval_max_tokens=1024",
        "warmup_steps=2",
        "--keep-training-state",
    )
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.time() + 400
    while max(_steps(out / "metrics.jsonl"), default=0) < 8 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    seen = max(_steps(out / "metrics.jsonl"), default=0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 8 <= seen < 24, proc.stderr.read()[-2000:]
    assert not (out / "result.json").exists()

    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 24 and result["resumed_from"] >= 8, result  # continued from a checkpoint, not step 0
    assert result["targets"] == ("online, sharded" if shard else "online"), result
    steps = _steps(out / "metrics.jsonl")
    assert steps[: steps.index(seen) + 1] == list(range(4, seen + 1, 4)) and steps[-1] == 24
    assert result["last_val_ppl"] < result["first_val_ppl"]
    assert "[distill distill] step 24" in done.stderr  # progress lines reach the driver
    # ZeRO-2 over two ranks: each rank saved its own optimizer partition into the same checkpoint
    ckpt = sorted(p for p in (out / "train").glob("checkpoint_*") if p.is_dir())[-1] / "state"
    assert {p.name for p in ckpt.glob("zero_pp_rank_*_optim_states.pt")} == {
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)
    }
    student = AutoModelForCausalLM.from_pretrained(result["student"])
    assert type(student).__name__ == "Qwen3ForCausalLM"
    # a finished run is not silently redone; --overwrite replaces it once the new student is done
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds a finished distillation" in again.stderr
    assert again.stderr.count("\n") == 1  # one line
    small = ["eval_every=2", "seq_len=64", "batch_size=2", "eval_max_tokens=1024", "warmup_steps=1"]
    redo = _distill(out, 4, "--no-deepspeed", "--overwrite", *small)
    redo = subprocess.run(redo, env=env, capture_output=True, text=True, timeout=300)
    assert redo.returncode == 0, redo.stderr[-3000:]
    assert json.loads((out / "result.json").read_text())["steps"] == 4 and json.loads(
        redo.stdout.strip().splitlines()[-1]
    )["student"] == str(out / "student")
    assert [p.name for p in tmp_path.iterdir()] == ["distill"]  # the staging directory was swapped in
    assert AutoModelForCausalLM.from_pretrained(out / "student") is not None and list(
        (out / "logs").glob("m2d-distill-*.log")
    )


@pytest.mark.slow
def test_a_teacher_sharded_over_two_ray_train_workers_beside_zero2_trains_as_online(ray_address, ds_env, tmp_path):
    """`m2d distill --shard-teacher` on two Ray Train workers (gloo), the student under DeepSpeed ZeRO-2, the teacher
    sharded over the same process group: the validations of the online run, step by step (~2 min here: slow; the
    default suite checks the sharded loss on two gloo ranks without Ray, tests/unit/test_sharded_teacher.py)."""
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    runs = {}
    for name, flags in (("online", []), ("sharded", ["--shard-teacher"])):
        args = [
            sys.executable, "-m", "m2d_ray.cli", "distill", "--student", "random-ffn", "--train-data",
            "synthetic:train", "--eval-data", "synthetic:valid", "--steps", "4", "--workers", "2", "--deepspeed",
            *flags, "--out", str(tmp_path / name), "lr=3e-3", "eval_every=2", "seq_len=64", "batch_size=2",
            "eval_max_tokens=1024", "warmup_steps=1",
        ]  # fmt: skip
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert json.loads(done.stdout.strip().splitlines()[-1])["targets"] == ("online, sharded" if flags else "online")
    assert [m["step"] for m in runs["sharded"]] == [2, 4]
    for a, b in zip(runs["sharded"], runs["online"]):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5) and a["train_loss"] == pytest.approx(
            b["train_loss"], rel=1e-5
        )


@pytest.fixture(scope="module")
def stage1_dir(ray_address, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("stage2") / "run"
    cfg = load_config(
        TINY,
        [
            "calib.max_tokens=4096",
            "calib.seq_len=128",
            "eval.max_chars=20000",
            "eval.seq_len=128",
            "eval.chunks=1",
            "grid.scoring=[sf]",
            "grid.grouping=[rr]",
            "grid.scaling=[uniform]",
            "grid.K=[2]",
        ],
    )
    run_stages(cfg, run_dir, "calibrate", "stage1")["stage1"]
    return run_dir


def test_stage2_sweep_asha_mlflow_and_native_students(stage1_dir):
    import mlflow
    import ray

    overrides = [
        "stage=2",
        "distill.steps=12",
        "distill.eval_every=3",
        "distill.deepspeed=false",
        *SMALL_DISTILL,
        "stage2.baselines=[random-init,random-ffn]",
        "faults.raise_in=[baseline-random-ffn]",
        "stage2.grace_evals=1",
        "stage2.reduction_factor=2",
        "stage2.max_concurrent_trials=1",
        "stage2.asha=true",
    ]
    cfg = load_config(stage1_dir / "config.yaml", overrides)
    records = {r["key"]: r for r in run_stages(cfg, stage1_dir, "targets", "stage2")["stage2"].records}
    promotions = json.loads((stage1_dir / "promotions.json").read_text())["pairs"]
    best = min(promotions.values(), key=lambda p: p["ppl"])["key"]
    assert set(records) == {p["key"] for p in promotions.values()} | {"baseline-random-init", "baseline-random-ffn"}
    failed = records["baseline-random-ffn"]  # a trial that raises is recorded and the sweep goes on
    assert failed["status"] == "failed" and "injected failure in baseline-random-ffn" in failed["error"]

    first = records[best]
    assert first["status"] == "ok" and first["steps"] == 12 and first["val_ppl"] < first["val_ppl_initial"]
    assert [s for s, _ in first["curve"]] == [0, 3, 6, 9, 12] and first["curve"][0][1] == first["val_ppl_initial"]
    student = AutoModelForCausalLM.from_pretrained(first["student_path"])
    assert type(student).__name__ == "Qwen3ForCausalLM"
    # the deliberately bad student (random init, ppl ~ vocabulary size) is stopped by ASHA at its first rung
    bad = records["baseline-random-init"]
    assert bad["status"] == "pruned" and bad["steps"] < 12 and bad["student_path"] is None
    assert bad["val_ppl"] > 10 * first["val_ppl"]
    # an ended student's Train checkpoints (its DeepSpeed state at scale) are gone; its distilled model stays
    train = stage1_dir / "stage2" / "train"
    assert (
        not (train / best).exists()
        and not (train / "baseline-random-init").exists()
        and (Path(first["student_path"]) / "config.json").exists()
    )
    rows = (stage1_dir / "stage2.csv").read_text().splitlines()
    assert len(rows) == 1 + len(records) and rows[1].startswith(best)
    for name in ("stage2.md", "stage2_curves.png", "stage2/config.yaml"):
        assert (stage1_dir / name).exists(), name

    mlflow.set_tracking_uri(f"sqlite:///{stage1_dir / 'mlflow.db'}")
    try:
        runs = {
            r.data.tags["m2d.trial"]: r
            for r in mlflow.search_runs(experiment_names=["m2d-tiny"], output_format="list")
            if r.data.tags.get("m2d.trial", "").startswith("stage2/")
        }
        parent = {r.data.tags["mlflow.parentRunId"] for r in runs.values()}
        assert set(runs) == {f"stage2/{k}" for k in records} and len(parent) == 1
        run = runs[f"stage2/{best}"]
        assert (
            run.data.tags["status"] == "ok"
            and run.data.tags["student_path"] == first["student_path"]
            and run.info.status == "FINISHED"
        )
        history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "val_ppl")
        assert sorted(m.step for m in history) == [0, 3, 6, 9, 12]
        assert {"tokens_per_s", "mfu", "train_s", "eval_s", "ckpt_s"} <= set(
            run.data.metrics
        )  # training-only throughput + the rest
        assert (
            runs["stage2/baseline-random-init"].info.status == "KILLED"
            and runs["stage2/baseline-random-ffn"].info.status == "FAILED"
        )
    finally:
        mlflow.set_tracking_uri(None)

    # stopped students ended their Train runs cleanly: no placement group is left holding CPUs
    time.sleep(2)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]
    # resuming a finished stage 2 distils nothing again but retries the failed student (it fails again here)
    t0 = time.time()
    assert {r["key"]: r["status"] for r in run_stages(cfg, stage1_dir, "targets", "stage2")["stage2"].records} == {
        k: r["status"] for k, r in records.items()
    }
    assert time.time() - t0 < 30
    # with its fault gone, a resume distils the student that failed, and only that one
    fixed = load_config(stage1_dir / "config.yaml", [o for o in overrides if not o.startswith("faults.")])
    again = {r["key"]: r for r in run_stages(fixed, stage1_dir, "targets", "stage2")["stage2"].records}
    assert again["baseline-random-ffn"]["status"] == "ok" and again["baseline-random-ffn"]["steps"] == 12
    assert all(again[k] == r for k, r in records.items() if k != "baseline-random-ffn")


def test_stage2_needs_a_finished_stage1_and_the_same_recipe_grid(stage1_dir, tmp_path):
    from m2d_ray.cli import main

    half = tmp_path / "half"
    half.mkdir()
    (half / "config.yaml").write_text((stage1_dir / "config.yaml").read_text())
    assert main(["sweep", "--resume", str(half), "stage=2"]) == 2
    assert main(["sweep", "--resume", str(stage1_dir), "stage=2", "grid.K=[4]"]) == 2
    assert main(["sweep", str(TINY), "stage=2"]) == 2


def test_a_failed_d2d_search_is_that_students_failure_not_the_runs(stage1_dir):
    """A worker's failure (here the d2d search's data) is recorded against its student with its cause; it is
    not reported as the user's bad input and the run goes on (the other students are done already)."""
    short = (
        stage1_dir.parent / "short.txt"
    )  # a well-formed corpus (the driver's checks pass) too short for the search's calibration
    short.write_text("too short.\n")
    cfg = load_config(
        stage1_dir / "stage2" / "config.yaml",  # the distillation settings stage 2 started with, plus d2d
        [f"calib.data={short}", "stage2.baselines=[random-init,random-ffn,d2d]", "faults.raise_in=[]"],
    )
    records = {r["key"]: r for r in run_stages(cfg, stage1_dir, "targets", "stage2")["stage2"].records}
    failed = records["baseline-d2d"]
    assert (
        failed["status"] == "failed"
        and "d2d candidate search failed" in failed["error"]
        and "need at least 64" in failed["error"]
    ), failed
    assert not (stage1_dir / "stage2" / "d2d" / "search.json").exists()
    assert "baseline-d2d" in (stage1_dir / "stage2.csv").read_text()


def test_the_targets_pass_resumes_at_its_first_missing_shard(ray_address, tmp_path, monkeypatch):
    """A pass killed after some shards computes only the others; the finished targets are the same."""
    from m2d_ray import storage
    from m2d_ray.catalog import targets as spec
    from m2d_ray.distill.targets import MANIFEST, TargetsManifest
    from m2d_ray.models import default_teacher, load_tokenizer
    from m2d_ray.runtime import shards
    from m2d_ray.runtime.run_storage import RunStorage

    store = RunStorage(str(tmp_path))
    store.mark()  # the driver's, before any worker: each node looks for it (ensure_visible)
    cfg = load_config(
        TINY,
        [
            "distill.steps=4",
            "distill.batch_size=4",
            "distill.seq_len=64",
            "distill.eval_max_tokens=512",
            "stage2.targets=topk:16",
        ],
    )
    toks = shards.tokens(store, default_teacher(), load_tokenizer(default_teacher()), cfg.distill, "synthetic:valid")
    monkeypatch.setattr(spec, "TARGET_SHARD_BYTES", 4 * 64 * 100)  # 4 blocks a shard: 4 shards
    url = shards.targets(store, default_teacher(), toks, cfg.target_spec(), cfg.distill, cfg.calib, cfg.ray)
    first = TargetsManifest.load(url)
    assert first.blocks == 16 and len(first.shards) == 4
    d = Path(storage.filesystem(url)[1])
    kept = {e.file: (d / e.file).stat().st_mtime_ns for e in first.shards[:2]}
    for name in (
        MANIFEST,
        "m2d_output.json",
        first.shards[3].file,
        f"{first.shards[3].file}.entry.json",
    ):  # killed mid-pass
        (d / name).unlink()
    assert shards.targets(store, default_teacher(), toks, cfg.target_spec(), cfg.distill, cfg.calib, cfg.ray) == url
    again = TargetsManifest.load(url)
    assert again.shards == first.shards and all((d / f).stat().st_mtime_ns == t for f, t in kept.items())


def test_a_students_trial_is_retried_as_often_as_ray_max_failures():
    # a lost node ends the Tune trial and the Train controller beside it: only Tune can retry that
    from m2d_ray.stages.stage2_tune import failures

    for n in (0, 1, 3):
        f = failures(load_config(TINY, [f"ray.max_failures={n}"]))
        assert f.max_failures == n and not f.fail_fast


def test_the_stop_board_lives_on_the_drivers_node(ray_address):
    # not on a worker node: the autoscaler removes those, a spot market reclaims them, and every student polls the board
    import ray

    from m2d_ray.runtime.ray_env import on_driver_node
    from m2d_ray.stages.stage2_tune import StopBoard

    strategy = on_driver_node()["scheduling_strategy"]
    assert strategy.node_id == ray.get_runtime_context().get_node_id() and strategy.soft is False
    board = StopBoard.options(**on_driver_node()).remote()
    board.stop.remote("a")
    assert ray.get(board.stopped.remote("a"))
    ray.kill(board)


def test_a_retried_students_curve_reaches_mlflow_whole():
    # a node lost after a checkpoint but before its report reached the driver: the retry resumes at step 40 and its
    # reports carry the curve since step 0; the MLflow history gets every validation once
    from types import SimpleNamespace

    from m2d_ray.stages.stage2_tune import Recorder
    from m2d_ray.stages.students import Student

    class Tracker:
        def __init__(self, history):
            self.history, self.logged = history, []
            self.client = SimpleNamespace(
                get_metric_history=lambda run, name: [SimpleNamespace(step=s) for s in self.history]
            )

        def log(self, run, steps):
            self.logged += [s for s, _ in steps["val_ppl"]]

    trial = SimpleNamespace(config={"student": {"key": "a"}})
    for history, want in (
        ([], [0, 40, 80, 120]),
        ([0, 40], [80, 120]),
        ([0], [40, 80, 120]),
    ):  # fresh; resumed; resumed, a report lost
        rec = Recorder({"a": Student("a", "sf/rr")}, SimpleNamespace(tracker=Tracker(history)))
        rec.runs["a"] = "run"
        curve = [[0, 9.0], [40, 5.0]]
        for step in (80, 120):
            curve.append([step, 4.0])
            rec.on_trial_result(0, [], trial, {"val_loss": 1.0, "step": step, "curve": [list(c) for c in curve]})
        assert rec.out.tracker.logged == want, (history, rec.out.tracker.logged)
    fresh = Recorder(
        {"a": Student("a", "sf/rr")}, SimpleNamespace(tracker=Tracker([]))
    )  # a fresh run's first report logs step 0 too
    fresh.runs["a"] = "run"
    fresh.on_trial_result(0, [], trial, {"val_loss": 1.0, "step": 40, "curve": [[0, 9.0], [40, 5.0]]})
    assert fresh.out.tracker.logged == [0, 40]


def test_a_fit_starts_none_of_ray_train_s_actors_that_can_do_nothing_there(ray_address, monkeypatch):
    """Ray Train's placement-group cleaner polls the State API, which needs a dashboard: on this session's Ray (none,
    as `ray[data,tune,train]` installs) it made every fit end 12 s late; with a dashboard it stays. The datasets'
    manager (an actor importing Ray Data) is left out when the trainer gets no dataset."""
    import ray
    from ray.train import ScalingConfig
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from m2d_ray.distill import trainer

    def started(**datasets) -> set[str]:
        t = trainer.Trainer(lambda config: None, scaling_config=ScalingConfig(num_workers=1), datasets=datasets)
        kinds = {PlacementGroupCleanerCallback: "cleaner", DatasetsCallback: "datasets"}
        return {name for c in t._create_default_callbacks() for k, name in kinds.items() if isinstance(c, k)}

    assert not trainer.has_dashboard() and started() == set()
    assert started(train=ray.data.range(4)) == {"datasets"}
    monkeypatch.setattr(trainer, "has_dashboard", lambda: True)
    assert started() == {"cleaner"}
