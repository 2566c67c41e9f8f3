"""Stage 2's work on Ray (stages/stage2.py says what the stage is): one Tune trial per student, each fitting the
TorchTrainer of its DistillJob; ASHA's decisions carried out by the students themselves (a StopBoard actor they
poll); loss curves to MLflow as they come, the ledger record and the training state's removal as each ends.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import ray
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from m2d_ray import storage
from m2d_ray.catalog.targets import ONLINE
from m2d_ray.config import SweepConfig
from m2d_ray.console import say
from m2d_ray.distill.trainer import fit
from m2d_ray.errors import StorageFull, full_disk
from m2d_ray.runtime.demand import tune_check
from m2d_ray.runtime.ray_env import on_driver_node, trial_error, trial_traceback
from m2d_ray.runtime.record import Logged, StageRecorder, fit_tuner
from m2d_ray.runtime.run_storage import RunStorage
from m2d_ray.stages.students import Student
from m2d_ray.stages.trial import InjectedFault
from m2d_ray.track import run_tags

CURVES = (
    "train_loss",
    "train_loss_buckets",
    "val_loss",
    "val_ppl",
    "lr",
    "tokens_per_s",
    "mfu",
    "train_s",
    "eval_s",
    "ckpt_s",
)  # throughput: training time only


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


def stage2_trainable(config: dict, *, jobs: dict, store: RunStorage, raise_in: tuple[str, ...]) -> None:
    """One student: the TorchTrainer of its DistillJob (`jobs[key]`), reporting to Tune through rank 0."""

    store.ensure_visible()  # this node sees the run's storage (checked once per node)
    key = config["student"]["key"]
    if key in raise_in:
        raise InjectedFault(f"injected failure in {key} (faults.raise_in)")
    fit(jobs[key], callbacks=[TuneReportCallback()])


# ---- records ------------------------------------------------------------------------------------
class Recorder(tune.Callback):
    """Driver side: loss curves to each student's nested MLflow run as they come; ledger + run status at the end."""

    def __init__(
        self,
        todo: dict[str, Student],
        out: StageRecorder,
        targets: dict[str, str] | None = None,
        max_failures: int = 0,
        drop=None,
    ) -> None:
        self.todo, self.out, self.max_failures = todo, out, max_failures
        self.targets = (
            targets or {}
        )  # key -> its teacher's targets (plan/targets.py's label: "hidden", "online, sharded")
        self.drop = drop  # drop(record): its training state goes
        self.runs: dict[str, str] = {}  # key -> MLflow run id (looked up once per student)
        self.logged: dict[str, set[int]] = {}  # key -> steps of its val_ppl history in MLflow
        self.finished = 0
        self.full: str | None = None  # a student's training stopped by a full disk: the stage ends with one line

    def on_trial_start(self, iteration, trials, trial, **info):
        s = self.todo[trial.config["student"]["key"]]
        self.runs[s.key] = self.out.tracker.trial_run(self.out.parent, f"stage2/{s.key}", {"stage": 2, **s.params()})

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if "val_loss" not in result:
            return
        key = trial.config["student"]["key"]
        run = self.runs[key]
        steps = {k: [(result["step"], result.get(k))] for k in CURVES}  # a metric a report lacks (None) is not logged
        # the curve carries every (step, val ppl) since step 0 across resumes: log those the run's history lacks — step
        # 0
        # of a fresh run, and validations of an attempt whose node was lost before its report reached this driver
        if key not in self.logged:
            self.logged[key] = {m.step for m in self.out.tracker.client.get_metric_history(run, "val_ppl")}
        steps["val_ppl"] = [
            (st, v) for st, v in result["curve"] if st not in self.logged[key] and st != result["step"]
        ] + steps["val_ppl"]
        self.logged[key] |= {st for st, _ in steps["val_ppl"]}
        self.out.tracker.log(run, steps=steps)

    def on_trial_complete(self, iteration, trials, trial, **info):
        last, key = trial.last_result or {}, trial.config["student"]["key"]
        if "val_loss" not in last:  # ended without a single report: nothing says it trained
            self.record(key, "failed", last, error="the student's training ended without reporting a validation")
            return
        status = "diverged" if not math.isfinite(last["val_loss"]) else ("ok" if last.get("final") else "pruned")
        self.record(key, status, last)

    def on_trial_error(self, iteration, trials, trial, **info):
        key, error = trial.config["student"]["key"], trial_error(trial, "stage 2", self.max_failures)
        self.record(key, "failed", trial.last_result or {}, error=error)
        why = full_disk(trial_traceback(trial))
        if why and self.full is None:
            self.full = f"{key} could not write its checkpoint or student ({why})"

    def record(self, key: str, status: str, last: dict, error: str | None = None) -> None:
        s = self.todo[key]
        full = last.get("curve") or []
        r = {
            **s.params(),
            "status": status,
            "error": error,
            "steps": last.get("step"),
            "tokens": last.get("tokens"),
            "val_ppl_initial": last.get("val_ppl_initial"),
            "val_ppl": _finite(last.get("val_ppl")),
            "best_val_ppl": min((p for _, p in full[1:] if _finite(p) is not None), default=None),
            "tokens_per_s": last.get("tokens_per_s"),
            "student_path": last.get("student_path"),
            "student_params": last.get("student_params"),
            "teacher_active_params": last.get("teacher_active_params"),
            "peak_rss_bytes": last.get("peak_rss_bytes"),
            "peak_work_bytes": last.get("peak_work_bytes"),
            "peak_cuda_bytes": last.get("peak_cuda_bytes"),
            "targets": self.targets.get(key, ONLINE),
            "curve": [[s, _finite(p)] for s, p in full],  # from step 0, across resumes
        }
        self.out.write(r)
        if self.drop is not None:
            self.drop(r)
        self.finished += 1
        ppl = f"{r['val_ppl']:.2f}" if r["val_ppl"] is not None else "-"
        say(f"[stage 2 {self.finished}/{len(self.todo)}] {key}: {status} at step {r['steps']}, val ppl {ppl}")


class TrainingStateDrop:
    """Removes an ended student's Train checkpoints (stage2.keep_training_state: false): an ok student's once its
    distilled model is complete in storage, a pruned or diverged one's at once (a resumed run never trains them
    again); a failed student keeps them (the retry resumes from its last checkpoint). `removed`: the students whose
    state it removed, said in one line at the end of the stage."""

    def __init__(self, store: RunStorage) -> None:
        self.store, self.removed = store, set()

    def __call__(self, r: dict) -> None:
        if r["status"] not in ("ok", "pruned", "diverged"):
            return
        path = r.get("student_path") if r["status"] == "ok" else None
        if r["status"] == "ok" and path is None:
            return
        if self.store.drop_training_state(r["key"], path):
            self.removed.add(r["key"])


def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def mlflow_fields(r: dict) -> Logged:
    """A student's final MLflow values (its curves were logged as they came; they keep the plain names)."""
    names = {
        "val_ppl": "final_val_ppl",
        "best_val_ppl": "best_val_ppl",
        "val_ppl_initial": "initial_val_ppl",
        "tokens_per_s": "mean_tokens_per_s",
        "peak_rss_bytes": "peak_rss_bytes",
        "peak_work_bytes": "peak_work_bytes",
        "peak_cuda_bytes": "peak_cuda_bytes",
    }
    return Logged(
        {"stage": 2, **{k: r[k] for k in ("key", "pair", "baseline", "stage1_ppl")}},
        {names[k]: r[k] for k in names if r.get(k) is not None},
        {
            "student_path": r["student_path"],
            "targets": r.get("targets"),
            "duplicate_of": r.get("duplicate_of"),
            **run_tags(2, r["pair"], "baseline" if r["baseline"] else "promoted"),
        },
    )


# ---- the sweep ----------------------------------------------------------------------------------
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
    return CooperativeASHA(
        board,
        time_attr="training_iteration",
        metric="val_loss",
        mode="min",
        max_t=evals,
        grace_period=min(cfg.stage2.grace_evals, evals),
        reduction_factor=cfg.stage2.reduction_factor,
    )


def failures(cfg: SweepConfig) -> tune.FailureConfig:
    """Tune's retries of a student's trial: a lost node (spot reclaim) ends the trial and the Train controller
    beside it, which Train's own FailureConfig cannot bring back; the retry resumes from the last checkpoint."""
    return tune.FailureConfig(max_failures=cfg.ray.max_failures, fail_fast=False)


def distil(ctx, pending: list[Student], recorder: Recorder, job_of) -> None:
    """Distil `pending` (one Tune trial each, `job_of(student, stop)` its DistillJob) under the stage's resource
    waiter (active around this call); results go through `recorder`."""
    cfg = ctx.cfg
    board = StopBoard.options(**on_driver_node()).remote()
    jobs = {s.key: job_of(s, StopCheck(board, s.key)) for s in pending}
    trainable = tune.with_parameters(stage2_trainable, jobs=jobs, store=ctx.store, raise_in=cfg.faults.raise_in)
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 0.5}),
        param_space={"student": tune.grid_search([s.params() for s in pending])},
        tune_config=tune.TuneConfig(
            scheduler=_scheduler(cfg, board),
            max_concurrent_trials=cfg.students_at_once(),
            trial_name_creator=lambda t: t.config["student"]["key"],
            trial_dirname_creator=lambda t: t.config["student"]["key"],
        ),
        run_config=tune.RunConfig(
            name=f"stage2-{time.strftime('%Y%m%d-%H%M%S')}",
            **storage.ray_storage(ctx.store.tune(2)),
            callbacks=[recorder, tune_check("stage2")],
            verbose=0,
            failure_config=failures(cfg),
        ),
    )
    try:
        fit_tuner(tuner, f"m2d run --resume {ctx.rd}")
    finally:
        ray.kill(board)
    if recorder.full:  # recorded failed, so a resume distils it again; the others' results are kept
        raise StorageFull(recorder.full)
