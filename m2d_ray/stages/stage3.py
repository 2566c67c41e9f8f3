"""Stage 3 on Ray: lm-eval of every distilled student (and the teacher), one Ray task per model.

    RUN_DIR/stage2/trials/*.json (stage 2)  students with a saved model (finished ones; ASHA-pruned
                                            students were stopped before their export)
    one Ray task per model                  1 GPU each when the cluster has GPUs, else 1 CPU / 1 thread
    RUN_DIR/stage3/results/<key>.json       per-task accuracy + unweighted mean, written as each task ends
    MLflow                                  one nested run `stage3/<key>` per model under the sweep's parent

Resume skips models with a result. A changed suite (tasks, shots, limit) is refused: it would mix two
suites in one table.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray

from m2d_ray import storage
from m2d_ray.artifacts import write_json_atomic
from m2d_ray.config import D2D, SweepConfig, Stage3Config
from m2d_ray.console import say
from m2d_ray.errors import M2DError
from m2d_ray.peaks import peaks, reset_peaks
from m2d_ray.run_dir import D2D_TEACHER_KEY, TEACHER_KEY, Ledger, RunDir
from m2d_ray.stages.d2d import dense_teacher
from m2d_ray.stages.demand import for_stage
from m2d_ray.stages.ray_env import ensure_ray, failure
from m2d_ray.stages.record import Logged, StageRecorder
from m2d_ray.stages.run_storage import RunStorage
from m2d_ray.track import model_kind, run_tags, run_tracker, sweep_parent


@dataclass(frozen=True)
class EvalJob:
    key: str  # the stage-2 key, "teacher", or "teacher-d2d" (the d2d baseline's dense teacher)
    pair: str  # "scoring/grouping", a baseline's name, or "teacher"
    model: str  # absolute model directory (or hub name for the teacher)


def jobs(rd: RunDir, teacher: str, with_teacher: bool, dense: str | None = None) -> list[EvalJob]:
    """The models to evaluate: stage-2 students that were exported (to the run's storage), then the teacher
    and, with the d2d baseline, its dense teacher (`dense`)."""
    out = [EvalJob(r["key"], r["pair"], r["student_path"]) for r in rd.stage2_records()
           if r.get("student_path") and not r.get("duplicate_of") and storage.exists(r["student_path"])]
    teachers = [EvalJob(TEACHER_KEY, TEACHER_KEY, teacher)] + ([EvalJob(D2D_TEACHER_KEY, D2D_TEACHER_KEY, dense)] if dense else [])
    return out + (teachers if with_teacher else [])


@ray.remote
def _evaluate_task(model: str, suite: list, c: dict, device: str, text: bytes | None, placement=None, data=None,
                   store: RunStorage | None = None) -> dict:
    """A Ray task on any node: fetch and load one model (sharded over its GPUs when its placement says so),
    run the lm-eval suite on it (1 thread on CPU: tasks run side by side). A text:PATH task's file arrives
    as bytes and the paper suite's data as a Ray object (the node need not see the driver's disk)."""
    import tempfile

    import torch

    from m2d_ray.evaluate.paper_data import ensure
    from m2d_ray.evaluate.runner import evaluate_model

    if store is not None:
        store.ensure_visible()  # this node sees the run's storage (checked once per node)
    torch.set_num_threads(c["threads_per_task"])
    reset_peaks()  # a reused worker's earlier peak is not this model's
    t0 = time.time()
    if data is not None:
        ensure(data)
    with tempfile.TemporaryDirectory(prefix="m2d-text-") as tmp:
        path = None
        if text is not None:
            path = Path(tmp) / "text.txt"
            path.write_bytes(text)
        out = evaluate_model(model, [tuple(t) for t in suite], placement, device, limit=c["limit"], text=path)
    return {**out, "eval_s": round(time.time() - t0, 1), "placement": placement.describe(), **peaks()}


def _gpus(cfg: SweepConfig) -> float:
    c = cfg.stage3
    return c.gpus_per_task if c.gpus_per_task is not None else float(cfg.uses_gpus())


def _suite(c: Stage3Config) -> dict:
    from m2d_ray.evaluate.harness import parse_tasks, text_source

    return {"tasks": parse_tasks(c.tasks, c.num_fewshot), "text": text_source(c.tasks), "limit": c.limit}


def check_suite(rd: RunDir, c: Stage3Config) -> dict:
    """The suite of `c`; a started stage 3 must keep its suite (two suites would mix in one table)."""
    suite = _suite(c)
    if rd.suite.exists():
        saved = json.loads(rd.suite.read_text())
        if saved != json.loads(json.dumps(suite)):
            raise M2DError(f"stage 3 of {rd} used another suite ({saved['tasks']}, limit {saved['limit']}); "
                           "keep stage3.tasks / num_fewshot / limit unchanged or use a new run directory")
    return suite


def mlflow_fields(r: dict) -> Logged:
    metrics = {f"acc.{name}": t["score"] for name, t in r["tasks"].items() if t.get("score") is not None}
    if r.get("mean") is not None:
        metrics["mean_acc"] = r["mean"]
    return Logged({"stage": 3, "pair": r["pair"], "model": r["model"]}, metrics, run_tags(3, r["pair"], model_kind(r["key"])))


def run_stage3(cfg: SweepConfig, run_dir: str | Path | RunDir, tracking_uri: str | None = None, store: RunStorage | None = None) -> dict[str, dict]:
    """Evaluate every exported student (+ the teacher) of `run_dir`; returns {key: result record}."""
    rd = RunDir(run_dir.path if isinstance(run_dir, RunDir) else run_dir)
    if not rd.promotions.exists():
        raise M2DError(f"{rd} has no {rd.promotions.name}: run stages 1 and 2 first (m2d run)")
    c = cfg.stage3
    suite = check_suite(rd, c)  # checks a text:PATH file on the driver
    if not rd.suite.exists():
        write_json_atomic(rd.suite, suite)
    teacher = rd.read_promotions()["teacher"]
    todo = jobs(rd, teacher, c.teacher, dense_teacher(cfg) if D2D in cfg.stage2.baselines else None)
    tracker = run_tracker(cfg, rd, tracking_uri)
    parent = sweep_parent(tracker, rd, cfg.name)
    out = StageRecorder(Ledger(rd.stage3_results), tracker, parent, mlflow_fields, prefix="stage3/")
    out.reconcile()  # a kill between the result file and MLflow
    done = {r["key"]: r for r in out.ledger.records()}
    pending = [j for j in todo if done.get(j.key, {}).get("status") != "ok"]  # a failed model is tried again
    retried = sum(j.key in done for j in pending)
    say(f"stage 3: {len(todo)} models ({c.tasks}), {len(pending)} to evaluate" + (f" ({retried} failed before: retried)" if retried else ""))
    if pending:
        ensure_ray(cfg.ray)
        store = store or RunStorage(cfg.storage or str(rd.path))
        store.mark()
        gpus = _gpus(cfg)
        device = "cuda" if gpus > 0 else "cpu"
        opts = {"num_cpus": c.cpus_per_task, "num_gpus": gpus, "max_retries": cfg.ray.max_failures,
                **({"accelerator_type": c.accelerator} if gpus > 0 and c.accelerator else {})}
        text = Path(suite["text"]).read_bytes() if suite["text"] else None
        teachers = {j.key: store.put_model(j.model) for j in pending if j.key in (TEACHER_KEY, D2D_TEACHER_KEY)}
        from m2d_ray.evaluate.runner import data_ref, stage3_placements  # GPUs and batch per model, from memory

        places = stage3_placements({j.key: teachers.get(j.key, j.model) for j in pending}, c, gpus)
        data = data_ref(suite["tasks"])
        refs = {_evaluate_task.options(**{**opts, "num_gpus": places[j.key].gpus}).remote(
                    teachers.get(j.key, j.model), suite["tasks"], asdict(c), device, text, places[j.key], data, store): j for j in pending}
        with for_stage("stage3", cfg, gpus) as waiting:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=waiting.poll)
                waiting.check()  # a request the autoscaler says no node type holds fails the stage
                if not ready:
                    continue
                job = refs.pop(ready[0])
                try:
                    r = {**asdict(job), "status": "ok", **ray.get(ready[0])}
                except Exception as exc:  # one model failing does not stop the others
                    error = failure(str(exc), "stage 3", cfg.ray.max_failures, cfg.ray.max_failures)  # Ray retried it max_retries times
                    r = {**asdict(job), "status": "failed", "error": error[:300], "tasks": {}, "mean": None}
                out.write(r)
                done[job.key] = r
                mean = f"{r['mean']:.4f}" if r.get("mean") is not None else r["status"]
                say(f"[stage 3 {len(done)}/{len(todo)}] {job.key}: mean accuracy {mean}")
    for r in rd.stage2_records():  # a student distilled for two pairs is evaluated once, reported under both
        twin = done.get(r.get("duplicate_of") or "")
        if twin is not None and done.get(r["key"], {}).get("status") != twin["status"]:
            done[r["key"]] = {**twin, "key": r["key"], "pair": r["pair"], "duplicate_of": twin["key"]}
            out.write(done[r["key"]])
    tracker.finish(parent)
    return done
