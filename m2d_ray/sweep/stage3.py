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

from m2d_ray.artifacts import write_json_atomic
from m2d_ray.config import D2D, SweepConfig, Stage3Config
from m2d_ray.console import say
from m2d_ray.errors import M2DError
from m2d_ray import storage
from m2d_ray.sweep.d2d import TEACHER_KEY as D2D_TEACHER
from m2d_ray.sweep.d2d import dense_teacher
from m2d_ray.sweep.ledger import Ledger
from m2d_ray.sweep.placement import run_storage, teacher_for_workers
from m2d_ray.sweep.ray_env import ensure_ray
from m2d_ray.track import LOGGED_TAG, Tracker, run_tracker, sweep_parent

STAGE3_DIR, SUITE_FILE, TEACHER_KEY = "stage3", "suite.json", "teacher"


@dataclass(frozen=True)
class EvalJob:
    key: str  # the stage-2 key, "teacher", or "teacher-d2d" (the d2d baseline's dense teacher)
    pair: str  # "scoring/grouping", a baseline's name, or "teacher"
    model: str  # absolute model directory (or hub name for the teacher)


def jobs(run_dir: Path, teacher: str, with_teacher: bool, dense: str | None = None) -> list[EvalJob]:
    """The models to evaluate: stage-2 students that were exported (to the run's storage), then the teacher
    and, with the d2d baseline, its dense teacher (`dense`)."""
    records = Ledger(run_dir / "stage2").records() if (run_dir / "stage2" / "trials").exists() else []
    out = [EvalJob(r["key"], r["pair"], r["student_path"]) for r in records if r.get("student_path") and storage.exists(r["student_path"])]
    teachers = [EvalJob(TEACHER_KEY, TEACHER_KEY, teacher)] + ([EvalJob(D2D_TEACHER, D2D_TEACHER, dense)] if dense else [])
    return out + (teachers if with_teacher else [])


@ray.remote
def _evaluate_task(model: str, suite: list, c: dict, device: str, text: bytes | None, placement=None, data=None) -> dict:
    """A Ray task on any node: fetch and load one model (sharded over its GPUs when its placement says so),
    run the lm-eval suite on it (1 thread on CPU: tasks run side by side). A text:PATH task's file arrives
    as bytes and the paper suite's data as a Ray object (the node need not see the driver's disk)."""
    import tempfile

    import torch

    from m2d_ray.evaluate.paper_data import ensure
    from m2d_ray.evaluate.runner import evaluate_model

    torch.set_num_threads(c["threads_per_task"])
    t0 = time.time()
    if data is not None:
        ensure(data)
    with tempfile.TemporaryDirectory(prefix="m2d-text-") as tmp:
        path = None
        if text is not None:
            path = Path(tmp) / "text.txt"
            path.write_bytes(text)
        out = evaluate_model(model, [tuple(t) for t in suite], placement, device, limit=c["limit"], text=path)
    return {**out, "eval_s": round(time.time() - t0, 1), "placement": placement.describe()}


def uses_gpus(cfg: SweepConfig) -> bool:
    """Whether the run asks for GPUs: decided from the config, not from the GPUs up right now (a cluster
    scaling from zero GPU nodes has none until someone asks)."""
    return cfg.distill.gpus_per_worker > 0 or cfg.ray.gpus_per_trial > 0 or cfg.ray.data_gpus_per_actor > 0


def _gpus(cfg: SweepConfig) -> float:
    c = cfg.stage3
    return c.gpus_per_task if c.gpus_per_task is not None else float(uses_gpus(cfg))


def _suite(c: Stage3Config) -> dict:
    from m2d_ray.evaluate.harness import parse_tasks, text_source

    return {"tasks": parse_tasks(c.tasks, c.num_fewshot), "text": text_source(c.tasks), "limit": c.limit}


def check_suite(run_dir: Path, c: Stage3Config) -> dict:
    """The suite of `c`; a started stage 3 must keep its suite (two suites would mix in one table)."""
    suite = _suite(c)
    path = run_dir / STAGE3_DIR / SUITE_FILE
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != json.loads(json.dumps(suite)):
            raise M2DError(f"stage 3 of {run_dir} used another suite ({saved['tasks']}, limit {saved['limit']}); "
                           "keep stage3.tasks / num_fewshot / limit unchanged or use a new run directory")
    return suite


def run_stage3(cfg: SweepConfig, run_dir: str | Path, tracking_uri: str | None = None) -> dict[str, dict]:
    """Evaluate every exported student (+ the teacher) of `run_dir`; returns {key: result record}."""
    run_dir = Path(run_dir).resolve()
    prom = run_dir / "promotions.json"
    if not prom.exists():
        raise M2DError(f"{run_dir} has no promotions.json: run stages 1 and 2 first (m2d run)")
    c = cfg.stage3
    base = run_dir / STAGE3_DIR
    suite = check_suite(run_dir, c)  # checks a text:PATH file on the driver
    if not (base / SUITE_FILE).exists():
        write_json_atomic(base / SUITE_FILE, suite)
    results = base / "results"
    results.mkdir(parents=True, exist_ok=True)
    teacher = json.loads(prom.read_text())["teacher"]
    todo = jobs(run_dir, teacher, c.teacher, dense_teacher(cfg) if D2D in cfg.stage2.baselines else None)
    done = {p.stem: json.loads(p.read_text()) for p in results.glob("*.json")}
    pending = [j for j in todo if done.get(j.key, {}).get("status") != "ok"]  # a failed model is tried again
    retried = sum(j.key in done for j in pending)
    say(f"stage 3: {len(todo)} models ({c.tasks}), {len(pending)} to evaluate" + (f" ({retried} failed before: retried)" if retried else ""))
    tracker = run_tracker(cfg, run_dir, tracking_uri)
    parent = sweep_parent(tracker, run_dir, cfg.name)
    logged = tracker.logged_trials(parent)
    for key, r in done.items():  # a kill between the result file and MLflow
        if f"stage3/{key}" not in logged:
            _log(tracker, parent, r)
    if pending:
        ensure_ray(cfg.ray)
        store = run_storage(cfg, run_dir)
        gpus = _gpus(cfg)
        device = "cuda" if gpus > 0 else "cpu"
        opts = {"num_cpus": c.cpus_per_task, "num_gpus": gpus, "max_retries": cfg.ray.max_failures}
        text = Path(suite["text"]).read_bytes() if suite["text"] else None
        teachers = {j.key: teacher_for_workers(j.model, store) for j in pending if j.key in (TEACHER_KEY, D2D_TEACHER)}
        from m2d_ray.evaluate.runner import data_ref, stage3_placements  # GPUs and batch per model, from memory

        places = stage3_placements({j.key: teachers.get(j.key, j.model) for j in pending}, c, gpus)
        data = data_ref(suite["tasks"])
        refs = {_evaluate_task.options(**{**opts, "num_gpus": places[j.key].gpus}).remote(
                    teachers.get(j.key, j.model), suite["tasks"], asdict(c), device, text, places[j.key], data): j for j in pending}
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1)
            job = refs.pop(ready[0])
            try:
                r = {**asdict(job), "status": "ok", **ray.get(ready[0])}
            except Exception as exc:  # one model failing does not stop the others
                r = {**asdict(job), "status": "failed", "error": str(exc).strip().splitlines()[-1][:300], "tasks": {}, "mean": None}
            write_json_atomic(results / f"{job.key}.json", r)
            done[job.key] = r
            _log(tracker, parent, r)
            mean = f"{r['mean']:.4f}" if r.get("mean") is not None else r["status"]
            say(f"[stage 3 {len(done)}/{len(todo)}] {job.key}: mean accuracy {mean}")
    tracker.finish(parent)
    return done


def _log(tracker: Tracker, parent: str, r: dict) -> None:
    run = tracker.trial_run(parent, f"stage3/{r['key']}", {"stage": 3, "pair": r["pair"], "model": r["model"]})
    metrics = {f"acc.{name}": t["score"] for name, t in r["tasks"].items() if t.get("score") is not None}
    if r.get("mean") is not None:
        metrics["mean_acc"] = r["mean"]
    tracker.log(run, metrics=metrics, tags={"status": r["status"], "error": r.get("error"), "stage": "3"})
    tracker.finish(run, "FINISHED" if r["status"] == "ok" else "FAILED")
    tracker.log(run, tags={LOGGED_TAG: "1"})
