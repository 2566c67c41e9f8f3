"""Stage 3: lm-eval of every distilled student, the teacher and the baselines' own teachers, one Ray task per model.

    RUN_DIR/stage2/trials/*.json (stage 2)  students with a saved model (finished ones; ASHA-pruned students were
                                            stopped before their export)
    one Ray task per model                  placed by its memory (evaluate/placement.py): a GPU (or more, sharded)
                                            when the cluster has GPUs, else 1 CPU / 1 thread
    RUN_DIR/stage3/results/<key>.json       per-task accuracy + unweighted mean, written as each model ends
    MLflow                                  one nested run `stage3/<key>` per model under the run's parent

A unit is one model: its weights (per GPU when sharded) and a batch of sequences. Resume skips models with a
result; a changed suite (tasks, shots, limit) is refused: it would mix two suites in one table.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from m2d_ray import storage
from m2d_ray.accelerators import GPUS_PER_NODE
from m2d_ray.artifacts import write_json_atomic
from m2d_ray.catalog.distill import AUTO
from m2d_ray.catalog.units import MODEL
from m2d_ray.config import Stage3Config, SweepConfig
from m2d_ray.console import say
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.harness import check_tasks, parse_tasks, text_source
from m2d_ray.evaluate.paper_data import ensure
from m2d_ray.evaluate.placement import model_size, plan_eval
from m2d_ray.evaluate.runner import (  # GPUs and batch per model, from memory
    check_teacher_fits,
    data_ref,
    evaluate_model,
    max_length,
    parse_batch,
    stage3_placements,
)
from m2d_ray.peaks import peaks, reset_peaks
from m2d_ray.plan.bill import StageCost
from m2d_ray.plan.cost import side_by_side
from m2d_ray.plan.devices import bundle, holders, smallest_gpu
from m2d_ray.plan.flops import forward_flops
from m2d_ray.plan.run_plan import unit
from m2d_ray.plan.suite import suite_tokens
from m2d_ray.report.analysis import distill_rows
from m2d_ray.report.page import render
from m2d_ray.report.run import distill_table, figure, marginal_figure, matched_table
from m2d_ray.run_dir import TEACHER_KEY, Ledger, RunDir
from m2d_ray.runtime.record import Logged
from m2d_ray.sizes import parse_size
from m2d_ray.stages import baselines
from m2d_ray.stages.contract import Section, Stage
from m2d_ray.track import model_kind, run_tags

# Imported inside functions: Ray, torch (`m2d plan` and the checks read this module without importing them).


@dataclass(frozen=True)
class EvalJob:
    key: str  # the stage-2 key, "teacher", or a baseline's own teacher (teacher-NAME)
    pair: str  # "scoring/grouping", a baseline's name, or the teacher's key
    model: str  # absolute model directory (or hub name for the teacher)


class Stage3(Stage):
    name = "stage3"
    keys = "stage3.gpus_per_task / stage3.cpus_per_task / stage3.accelerator"

    def check(self, cfg, teacher: str) -> None:

        check_tasks(cfg.stage3.tasks, cfg.stage3.num_fewshot)
        if cfg.stage3.teacher_scores:  # read now: a file that holds no scores fails before any work
            teacher_scores(cfg.stage3.teacher_scores)
        else:
            check_teacher_fits(cfg, teacher)  # with stage3.gpu_memory set: a teacher no node can hold fails now

    def check_resume(self, rd, cfg) -> None:
        check_suite(rd, cfg.stage3)

    def request(self, cfg) -> dict:
        c, gpus = cfg.stage3, cfg.stage3_gpus()
        return bundle(c.cpus_per_task, gpus, c.accelerator if gpus else None)

    def needs(self, p):
        """One row per model: the student (every student has its shape), the teacher and the baselines' own teachers."""

        c, d = p.cfg.stage3, p.devices
        gpus, mem, per_node = gpu_room(p)
        out = []
        row = partial(unit, devices=d, keys=self.keys)
        for key, config in models_to_evaluate(p).items():
            size, seq, name = model_size(config), max_length(config, c.max_length), f"stage3:{key}"
            if gpus <= 0 or mem is None:
                e = plan_eval(
                    size,
                    None,
                    0,
                    parse_batch(c.batch_size),
                    max_length=seq,
                    host_bytes=d.host_memory if gpus <= 0 else None,
                )
                parts = {
                    "weights": e.weights,
                    "batch": (e.max_batch_size if c.batch_size == AUTO else e.batch_size) * e.sequence,
                }
                out.append(
                    row(
                        name,
                        key,
                        parts,
                        gpus if gpus > 0 else 0,
                        1,
                        bundle(c.cpus_per_task, gpus, c.accelerator),
                        fix="a smaller stage3.batch_size or stage3.max_length",
                    )
                )
                continue
            try:
                e = plan_eval(
                    size,
                    mem,
                    per_node,
                    parse_batch(c.batch_size),
                    gpu_fraction=gpus if gpus < 1 else None,
                    max_length=seq,
                    what=key,
                )
            except M2DError:  # on no number of a node's GPUs: what it would need on all of them
                parts = {
                    "weights": int(size.weights / per_node * (1.05 if per_node > 1 else 1)),
                    "batch": size.sequence_bytes(seq),
                }
                out.append(
                    row(
                        name,
                        f"{key}, sharded over {per_node}" if per_node > 1 else key,
                        parts,
                        1,
                        per_node,
                        bundle(c.cpus_per_task, per_node, c.accelerator),
                        fix=_larger(key),
                        pinned_memory=mem,
                    )
                )
                continue
            g = max(e.gpus, gpus) if gpus >= 1 else e.gpus
            weights = e.max_memory_per_gpu or e.weights
            per_gpu = weights + (e.max_batch_size if e.batch_size == AUTO else e.batch_size) * e.sequence
            out.append(
                row(
                    name,
                    key,
                    {"weights": weights, "batch": per_gpu - weights},
                    g if g < 1 else 1,
                    int(max(1, g)),
                    bundle(c.cpus_per_task, g, c.accelerator),
                    fix=_larger(key),
                    pinned_memory=mem,
                )
            )
        return out

    def cost(self, c):
        """The suite's tokens through each model that stage 2 finishes (ASHA's stopped students are not exported), the
        teacher and the baselines' teachers; models of different GPU counts run at once: one row, the longest wall."""
        s3 = c.p.cfg.stage3
        tokens, mean_len = suite_tokens(s3.tasks, s3.num_fewshot, s3.limit)
        return [price_models(c, self.name, lambda shape: tokens * forward_flops(shape, int(mean_len)))]

    def run(self, ctx) -> dict[str, dict]:
        return evaluate(ctx, self)

    def sections(self, data) -> list[Section]:

        rows = distill_rows(data)
        marginal = figure(
            "marginal.png", "marginal effect of scoring and grouping", partial(marginal_figure, data, rows)
        )
        return [
            Section("Stage 2 + 3: distilled students", render([distill_table(data, rows), marginal])),
            Section("Matched parameters: MoE-to-dense against the baselines", render([matched_table(data, rows)])),
        ]


def models_to_evaluate(p) -> dict:
    """Stage 3's models by key, with their configs: a student (every student has its shape), the teacher and the
    baselines' own teachers."""
    c, m = p.cfg.stage3, p.models
    evaluated = c.teacher and not c.teacher_scores
    return {"student": m.student_config, **({TEACHER_KEY: m.teacher_config} if evaluated else {}), **p.teacher_configs}


def _larger(key: str) -> str:
    """What lets a model no node holds be evaluated; the teacher's scores may come from elsewhere instead."""
    own = ", or its scores from elsewhere: stage3.teacher_scores=FILE" if key == TEACHER_KEY else ""
    return f"nodes with more or larger GPUs, or a shorter stage3.max_length{own}"


def teacher_scores(path: str) -> dict:
    """stage3.teacher_scores read as a stage-3 result ({"tasks": {task: {"score"}}, "mean"}), or one line saying
    what is wrong with the file."""
    try:
        raw = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise M2DError(
            f"stage3.teacher_scores={path}: {type(e).__name__}: {e}; give a JSON file of the scores"
        ) from None
    tasks = raw.get("tasks", raw) if isinstance(raw, dict) else None
    scores = {
        t: v.get("score") if isinstance(v, dict) else v for t, v in (tasks.items() if isinstance(tasks, dict) else ())
    }
    if not scores or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scores.values()):
        raise M2DError(
            f"stage3.teacher_scores={path} holds no scores; give {{task: score}} or a stage-3 record "
            '({"tasks": {task: {"score": ...}}})'
        )
    return {"tasks": {t: {"score": float(v)} for t, v in scores.items()}, "mean": sum(scores.values()) / len(scores)}


def gpu_room(p) -> tuple[float, int | None, int]:
    """(GPUs a model's task asks for, one GPU's memory (None: unknown, or CPU), the most GPUs of a node)."""
    c, d = p.cfg.stage3, p.devices
    gpus = p.cfg.stage3_gpus()
    found = (
        holders(list(d.nodes), bundle(c.cpus_per_task, min(gpus, 1), c.accelerator))
        if d.nodes is not None and gpus > 0
        else None
    )
    mem = d.gpu_memory or (smallest_gpu(found) if found else None) or parse_size(c.gpu_memory)  # checked at load
    per_node = d.gpus_per_node or c.gpus_per_node or max((int(n.gpus) for n in (found or [])), default=GPUS_PER_NODE)
    return gpus, mem, per_node


def price_models(c, name: str, flops_of, unit: str = MODEL, rounds: int = 1) -> StageCost:
    """The bill of `flops_of(shape)` through each model stage 3 evaluates (each student stage 2 finishes: ASHA's stopped
    students are not exported; the teacher; the baselines' teachers), placed as the rows `name:KEY` of the plan say,
    each with the start of a `unit` (default a model: plan.model_s) in `rounds` Ray rounds; models of different GPU
    counts run at once: one row, the longest wall."""
    p, s3 = c.p, c.p.cfg.stage3
    teacher = [(TEACHER_KEY, p.models.teacher)] if s3.teacher and not s3.teacher_scores else []
    models = [("student", p.models.student)] * p.ends[-1][1] + teacher + list(p.teachers.items())
    by_gpus: dict[float, list[float]] = {}
    for key, shape in models:
        plan = c.plans.get(f"{name}:{key}")
        by_gpus.setdefault(plan.units * plan.share if plan else 0.0, []).append(flops_of(shape))
    rows = []
    for gpus, flops in sorted(by_gpus.items()):
        wanted = len(flops) if gpus > 0 else max(1, int(p.cfg.ray.num_cpus // max(s3.cpus_per_task, 1e-9)))
        plan = c.plans.get(f"{name}:{models[0][0]}") or next(v for k, v in c.plans.items() if k.startswith(name))
        where = c.place(
            plan.name,
            gpus,
            s3.threads_per_task,
            wanted,
            s3.accelerator,
            {**plan.request, "GPU": min(gpus, 1.0) if gpus else 0.0},
        )
        rows.append(c.stage(name if len(by_gpus) == 1 else f"{name}:{gpus:g}gpu", flops, where, unit, rounds))
    return rows[0] if len(rows) == 1 else side_by_side(name, rows)


def _suite(c: Stage3Config) -> dict:

    return {"tasks": parse_tasks(c.tasks, c.num_fewshot), "text": text_source(c.tasks), "limit": c.limit}


def check_suite(rd: RunDir, c: Stage3Config) -> dict:
    """The suite of `c`; a started stage 3 must keep its suite (two suites would mix in one table)."""
    suite = _suite(c)
    if rd.suite.exists():
        saved = json.loads(rd.suite.read_text())
        if saved != json.loads(json.dumps(suite)):
            raise M2DError(
                f"stage 3 of {rd} used another suite ({saved['tasks']}, limit {saved['limit']}); "
                "keep stage3.tasks / num_fewshot / limit unchanged or use a new run directory"
            )
    return suite


def jobs(rd: RunDir, cfg: SweepConfig, teacher: str) -> list[EvalJob]:
    """The models to evaluate: stage-2 students that were exported (to the run's storage), then the teacher and the
    baselines' own teachers."""
    out = [
        EvalJob(r["key"], r["pair"], r["student_path"])
        for r in rd.stage2_records()
        if r.get("student_path") and not r.get("duplicate_of") and storage.exists(r["student_path"])
    ]
    own = [EvalJob(b.teacher_key, b.teacher_key, b.teacher(cfg)) for b in baselines.of(cfg) if b.has_teacher]
    mine = [EvalJob(TEACHER_KEY, TEACHER_KEY, teacher)] if cfg.stage3.teacher and not cfg.stage3.teacher_scores else []
    return out + ([*mine, *own] if cfg.stage3.teacher else [])


def task_options(cfg: SweepConfig) -> dict:
    """Ray options of a model's task (its GPUs: the placement's)."""
    c, gpus = cfg.stage3, cfg.stage3_gpus()
    return {
        "num_cpus": c.cpus_per_task,
        "num_gpus": gpus,
        "max_retries": cfg.ray.max_failures,
        **({"accelerator_type": c.accelerator} if gpus > 0 and c.accelerator else {}),
    }


def reachable(ctx, todo: list[EvalJob]) -> dict[str, str]:
    """Each job's model as workers reach it: the teachers (a directory on the driver's disk) copied into the run's
    storage once on a cluster; students are in the storage already."""
    return {j.key: ctx.store.put_model(j.model) if model_kind(j.key) == "teacher" else j.model for j in todo}


def mlflow_fields(r: dict) -> Logged:
    metrics = {f"acc.{name}": t["score"] for name, t in r["tasks"].items() if t.get("score") is not None}
    if r.get("mean") is not None:
        metrics["mean_acc"] = r["mean"]
    return Logged(
        {"stage": 3, "pair": r["pair"], "model": r["model"]}, metrics, run_tags(3, r["pair"], model_kind(r["key"]))
    )


def evaluate(ctx, stage: Stage3) -> dict[str, dict]:
    """Evaluate every exported student (+ the teachers) of the run; returns {key: result record}."""
    import ray

    from m2d_ray.runtime.ray_env import failure

    cfg, rd, c = ctx.cfg, ctx.rd, ctx.cfg.stage3
    suite = check_suite(rd, c)  # checks a text:PATH file on the driver
    if not rd.suite.exists():
        write_json_atomic(rd.suite, suite)
    todo = jobs(rd, cfg, rd.read_promotions()["teacher"])
    out = ctx.recorder(Ledger(rd.stage3_results), mlflow_fields, prefix="stage3/")
    done = {r["key"]: r for r in out.ledger.records()}
    if c.teacher and c.teacher_scores and TEACHER_KEY not in done:  # read, not evaluated: said in the plan
        teacher = rd.read_promotions()["teacher"]
        done[TEACHER_KEY] = {**asdict(EvalJob(TEACHER_KEY, TEACHER_KEY, teacher)), "status": "ok"}
        done[TEACHER_KEY].update(teacher_scores(c.teacher_scores), source=c.teacher_scores)
        out.write(done[TEACHER_KEY])
    pending = [j for j in todo if done.get(j.key, {}).get("status") != "ok"]  # a failed model is tried again
    retried = sum(j.key in done for j in pending)
    say(
        f"stage 3: {len(todo)} models ({c.tasks}), {len(pending)} to evaluate"
        + (f" ({retried} failed before: retried)" if retried else "")
    )
    if pending:
        ctx.ray()
        gpus, opts = cfg.stage3_gpus(), task_options(cfg)
        device = "cuda" if gpus > 0 else "cpu"
        text = Path(suite["text"]).read_bytes() if suite["text"] else None
        models = reachable(ctx, pending)
        task = ray.remote(_evaluate_task)
        with ctx.waiting(stage) as waiting:
            places = stage3_placements(models, c, gpus, get=waiting.get)
            data = data_ref(suite["tasks"])
            refs = {
                task.options(**{**opts, "num_gpus": places[j.key].gpus}).remote(
                    models[j.key],
                    suite["tasks"],
                    asdict(c),
                    device,
                    text,
                    places[j.key],
                    data,
                    ctx.store,
                ): j
                for j in pending
            }
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=waiting.poll)
                waiting.check()  # a request the autoscaler says no node type holds fails the stage
                if not ready:
                    continue
                job = refs.pop(ready[0])
                try:
                    r = {**asdict(job), "status": "ok", **ray.get(ready[0])}
                except Exception as exc:  # one model failing does not stop the others
                    error = failure(
                        str(exc), "stage 3", cfg.ray.max_failures, cfg.ray.max_failures
                    )  # Ray retried it max_retries times
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
    ctx.tracker.finish(ctx.parent())
    return done


def _evaluate_task(
    model: str, suite: list, c: dict, device: str, text: bytes | None, placement=None, data=None, store=None
) -> dict:
    """A Ray task on any node: fetch and load one model (sharded over its GPUs when its placement says so),
    run the lm-eval suite on it (1 thread on CPU: tasks run side by side). A text:PATH task's file arrives
    as bytes and the paper suite's data as a Ray object (the node need not see the driver's disk)."""
    import torch

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


STAGE = Stage3()
