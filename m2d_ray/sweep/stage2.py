"""Stage 2 on Ray: distil the promoted student of every (scoring, grouping) pair, plus the baselines.

    RUN_DIR/promotions.json (stage 1)      the best (K, scaling) per pair, best pre-distillation ppl first
    one Tune trial per student              fits a TorchTrainer whose rank 0 first builds the initial student
                                            (verified) into the run's storage; every rank reads it from there
    ASHA on validation loss                 poor students stop early (decisions on a StopBoard actor)
    ledger + MLflow (driver callback)       RUN_DIR/stage2/trials/*.json; nested runs with loss curves
    table                                   RUN_DIR/stage2.csv, stage2.md
    storage (every node reaches it)         STORAGE/stage2/{init,students,train,tune}/ (default STORAGE = RUN_DIR)

Nothing a worker reads comes from the driver's disk: plans travel with the trial (object store), the
teacher is a hub name, a storage URL or the embedded one (placement.teacher_for_workers). Resume (`m2d
run --resume`) skips students in the ledger and retries failed ones; an unfinished or failed student
continues from its last checkpoint (same Train run name and storage).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from m2d_ray import storage
from m2d_ray.config import SweepConfig, dump_config, load_config
from m2d_ray.console import say
from m2d_ray.distill.data import absolute_spec, check_source
from m2d_ray.errors import M2DError, RunFailed
from m2d_ray.sweep.ledger import Ledger
from m2d_ray.sweep.placement import check_visible, run_storage, teacher_for_workers
from m2d_ray.sweep.ray_env import ensure_ray, trial_error
from m2d_ray.sweep.trial import InjectedFault
from m2d_ray.track import LOGGED_TAG, Tracker, run_tracker, sweep_parent

STAGE2_DIR, STAGE2_CONFIG = "stage2", "config.yaml"
CURVES = ("train_loss", "val_loss", "val_ppl", "lr", "tokens_per_s", "mfu", "train_s", "eval_s", "ckpt_s")  # throughput: training time only


@dataclass(frozen=True)
class Student:
    """One stage-2 trial: a promoted config (`key` = its stage-1 key) or a baseline (`baseline-NAME`)."""

    key: str
    pair: str  # "scoring/grouping", or the baseline's name
    stage1_ppl: float | None = None
    baseline: str | None = None

    def params(self) -> dict:
        return {"key": self.key, "pair": self.pair, "baseline": self.baseline, "stage1_ppl": self.stage1_ppl}


def students(promotions: dict, baselines: tuple[str, ...], only: tuple[str, ...] = ()) -> list[Student]:
    """Promoted students best-first (ASHA meets strong students early), then the baselines; `only`
    keeps those (scoring/grouping) pairs."""
    pairs = sorted(((p, v) for p, v in promotions["pairs"].items() if not only or p in only), key=lambda kv: kv[1]["ppl"])
    out = [Student(p["key"], pair, p["ppl"]) for pair, p in pairs]
    return out + [Student(f"baseline-{b}", b, None, b) for b in baselines]


# ---- the trial (a Tune worker; it builds and fits a TorchTrainer) -------------------------------
@ray.remote(num_cpus=0)
class StopBoard:
    """ASHA's stop decisions where every node can read them (a file on the driver's disk is not)."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def stop(self, key: str) -> None:
        self.keys.add(key)

    def stopped(self, key: str) -> bool:
        return key in self.keys


@dataclass(frozen=True)
class StopCheck:
    """`DistillJob.stop` of one student: asks the run's StopBoard (the actor handle travels with the job)."""

    board: object
    key: str

    def __call__(self) -> bool:
        return ray.get(self.board.stopped.remote(self.key))


def stage2_trainable(config: dict, *, model: str, store: str, plans: dict, cfg: SweepConfig, board) -> None:
    """One student: a TorchTrainer whose rank 0 builds the initial student into the run's storage (once)
    and whose workers read it back through their node's cache; the distilled student goes to storage too."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from m2d_ray.convert.initial import InitialStudent
    from m2d_ray.distill.loop import DistillJob
    from m2d_ray.distill.trainer import fit
    from m2d_ray.sweep.grid import plan_of

    s = Student(**config["student"])
    if s.key in cfg.faults.raise_in:
        raise InjectedFault(f"injected failure in {s.key} (faults.raise_in)")
    base = storage.join(store, STAGE2_DIR)
    build = InitialStudent(model, None if s.baseline else plan_of(plans, s.key), s.baseline, cfg.distill.seed)
    device = "cuda" if cfg.distill.gpus_per_worker > 0 else "cpu"
    job = DistillJob(model, storage.join(base, "init", s.key), cfg.distill, cfg.distill.eval_data or cfg.eval.data,
                     out=storage.join(base, "students", s.key), device=device, stop=StopCheck(board, s.key), build=build)
    fit(job, name=s.key, storage=storage.join(base, "train"), callbacks=[TuneReportCallback()], max_failures=cfg.ray.max_failures)


# ---- records ------------------------------------------------------------------------------------
class Recorder(tune.Callback):
    """Driver side: loss curves to each student's nested MLflow run as they come; ledger + run status at the end."""

    def __init__(self, todo: dict[str, Student], ledger: Ledger, tracker: Tracker, parent: str) -> None:
        self.todo, self.ledger, self.tracker, self.parent = todo, ledger, tracker, parent
        self.runs: dict[str, str] = {}  # key -> MLflow run id (looked up once per student)
        self.finished = 0

    def on_trial_start(self, iteration, trials, trial, **info):
        s = self.todo[trial.config["student"]["key"]]
        self.runs[s.key] = self.tracker.trial_run(self.parent, f"stage2/{s.key}", {"stage": 2, **s.params()})

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if "val_loss" not in result:
            return
        steps = {k: [(result["step"], result.get(k))] for k in CURVES}
        if len(result["curve"]) == 2:  # the first report of a fresh run also logs the step-0 validation
            steps["val_ppl"].insert(0, tuple(result["curve"][0]))
        self.tracker.log(self.runs[trial.config["student"]["key"]], steps=steps)

    def on_trial_complete(self, iteration, trials, trial, **info):
        last, key = trial.last_result or {}, trial.config["student"]["key"]
        if "val_loss" not in last:  # ended without a single report: nothing says it trained
            self.record(key, "failed", last, error="the student's training ended without reporting a validation")
            return
        status = "diverged" if not math.isfinite(last["val_loss"]) else ("ok" if last.get("final") else "pruned")
        self.record(key, status, last)

    def on_trial_error(self, iteration, trials, trial, **info):
        self.record(trial.config["student"]["key"], "failed", trial.last_result or {}, error=trial_error(trial))

    def record(self, key: str, status: str, last: dict, error: str | None = None) -> None:
        s = self.todo[key]
        full = last.get("curve") or []
        r = {
            **s.params(), "status": status, "error": error,
            "steps": last.get("step"), "tokens": last.get("tokens"),
            "val_ppl_initial": last.get("val_ppl_initial"), "val_ppl": _finite(last.get("val_ppl")),
            "best_val_ppl": min((p for _, p in full[1:] if _finite(p) is not None), default=None),
            "tokens_per_s": last.get("tokens_per_s"), "student_path": last.get("student_path"),
            "curve": [[s, _finite(p)] for s, p in full],  # from step 0, across resumes
        }
        self.ledger.write(r)
        log_record(self.tracker, self.parent, r)
        self.finished += 1
        ppl = f"{r['val_ppl']:.2f}" if r["val_ppl"] is not None else "-"
        say(f"[stage 2 {self.finished}/{len(self.todo)}] {key}: {status} at step {r['steps']}, val ppl {ppl}")


def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def log_record(tracker: Tracker, parent: str, r: dict) -> None:
    """Idempotent final logging of one student (tag m2d.logged last, as in stage 1)."""
    run = tracker.trial_run(parent, f"stage2/{r['key']}", {"stage": 2, **{k: r[k] for k in ("key", "pair", "baseline", "stage1_ppl")}})
    names = {"val_ppl": "final_val_ppl", "best_val_ppl": "best_val_ppl", "val_ppl_initial": "initial_val_ppl", "tokens_per_s": "mean_tokens_per_s"}
    metrics = {names[k]: r[k] for k in names if r.get(k) is not None}  # the curves keep the plain names
    tracker.log(run, metrics=metrics, tags={"status": r["status"], "student_path": r["student_path"], "error": r["error"], "stage": "2"})
    tracker.finish(run, {"ok": "FINISHED", "diverged": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}[r["status"]])
    tracker.log(run, tags={LOGGED_TAG: "1"})


# ---- the sweep ----------------------------------------------------------------------------------
STAGE1_KEYS = ("model", "calib", "grid")  # what decided the promotions: stage 2 must not change them
STAGE2_KEYS = ("distill", "stage2")  # what a started stage 2 must keep (ray, mlflow, stage3 may change)


def check_stage2_config(run_dir: Path, cfg: SweepConfig) -> None:
    """`cfg` may run stage 2 of `run_dir`: stage 1's settings unchanged, and a started stage 2's too."""
    saved1 = load_config(run_dir / "config.yaml").to_dict()
    new = cfg.to_dict()
    changed = [k for k in STAGE1_KEYS if new[k] != saved1[k]]
    if changed:
        raise M2DError(f"{', '.join(changed)} differ from stage 1 of {run_dir}; stage 2 distils that run's promotions: use its config")
    path = run_dir / STAGE2_DIR / STAGE2_CONFIG
    if path.exists():
        saved2 = load_config(path).to_dict()
        diff = [k for k in STAGE2_KEYS if new[k] != saved2[k]]
        if diff:
            raise M2DError(f"stage 2 of {run_dir} was started with other settings ({', '.join(diff)}); resume it unchanged or use a new run directory")


def stage2_config(run_dir: Path, cfg: SweepConfig) -> SweepConfig:
    """The stage-2 config of `run_dir`: checked, and fixed at the first stage-2 start."""
    check_stage2_config(run_dir, cfg)
    path = run_dir / STAGE2_DIR / STAGE2_CONFIG
    if not path.exists():
        dump_config(cfg, path)
    return cfg


def _concurrency(cfg: SweepConfig) -> int | None:
    """Students at a time: as set, else all of them on GPUs (Ray queues their worker groups and an
    autoscaler starts nodes for them), else `ray.max_concurrent_trials` on CPUs."""
    if cfg.stage2.max_concurrent_trials:
        return cfg.stage2.max_concurrent_trials
    return None if cfg.distill.gpus_per_worker > 0 else cfg.ray.max_concurrent_trials


class CooperativeASHA(ASHAScheduler):
    """ASHA whose decisions the trials carry out themselves: STOP goes to a StopBoard the ranks poll.

    Killing a Tune trial kills the Train controller it started, and Train V2 then leaks its workers'
    placement group unless the Ray state API (dashboard) is up to notice: on a local Ray the next
    students would wait for CPUs forever. Stopping from inside ends the Train run cleanly instead.
    """

    def __init__(self, board, **kwargs) -> None:
        super().__init__(**kwargs)
        self.board = board

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        action = super().on_trial_result(tune_controller, trial, result)
        if action == self.STOP and not result.get("final"):
            self.board.stop.remote(trial.config["student"]["key"])
        return self.CONTINUE  # a finished student ends by itself too


def _scheduler(cfg: SweepConfig, board):
    if not cfg.stage2.asha:
        return FIFOScheduler()
    evals = math.ceil(cfg.distill.steps / cfg.distill.eval_every)
    return CooperativeASHA(board, time_attr="training_iteration", metric="val_loss", mode="min", max_t=evals,
                           grace_period=min(cfg.stage2.grace_evals, evals), reduction_factor=cfg.stage2.reduction_factor)


def run_stage2(cfg: SweepConfig, run_dir: str | Path, tracking_uri: str | None = None) -> list[dict]:
    """Distil every promotion of the finished stage 1 in `run_dir` (+ baselines); returns the ledger records."""
    run_dir = Path(run_dir).resolve()
    prom_file = run_dir / "promotions.json"
    if not prom_file.exists():
        raise M2DError(f"{run_dir} has no promotions.json: finish stage 1 first (m2d sweep --resume {run_dir})")
    cfg = stage2_config(run_dir, cfg)
    params = {f"stage2.{k}": v for k, v in cfg.to_dict()["distill"].items()}  # as written (MLflow params never change)
    d = cfg.distill  # trials run in their own directories: local data paths made absolute
    cfg = dataclasses.replace(cfg, distill=dataclasses.replace(d, train_data=absolute_spec(d.train_data), eval_data=absolute_spec(d.eval_data or cfg.eval.data)))
    promotions = json.loads(prom_file.read_text())
    model = promotions["teacher"]
    todo_all = students(promotions, cfg.stage2.baselines, cfg.stage2.pairs)
    ledger = Ledger(run_dir / STAGE2_DIR)
    tracker = run_tracker(cfg, run_dir, tracking_uri)
    parent = sweep_parent(tracker, run_dir, cfg.name)
    tracker.log(parent, params=params)
    logged = {k.removeprefix("stage2/") for k in tracker.logged_trials(parent)}
    for r in ledger.records():  # a kill between the ledger and MLflow: log it now
        if r["key"] not in logged:
            log_record(tracker, parent, r)
    done = {r["key"]: r["status"] for r in ledger.records()}
    pending = [s for s in todo_all if done.get(s.key, "failed") == "failed"]  # a failed student is tried again
    retried = sum(s.key in done for s in pending)
    say(f"stage 2: {len(todo_all)} students ({len(todo_all) - len(cfg.stage2.baselines)} promoted + baselines), {len(pending)} to distil"
        + (f" ({retried} failed before: retried from their last checkpoint)" if retried else ""))
    if pending:
        from m2d_ray.models import check_teacher_topk

        check_source(cfg.distill.train_data)
        check_teacher_topk(model, cfg.distill.teacher_topk)
        ensure_ray(cfg.ray)
        store = run_storage(cfg, run_dir)
        check_visible(store)
        plans = {} if all(s.baseline for s in pending) else json.loads((run_dir / "plans.json").read_text())["plans"]
        _tune(cfg, teacher_for_workers(model, store), store, plans, run_dir, pending, Recorder({s.key: s for s in pending}, ledger, tracker, parent))
    records = ledger.records()
    from m2d_ray.report.stage2 import write_stage2

    outputs = write_stage2(records, [s.key for s in todo_all], run_dir)
    tracker.artifacts(parent, outputs)
    tracker.finish(parent)
    return records


def _tune(cfg: SweepConfig, model: str, store: str, plans: dict, run_dir: Path, pending: list[Student], recorder: Recorder) -> None:
    board = StopBoard.remote()
    trainable = tune.with_parameters(stage2_trainable, model=model, store=store, plans=plans, cfg=cfg, board=board)
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 0.5}),
        param_space={"student": tune.grid_search([s.params() for s in pending])},
        tune_config=tune.TuneConfig(
            scheduler=_scheduler(cfg, board), max_concurrent_trials=_concurrency(cfg),
            trial_name_creator=lambda t: t.config["student"]["key"], trial_dirname_creator=lambda t: t.config["student"]["key"],
        ),
        run_config=tune.RunConfig(
            name=f"stage2-{time.strftime('%Y%m%d-%H%M%S')}", **storage.ray_storage(storage.join(store, STAGE2_DIR, "tune")),
            callbacks=[recorder], verbose=0, failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
        ),
    )
    try:
        tuner.fit()
    except Exception as exc:
        traceback.print_exc()
        raise RunFailed(f"Ray Tune stopped ({type(exc).__name__}); finished students are saved: resume with m2d run --resume {run_dir}") from None
    finally:
        ray.kill(board)
