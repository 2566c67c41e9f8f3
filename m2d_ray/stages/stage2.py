"""Stage 2 on Ray: distil the promoted student of every (scoring, grouping) pair, plus the baselines.

    RUN_DIR/promotions.json (stage 1)      the best (K, scaling) per pair, best pre-distillation ppl first
    one Tune trial per student              fits a TorchTrainer whose rank 0 first builds the initial student
                                            (verified) into the run's storage; every rank reads it from there
    ASHA on validation loss                 poor students stop early (decisions on a StopBoard actor)
    ledger + MLflow (driver callback)       RUN_DIR/stage2/trials/*.json; nested runs with loss curves
    table                                   RUN_DIR/stage2.csv, stage2.md
    storage (every node reaches it)         `RunStorage`: students, checkpoints, Tune state, the text files

Nothing a worker reads comes from the driver's disk: plans travel with the trial (object store), the
teacher and the training and validation text through the run's storage (`RunStorage.put_model`,
`put_data`). The d2d baseline (stages/d2d.py) is searched by a Ray task first; its promoted spec travels
with its trial, and a failed search is that student's failure, not the run's. Resume (`m2d run --resume`)
skips students in the ledger and retries failed ones; an unfinished or failed student continues from its
last checkpoint (same Train run name and storage). A trial whose node is lost (a spot reclaim: the Tune
trial and the Train controller beside it die) is retried by Tune up to `ray.max_failures` times, and the
retry's TorchTrainer resumes from that checkpoint too; once more and the student is recorded as failed.
The StopBoard lives on the driver's node, which no autoscaler removes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from m2d_ray import storage
from m2d_ray.config import D2D, SweepConfig, dump_config, load_config
from m2d_ray.console import say
from m2d_ray.errors import M2DError
from m2d_ray.prune.prune import PrunedSpec
from m2d_ray.run_dir import RunDir
from m2d_ray.stages.d2d import SearchFailed, d2d_student, dense_teacher
from m2d_ray.stages.demand import for_stage, tune_check
from m2d_ray.stages.ray_env import ensure_ray, on_driver_node, trial_error
from m2d_ray.stages.record import Logged, StageRecorder, fit_tuner
from m2d_ray.models import load_tokenizer
from m2d_ray.stages.run_storage import RunStorage
from m2d_ray.stages.shards import targets as shard_targets
from m2d_ray.stages.shards import tokens
from m2d_ray.stages.trial import InjectedFault
from m2d_ray.track import run_tags, run_tracker, sweep_parent

CURVES = ("train_loss", "train_loss_buckets", "val_loss", "val_ppl", "lr", "tokens_per_s", "mfu", "train_s", "eval_s", "ckpt_s")  # throughput: training time only


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


def duplicates(todo: list[Student], plans: dict) -> dict[str, str]:
    """Promoted students whose plan repeats a better-ranked one's (at K = k every grouping builds the same
    student): their key -> the key of the student distilled for both."""
    first: dict[str, str] = {}
    out = {}
    for s in todo:
        if s.baseline is None:
            sig = plans[s.key]["signature"]
            out.update({s.key: first[sig]} if sig in first else {})
            first.setdefault(sig, s.key)
    return out


def copy_duplicates(out: StageRecorder, todo: list[Student], dups: dict[str, str]) -> None:
    """Each duplicate gets its distilled twin's record (ledger and MLflow), under its own key and pair."""
    done = out.ledger.done()
    by_key = {s.key: s for s in todo}
    for key, twin in dups.items():
        if twin in done:
            r = {**out.ledger.read(twin), **by_key[key].params(), "key": key, "duplicate_of": twin}
            if key not in done or out.ledger.read(key) != r:
                out.write(r)


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


def stage2_trainable(config: dict, *, model: str, store: RunStorage, plans: dict, cfg: SweepConfig, eval_data: str,
                     tokens: dict[str, str], targets: dict[str, str], board, d2d: PrunedSpec | None = None) -> None:
    """One student (`fit_student`): rank 0 builds its initial student into the run's storage once, every
    rank reads it back; the d2d baseline (`d2d`: its promoted `PrunedSpec`) is pruned and distilled from
    its dense teacher with the same budget (a dense teacher has no routing to expand). `tokens`: each
    teacher's token shards (the same directory when their tokenizers agree); `targets`: each teacher's
    cached targets (stage2.targets; empty when online)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from m2d_ray.convert.initial import InitialStudent
    from m2d_ray.stages.grid import plan_of
    from m2d_ray.stages.student import fit_student

    store.ensure_visible()  # this node sees the run's storage (checked once per node)
    s = Student(**config["student"])
    if s.key in cfg.faults.raise_in:
        raise InjectedFault(f"injected failure in {s.key} (faults.raise_in)")
    teacher, distill = model, cfg.distill
    if s.baseline == D2D:
        teacher, distill, build = d2d.teacher, dataclasses.replace(cfg.distill, teacher_topk=None), d2d
    else:
        build = InitialStudent(model, None if s.baseline else plan_of(plans, s.key), s.baseline, cfg.distill.seed)
    fit_student(store, s.key, teacher, distill, eval_data, build=build, stop=StopCheck(board, s.key),
                callbacks=[TuneReportCallback()], max_failures=cfg.ray.max_failures, tokens=tokens[teacher], targets=targets.get(teacher),
                target_spec=cfg.target_spec())


# ---- records ------------------------------------------------------------------------------------
class Recorder(tune.Callback):
    """Driver side: loss curves to each student's nested MLflow run as they come; ledger + run status at the end."""

    def __init__(self, todo: dict[str, Student], out: StageRecorder, targets: str = "online", max_failures: int = 0, drop=None) -> None:
        self.todo, self.out, self.targets, self.max_failures = todo, out, targets, max_failures
        self.drop = drop  # drop(record): its training state goes
        self.runs: dict[str, str] = {}  # key -> MLflow run id (looked up once per student)
        self.logged: dict[str, set[int]] = {}  # key -> steps of its val_ppl history in MLflow
        self.finished = 0

    def on_trial_start(self, iteration, trials, trial, **info):
        s = self.todo[trial.config["student"]["key"]]
        self.runs[s.key] = self.out.tracker.trial_run(self.out.parent, f"stage2/{s.key}", {"stage": 2, **s.params()})

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if "val_loss" not in result:
            return
        key = trial.config["student"]["key"]
        run = self.runs[key]
        steps = {k: [(result["step"], result.get(k))] for k in CURVES}  # a metric a report lacks (None) is not logged
        # the curve carries every (step, val ppl) since step 0 across resumes: log those the run's history lacks — step 0
        # of a fresh run, and validations of an attempt whose node was lost before its report reached this driver
        if key not in self.logged:
            self.logged[key] = {m.step for m in self.out.tracker.client.get_metric_history(run, "val_ppl")}
        steps["val_ppl"] = [(st, v) for st, v in result["curve"] if st not in self.logged[key] and st != result["step"]] + steps["val_ppl"]
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
        self.record(trial.config["student"]["key"], "failed", trial.last_result or {}, error=trial_error(trial, "stage 2", self.max_failures))

    def record(self, key: str, status: str, last: dict, error: str | None = None) -> None:
        s = self.todo[key]
        full = last.get("curve") or []
        r = {
            **s.params(), "status": status, "error": error,
            "steps": last.get("step"), "tokens": last.get("tokens"),
            "val_ppl_initial": last.get("val_ppl_initial"), "val_ppl": _finite(last.get("val_ppl")),
            "best_val_ppl": min((p for _, p in full[1:] if _finite(p) is not None), default=None),
            "tokens_per_s": last.get("tokens_per_s"), "student_path": last.get("student_path"),
            "student_params": last.get("student_params"), "teacher_active_params": last.get("teacher_active_params"),
            "peak_rss_bytes": last.get("peak_rss_bytes"), "peak_work_bytes": last.get("peak_work_bytes"), "peak_cuda_bytes": last.get("peak_cuda_bytes"),
            "targets": self.targets,
            "curve": [[s, _finite(p)] for s, p in full],  # from step 0, across resumes
        }
        self.out.write(r)
        if self.drop is not None:
            self.drop(r)
        self.finished += 1
        ppl = f"{r['val_ppl']:.2f}" if r["val_ppl"] is not None else "-"
        say(f"[stage 2 {self.finished}/{len(self.todo)}] {key}: {status} at step {r['steps']}, val ppl {ppl}")


@dataclass
class TrainingStateDrop:
    """Removes an ended student's Train checkpoints (stage2.keep_training_state: false): an ok student's once its
    distilled model is complete in storage, a pruned or diverged one's at once (a resumed run never trains them
    again); a failed student keeps them (the retry resumes from its last checkpoint)."""

    store: RunStorage
    quiet: bool = False

    def __call__(self, r: dict) -> None:
        if r["status"] not in ("ok", "pruned", "diverged"):
            return
        path = r.get("student_path") if r["status"] == "ok" else None
        if r["status"] == "ok" and path is None:
            return
        if self.store.drop_training_state(r["key"], path) and not self.quiet:
            say(f"[stage 2] {r['key']}: training state removed from storage (stage2.keep_training_state=true keeps it)")


def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def mlflow_fields(r: dict) -> Logged:
    """A student's final MLflow values (its curves were logged as they came; they keep the plain names)."""
    names = {"val_ppl": "final_val_ppl", "best_val_ppl": "best_val_ppl", "val_ppl_initial": "initial_val_ppl", "tokens_per_s": "mean_tokens_per_s",
             "peak_rss_bytes": "peak_rss_bytes", "peak_work_bytes": "peak_work_bytes", "peak_cuda_bytes": "peak_cuda_bytes"}
    return Logged({"stage": 2, **{k: r[k] for k in ("key", "pair", "baseline", "stage1_ppl")}},
                  {names[k]: r[k] for k in names if r.get(k) is not None},
                  {"student_path": r["student_path"], "targets": r.get("targets"), "duplicate_of": r.get("duplicate_of"),
                   **run_tags(2, r["pair"], "baseline" if r["baseline"] else "promoted")})


# ---- the sweep ----------------------------------------------------------------------------------
STAGE1_KEYS = ("model", "calib", "grid")  # what decided the promotions: stage 2 must not change them
STAGE2_KEYS = ("distill", "stage2")  # what a started stage 2 must keep (ray, mlflow, stage3 may change)


def check_stage2_config(rd: RunDir, cfg: SweepConfig) -> None:
    """`cfg` may run stage 2 of `rd` (checked once, before a command's work): stage 1's settings unchanged,
    and a started stage 2's too."""
    saved1 = load_config(rd.config).to_dict()
    new = cfg.to_dict()
    changed = [k for k in STAGE1_KEYS if new[k] != saved1[k]]
    if changed:
        raise M2DError(f"{', '.join(changed)} differ from stage 1 of {rd}; stage 2 distils that run's promotions: use its config")
    if rd.stage2_config.exists():
        saved2 = load_config(rd.stage2_config).to_dict()
        diff = [k for k in STAGE2_KEYS if new[k] != saved2[k]]
        if diff:
            raise M2DError(f"stage 2 of {rd} was started with other settings ({', '.join(diff)}); resume it unchanged or use a new run directory")


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


@dataclass(frozen=True)
class Stage2Result:
    records: list[dict]  # the ledger's
    targets_s: float = 0.0  # the cached targets pass (0: online, or no student to distil): what the plan's targets row estimates


def run_stage2(cfg: SweepConfig, run_dir: str | Path | RunDir, tracking_uri: str | None = None, store: RunStorage | None = None) -> Stage2Result:
    """Distil every promotion of the finished stage 1 in `run_dir` (+ baselines), workers reading and
    writing `store` (default: the config's storage, else the run directory)."""
    rd = RunDir(run_dir.path if isinstance(run_dir, RunDir) else run_dir)
    if not rd.promotions.exists():
        raise M2DError(f"{rd} has no {rd.promotions.name}: finish stage 1 first (m2d sweep --resume {rd})")
    if not rd.stage2_config.exists():  # the settings a resumed stage 2 must keep
        dump_config(cfg, rd.stage2_config)
    params = {f"stage2.{k}": v for k, v in cfg.to_dict()["distill"].items()}  # as written (MLflow params never change)
    promotions = rd.read_promotions()
    model = promotions["teacher"]
    todo_all = students(promotions, cfg.stage2.baselines, cfg.stage2.pairs)
    tracker = run_tracker(cfg, rd, tracking_uri)
    parent = sweep_parent(tracker, rd, cfg.name)
    tracker.log(parent, params=params)
    out = StageRecorder(rd.stage2_ledger(), tracker, parent, mlflow_fields, prefix="stage2/")
    out.reconcile()  # a kill between the ledger and MLflow: logged now
    plans = rd.read_plans()["plans"] if any(s.baseline is None for s in todo_all) else {}
    dups = duplicates(todo_all, plans)
    done = {r["key"]: r["status"] for r in out.ledger.records()}
    pending = [s for s in todo_all if done.get(s.key, "failed") == "failed" and s.key not in dups]  # a failed student is tried again
    retried = sum(s.key in done for s in pending)
    say(f"stage 2: {len(todo_all)} students ({len(todo_all) - len(cfg.stage2.baselines)} promoted + baselines), {len(pending)} to distil"
        + (f", {len(dups)} repeating another's plan (distilled once)" if dups else "")
        + (f" ({retried} failed before: retried from their last checkpoint)" if retried else ""))
    targets_s = 0.0
    if pending:
        ensure_ray(cfg.ray)
        store = store or RunStorage(cfg.storage or str(rd.path))
        store.mark()
        drop = None if cfg.stage2.keep_training_state else TrainingStateDrop(store)
        recorder = Recorder({s.key: s for s in pending}, out, str(cfg.target_spec() or "online"), cfg.ray.max_failures, drop)
        workers_model = store.put_model(model)
        eval_data = store.put_data(cfg.distill.eval_data or cfg.eval.data)
        distill = dataclasses.replace(cfg.distill, train_data=store.put_data(cfg.distill.train_data), eval_data=eval_data)
        d2d = None
        if any(s.baseline == D2D for s in pending):
            try:
                d2d = d2d_student(cfg, rd, store, workers_model, store.put_model(dense_teacher(cfg)))
            except SearchFailed as exc:  # that student's failure: recorded, and the others go on
                recorder.record(f"baseline-{D2D}", "failed", {}, error=str(exc))
                pending = [s for s in pending if s.baseline != D2D]
        if pending:
            teachers = {workers_model: model, **({d2d.teacher: dense_teacher(cfg)} if d2d else {})}  # as workers reach them: local names
            toks = {t: tokens(store, t, load_tokenizer(name), distill, eval_data) for t, name in teachers.items()}
            spec = cfg.target_spec()  # the teacher once: its targets cached for every student (a dense teacher has no routing)
            t_targets = time.time()
            targ = {t: shard_targets(store, t, toks[t], spec, distill if t == workers_model else dataclasses.replace(distill, teacher_topk=None),
                                     cfg.calib, cfg.ray) for t in teachers} if spec else {}
            targets_s = time.time() - t_targets if spec else 0.0
            _tune(dataclasses.replace(cfg, distill=distill), workers_model, store, plans, eval_data, toks, targ, rd, pending, recorder, d2d)
    copy_duplicates(out, todo_all, dups)
    records = out.ledger.records()
    if not cfg.stage2.keep_training_state:  # also what a run killed between a ledger record and its removal left
        drop = TrainingStateDrop(store or RunStorage(cfg.storage or str(rd.path)), quiet=True)
        for r in records:
            if "duplicate_of" not in r:
                drop(r)
    from m2d_ray.report.stage2 import write_stage2

    outputs = write_stage2(records, [s.key for s in todo_all], rd.path)
    tracker.artifacts(parent, outputs)
    tracker.finish(parent)
    return Stage2Result(records, targets_s)


def failures(cfg: SweepConfig) -> tune.FailureConfig:
    """Tune's retries of a student's trial: a lost node (spot reclaim) ends the trial and the Train controller
    beside it, which Train's own FailureConfig cannot bring back; the retry resumes from the last checkpoint."""
    return tune.FailureConfig(max_failures=cfg.ray.max_failures, fail_fast=False)


def _tune(cfg: SweepConfig, model: str, store: RunStorage, plans: dict, eval_data: str, toks: dict[str, str], targ: dict[str, str],
          rd: RunDir, pending: list[Student], recorder: Recorder, d2d: PrunedSpec | None) -> None:
    board = StopBoard.options(**on_driver_node()).remote()
    waiting = for_stage("stage2", cfg)
    trainable = tune.with_parameters(stage2_trainable, model=model, store=store, plans=plans, cfg=cfg, eval_data=eval_data, tokens=toks,
                                     targets=targ, board=board, d2d=d2d)
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 0.5}),
        param_space={"student": tune.grid_search([s.params() for s in pending])},
        tune_config=tune.TuneConfig(
            scheduler=_scheduler(cfg, board), max_concurrent_trials=cfg.students_at_once(),
            trial_name_creator=lambda t: t.config["student"]["key"], trial_dirname_creator=lambda t: t.config["student"]["key"],
        ),
        run_config=tune.RunConfig(
            name=f"stage2-{time.strftime('%Y%m%d-%H%M%S')}", **storage.ray_storage(store.tune(2)),
            callbacks=[recorder, tune_check(waiting)], verbose=0, failure_config=failures(cfg),
        ),
    )
    try:
        with waiting:
            fit_tuner(tuner, f"m2d run --resume {rd}")
    finally:
        ray.kill(board)
