"""Stage 2 on Ray: distil the promoted student of every (scoring, grouping) pair, plus the baselines.

    RUN_DIR/promotions.json (stage 1)      the best (K, scaling) per pair, best pre-distillation ppl first
    one Tune trial per student              builds the initial student (verified) and fits a TorchTrainer
                                            (DeepSpeed ZeRO-2 workers; TuneReportCallback forwards rank 0)
    ASHA on validation loss                 poor students stop early
    ledger + MLflow (driver callback)       RUN_DIR/stage2/trials/*.json; nested runs with loss curves
    table                                   RUN_DIR/stage2.csv, stage2.md; students in RUN_DIR/stage2/students/

Resume (`m2d sweep --resume RUN_DIR stage=2`) skips students in the ledger; an unfinished one
continues from its last checkpoint (same Train run name and storage).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from m2d_ray.config import SweepConfig, dump_config, load_config
from m2d_ray.distill.data import absolute_spec, check_source
from m2d_ray.errors import M2DError
from m2d_ray.sweep.ledger import Ledger
from m2d_ray.sweep.ray_env import ensure_ray, trial_error
from m2d_ray.sweep.trial import InjectedFault
from m2d_ray.track import LOGGED_TAG, Tracker, run_tracker, sweep_parent

STAGE2_DIR, STAGE2_CONFIG, STOP_DIR = "stage2", "config.yaml", "stop"
CURVES = ("train_loss", "val_loss", "val_ppl", "lr", "tokens_per_s")


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
def stage2_trainable(config: dict, *, run_dir: str, model: str, cfg: SweepConfig) -> None:
    from ray.tune.integration.ray_train import TuneReportCallback

    from m2d_ray.convert.initial import materialize
    from m2d_ray.distill.loop import DistillJob
    from m2d_ray.distill.trainer import fit
    from m2d_ray.sweep.grid import plan_of
    from m2d_ray.weights import open_teacher

    torch.set_num_threads(cfg.ray.threads_per_worker)
    s = Student(**config["student"])
    if s.key in cfg.faults.raise_in:
        raise InjectedFault(f"injected failure in {s.key} (faults.raise_in)")
    base = Path(run_dir) / STAGE2_DIR
    init = base / "init" / s.key
    if not (init / "config.json").exists():
        teacher = open_teacher(model)  # reads only what the initial student is made of
        plan = None if s.baseline else plan_of(json.loads((Path(run_dir) / "plans.json").read_text())["plans"], s.key)
        materialize(teacher, init, plan=plan, baseline=s.baseline, seed=cfg.distill.seed)
        del teacher
    device = "cuda" if cfg.distill.gpus_per_worker > 0 else "cpu"
    job = DistillJob(model, str(init), cfg.distill, cfg.distill.eval_data or cfg.eval.data, out=str(base / "students" / s.key),
                     device=device, stop_file=str(base / STOP_DIR / s.key))
    fit(job, name=s.key, storage=base / "train", callbacks=[TuneReportCallback()], max_failures=cfg.ray.max_failures)


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
        last = trial.last_result or {}
        done = bool(last.get("final"))
        status = "diverged" if last and not math.isfinite(last.get("val_loss", math.inf)) else ("ok" if done else "pruned")
        self.record(trial.config["student"]["key"], status, last)

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
        print(f"[stage 2 {self.finished}/{len(self.todo)}] {key}: {status} at step {r['steps']}, val ppl {ppl}", file=sys.stderr, flush=True)


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


def stage2_config(run_dir: Path, cfg: SweepConfig) -> SweepConfig:
    """The stage-2 config of `run_dir`: fixed at the first stage-2 start, checked against stage 1."""
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
        return cfg
    dump_config(cfg, path)
    return cfg


def _concurrency(cfg: SweepConfig) -> int:
    if cfg.stage2.max_concurrent_trials:
        return cfg.stage2.max_concurrent_trials
    d = cfg.distill
    gpus = ray.cluster_resources().get("GPU", 0)
    if d.gpus_per_worker > 0 and gpus > 0:
        return max(1, int(gpus // (d.workers * d.gpus_per_worker)))
    return cfg.ray.max_concurrent_trials


class CooperativeASHA(ASHAScheduler):
    """ASHA whose decisions the trials carry out themselves: STOP becomes a stop file the workers poll.

    Killing a Tune trial kills the Train controller it started, and Train V2 then leaks its workers'
    placement group unless the Ray state API (dashboard) is up to notice: on a local Ray the next
    students would wait for CPUs forever. Stopping from inside ends the Train run cleanly instead.
    """

    def __init__(self, stop_dir: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stop_dir = stop_dir
        self.stop_dir.mkdir(parents=True, exist_ok=True)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        action = super().on_trial_result(tune_controller, trial, result)
        if action == self.STOP and not result.get("final"):
            (self.stop_dir / trial.config["student"]["key"]).touch()
        return self.CONTINUE  # a finished student ends by itself too


def _scheduler(cfg: SweepConfig, stop_dir: Path):
    if not cfg.stage2.asha:
        return FIFOScheduler()
    evals = math.ceil(cfg.distill.steps / cfg.distill.eval_every)
    return CooperativeASHA(stop_dir, time_attr="training_iteration", metric="val_loss", mode="min", max_t=evals,
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
    pending = [s for s in todo_all if s.key not in ledger.done()]
    print(f"stage 2: {len(todo_all)} students ({len(todo_all) - len(cfg.stage2.baselines)} promoted + baselines), {len(pending)} to distil", file=sys.stderr)
    for s in pending:  # a stop request nobody acted on (killed sweep): the student starts over from its checkpoint
        (run_dir / STAGE2_DIR / STOP_DIR / s.key).unlink(missing_ok=True)
    if pending:
        from m2d_ray.pipeline import check_teacher_topk

        check_source(cfg.distill.train_data)
        check_teacher_topk(model, cfg.distill.teacher_topk)
        ensure_ray(cfg.ray)
        _tune(cfg, model, run_dir, pending, Recorder({s.key: s for s in pending}, ledger, tracker, parent))
    records = ledger.records()
    from m2d_ray.report.stage2 import write_stage2

    outputs = write_stage2(records, [s.key for s in todo_all], run_dir)
    tracker.artifacts(parent, outputs)
    tracker.finish(parent)
    return records


def _tune(cfg: SweepConfig, model: str, run_dir: Path, pending: list[Student], recorder: Recorder) -> None:
    trainable = tune.with_resources(tune.with_parameters(stage2_trainable, run_dir=str(run_dir), model=model, cfg=cfg), {"cpu": 0.5})
    tuner = tune.Tuner(
        trainable,
        param_space={"student": tune.grid_search([s.params() for s in pending])},
        tune_config=tune.TuneConfig(
            scheduler=_scheduler(cfg, run_dir / STAGE2_DIR / STOP_DIR), max_concurrent_trials=_concurrency(cfg),
            trial_name_creator=lambda t: t.config["student"]["key"], trial_dirname_creator=lambda t: t.config["student"]["key"],
        ),
        run_config=tune.RunConfig(
            name=f"stage2-{time.strftime('%Y%m%d-%H%M%S')}", storage_path=cfg.ray.storage_path or str(run_dir / STAGE2_DIR / "tune"),
            callbacks=[recorder], verbose=0, failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
        ),
    )
    try:
        tuner.fit()
    except Exception as exc:
        traceback.print_exc()
        raise M2DError(f"Ray Tune stopped ({type(exc).__name__}); finished students are saved: resume with m2d sweep --resume {run_dir} stage=2") from None
