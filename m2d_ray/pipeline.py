"""The stage order, top to bottom. Each function is one CLI command.

    load teacher -> tokenise calibration text -> calibrate (stats artifact)
      -> plan (score, select, group, scale) -> build dense student -> export + verify -> perplexity
    sweep (stage 1): calibrate on Ray Data -> plan the whole grid -> Ray Tune over distinct students
      -> stage1 table + promotions.json (the input of stage 2)
    run (everything): calibrate -> stage 1 -> promote -> stage 2 (distil, ASHA) -> stage 3 (lm-eval)
      -> report, under one MLflow parent run; each stage resumes where a killed run stopped
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from m2d_ray.artifacts import check_output, output_kind, write_json_atomic
from m2d_ray.calibrate import StatsArtifact, calibrate, data_fingerprint
from m2d_ray.calibrate.artifact import load_matching, load_stats
from m2d_ray.calibrate.tokens import calibration_tokens, resolve_calib
from m2d_ray.console import say
from m2d_ray.convert import build_from_plan, make_plan
from m2d_ray.convert.baselines import BASELINES
from m2d_ray.convert.export import export_student
from m2d_ray.convert.plan import check_K, check_methods
from m2d_ray.data.text import check_spec, load_text, tokenize
from m2d_ray.errors import M2DError, RunFailed
from m2d_ray.evaluate.perplexity import Perplexity, perplexity
from m2d_ray.models import Teacher, check_teacher, default_teacher, load_config as model_config, load_tokenizer, model_fingerprint
from m2d_ray.weights import LazyTeacher, open_teacher

EVAL_MAX_CHARS = 300_000


def device_default() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_calibrate(
    model: str | None,
    calib_data: str | None,
    out: str | Path | None,
    max_tokens: int = 32768,
    seq_len: int = 256,
    batch_size: int = 8,
    device: str | None = None,
    teacher: Teacher | LazyTeacher | None = None,
    overwrite: bool = False,
    what: str = "--out",
    stream: bool | None = None,
    max_memory: str | None = None,
) -> tuple[Teacher | LazyTeacher | None, StatsArtifact, bool]:
    """Stage 0: the statistics artifact; `out` is reused when it matches (teacher None then, unless given).

    Everything but the weights is checked first: the teacher's config and files, the data, the output,
    the memory budget. The teacher is opened lazily; it is streamed layer by layer when `stream` is set
    or it does not fit `max_memory` (default: the device's free memory), else loaded whole.
    """
    from m2d_ray.calibrate.stream import parse_size

    name = model or default_teacher()
    check_teacher(name)
    parse_size(max_memory)
    check_spec(resolve_calib(calib_data, model), "calibration data")
    if out is not None:
        check_output(out, "statistics", overwrite=True, what=what)  # never a file or a foreign directory
    tokenizer = teacher.tokenizer if teacher else load_tokenizer(name)
    spec, tokens = calibration_tokens(tokenizer, calib_data, model, seq_len, max_tokens)
    if out is not None:
        found = load_matching(out, model_fingerprint(name, model_config(name)), data_fingerprint(spec, tokens))
        if found is not None:
            return teacher, found, True
        check_output(out, "statistics", overwrite, what)  # other statistics: replaced only on --overwrite
    device = device or device_default()
    teacher = teacher or open_teacher(name, device=device)
    art, _ = calibrate(teacher, tokens, spec, out=out, batch_size=batch_size, device=device, stream=stream, max_memory=max_memory,
                       overwrite=overwrite)
    return teacher, art, False


def evaluate_ppl(model, tokenizer, eval_data: str, seq_len: int = 256, max_chars: int | None = EVAL_MAX_CHARS, batch_size: int = 8) -> Perplexity:
    ids = tokenize(tokenizer, load_text(eval_data), max_chars=max_chars)
    return perplexity(model, ids, seq_len=seq_len, batch_size=batch_size, progress=True)


def convert_one(
    model: str | None,
    scoring: str,
    grouping: str,
    scaling: str,
    K: int | None,
    out: str | Path,
    stats: str | None = None,
    calib_data: str | None = None,
    eval_data: str | None = None,
    baseline: str | None = None,
    device: str | None = None,
    calib_kwargs: dict | None = None,
    overwrite: bool = False,
) -> dict:
    """Stages 0-2 for one recipe: statistics -> plan -> dense student -> verified export (-> ppl).

    Every input (methods, output path, teacher files, K, statistics, data) is checked before the
    teacher's weights are read. The teacher is opened lazily: the student reads only the tensors it is
    made of (calibration may still load it whole when it fits, see run_calibrate).
    """
    if baseline:
        BASELINES.check(baseline)
    else:
        check_methods(scoring, grouping, scaling)
    check_output(out, "student", overwrite)
    name = model or default_teacher()
    adapter, config = check_teacher(name), model_config(name)
    k, E = adapter.top_k(config), adapter.num_experts(config)
    K = k if K is None else K
    check_K(K, k, E)
    art = None
    if not baseline and stats and not calib_data:
        art = load_stats(stats)
        if art.manifest["model"]["config_sha256"] != model_fingerprint(name, config)["config_sha256"]:
            raise M2DError(f"statistics in {stats} were computed for {art.manifest['model']['name']}, not this model; recalibrate")
    if eval_data:
        check_spec(eval_data, "evaluation data")
    teacher = None
    if not baseline and art is None:
        teacher, art, _ = run_calibrate(model, calib_data, stats, device=device, overwrite=overwrite, what="--stats", **(calib_kwargs or {}))
    teacher = teacher or open_teacher(name, device=device or device_default())  # weights read as the student needs them
    result: dict = {"model": teacher.name, "k": k, "E": E}
    if baseline:
        export_student(BASELINES[baseline](teacher), teacher.tokenizer, out, overwrite=overwrite)
        result.update(baseline=baseline)
    else:
        plan = make_plan(teacher, art.layers, scoring, grouping, scaling, K)
        check = export_student(build_from_plan(teacher, plan), teacher.tokenizer, out, teacher=teacher, plan=plan,
                               extra={"stats_sha256": art.checksum}, overwrite=overwrite)  # one student in memory at a time
        result.update(
            scoring=scoring, grouping=grouping, scaling=scaling, K=K,
            selected={str(i): p.selected for i, p in plan.layers.items()},
            groups={str(i): p.groups for i, p in plan.layers.items()},
            scales={str(i): p.alphas for i, p in plan.layers.items()},
            effective_rank={str(i): round(p.erank, 4) for i, p in plan.layers.items()},
            signature=plan.signature(),
            max_rel_error=check["max_rel_error"],
            stats_sha256=art.checksum,
        )
    result.update(dense_class=json.loads((Path(out) / "config.json").read_text())["architectures"][0], out=str(out))
    if eval_data:
        from m2d_ray.models import load_model

        student, _ = load_model(str(out), device=device or device_default())  # the exported student, as users load it
        result["perplexity"] = evaluate_ppl(student, teacher.tokenizer, eval_data).to_json()
    return result


# ---- runs: one directory per experiment ---------------------------------------------------------------
def new_run_path(out: str | None, cfg) -> Path:
    """The directory of a new run: never an existing run (that is --resume), a file or a foreign directory."""
    run_dir = Path(out or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}").expanduser().resolve()
    if output_kind(run_dir) == "run":
        raise M2DError(f"{run_dir} already holds an m2d run; continue it with --resume {run_dir}, or choose another --out")
    check_output(run_dir, "run")
    return run_dir


def existing_run(path: str) -> Path:
    """An existing run directory (to resume or report on): one that m2d made (its marker, or an older run's files)."""
    from m2d_ray.sweep.stage1 import CONFIG_FILE, STATE_FILE

    run_dir = Path(path).expanduser().resolve()
    if output_kind(run_dir) != "run" and not ((run_dir / CONFIG_FILE).is_file() and (run_dir / STATE_FILE).is_file()):
        raise M2DError(f"{run_dir} is not an m2d run directory; m2d run CONFIG --out DIR (or m2d sweep) makes one")
    return run_dir


def check_run_inputs(cfg, stages: tuple[int, ...] = (1,), tracking_uri: str | None = None) -> None:
    """Every input the stages of a run will read, checked on the driver before anything is written.

    The teacher's weights are read once, one tensor at a time, for NaN/inf (local checkpoints); workers
    that load it later need not fail one by one. A tracking server named by the user must answer.
    """
    from m2d_ray.checkpoint import scan
    from m2d_ray.config import D2D
    from m2d_ray.distill.data import absolute_spec, check_source
    from m2d_ray.models import check_teacher_topk
    from m2d_ray.sweep.grid import expand

    model = cfg.model or default_teacher()
    adapter, config = check_teacher(model), model_config(model)
    expand(cfg.grid, adapter.top_k(config), adapter.num_experts(config))  # K within [k, E]
    check_spec(resolve_calib(cfg.calib.data, cfg.model), "calib.data")
    check_spec(cfg.eval.data, "eval.data")
    if 2 in stages:
        check_spec(cfg.distill.eval_data or cfg.eval.data, "distill.eval_data")
        check_teacher_topk(model, cfg.distill.teacher_topk)
        check_source(absolute_spec(cfg.distill.train_data))
        if D2D in cfg.stage2.baselines:
            from m2d_ray.sweep.d2d import check_dense_teacher, dense_teacher

            check_dense_teacher(dense_teacher(cfg))
    if 3 in stages:
        from m2d_ray.evaluate.harness import check_tasks

        check_tasks(cfg.stage3.tasks, cfg.stage3.num_fewshot)
        from m2d_ray.evaluate.runner import check_teacher_fits

        check_teacher_fits(cfg, model)  # with stage3.gpu_memory set: a teacher no node can hold fails now
    if tracking_uri or cfg.mlflow.tracking_uri:
        from m2d_ray.track import Tracker

        Tracker(tracking_uri or cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    if cfg.storage:
        from m2d_ray.sweep.placement import check_storage

        check_storage(cfg.storage)
    scan(model, "teacher")


def sweep(
    config: str | None,
    overrides: list[str],
    out: str | None = None,
    resume: str | None = None,
    tracking_uri: str | None = None,
    model: str | None = None,
    calib_data: str | None = None,
    eval_data: str | None = None,
) -> dict:
    """Stage 1 (a new grid, or --resume) or, with stage=2 and --resume RUN_DIR, stage 2 on its promotions."""
    from m2d_ray.config import load_config
    from m2d_ray.sweep.stage1 import CONFIG_FILE, run_stage1

    cli = [f"{k}={v}" for k, v in (("model", model), ("calib.data", calib_data), ("eval.data", eval_data)) if v]
    if resume:
        run_dir = existing_run(resume)
        cfg = load_config(config or run_dir / CONFIG_FILE, [*overrides, *cli])
        if cfg.stage == 2:
            check_resume(run_dir, cfg, tracking_uri, (2,))
            keep_logs(run_dir)
            return _stage2_summary(run_dir, cfg, tracking_uri)
        if config or overrides or cli or out:
            raise M2DError("--resume RUN_DIR reuses the run's saved config; drop the config, overrides and --out/--model/--*-data (or add stage=2)")
        check_resume(run_dir, cfg, tracking_uri, (1,))
        cfg = None
    else:
        if config is None:
            raise M2DError("give a config (e.g. experiments/tiny.yaml) or --resume RUN_DIR")
        cfg = load_config(config, [*overrides, *cli])
        if cfg.stage == 2:
            raise M2DError("stage=2 distils the promotions of a finished stage 1: add --resume RUN_DIR")
        run_dir = new_run_path(out, cfg)
        check_run_inputs(cfg, (1,), tracking_uri)
    keep_logs(run_dir)
    res = run_stage1(cfg, run_dir, resume=bool(resume), tracking_uri=tracking_uri)
    statuses = [r["status"] for r in res.records]
    check_promoted(run_dir)
    return {
        "run_dir": str(res.run_dir),
        "configs": len(res.records),
        "status": {s: statuses.count(s) for s in sorted(set(statuses))},
        "probed": res.probed,
        "trials_run": res.evaluated,
        "full_evaluations": res.full_evaluations,
        "chunks_evaluated": res.chunks_evaluated,
        "promotions": {p: {"K": v["K"], "scaling": v["scaling"], "ppl": v["ppl"]} for p, v in res.promotions.items()},
        "wall_s": round(res.wall_s, 1),
    }


def keep_logs(run_dir: Path) -> None:
    """From here on the command's log (libraries, Ray workers) lives in RUN_DIR/logs/."""
    from m2d_ray import console

    path = console.keep_logs_in(run_dir / "logs")
    if path is not None:
        say(f"logs: {path}")


def check_resume(run_dir: Path, cfg, tracking_uri: str | None, stages: tuple[int, ...]) -> None:
    """A resumed run keeps what its finished stages were computed with; checked before anything runs."""
    from m2d_ray.config import load_config
    from m2d_ray.sweep.stage1 import CONFIG_FILE
    from m2d_ray.sweep.stage2 import check_stage2_config
    from m2d_ray.sweep.stage3 import check_suite

    saved = load_config(run_dir / CONFIG_FILE).storage
    if cfg.storage != saved:
        raise M2DError(f"{run_dir} keeps its students and checkpoints in {saved or run_dir}; resume it without changing storage")
    if 2 in stages:
        check_stage2_config(run_dir, cfg)
    if 3 in stages:
        check_suite(run_dir, cfg.stage3)
    check_run_inputs(cfg, stages, tracking_uri)


def _stage2_summary(run_dir: Path, cfg, tracking_uri: str | None) -> dict:
    from m2d_ray.sweep.stage2 import run_stage2

    records = run_stage2(cfg, run_dir, tracking_uri=tracking_uri)
    return {
        "run_dir": str(run_dir),
        "stage": 2,
        "table": str(run_dir / "stage2.csv"),
        "students": {r["key"]: {"status": r["status"], "val_ppl_initial": r["val_ppl_initial"], "val_ppl": r["val_ppl"], "student": r["student_path"]} for r in records},
    }


def distill_one(
    teacher: str | None,
    student: str,
    out: str | Path,
    eval_data: str,
    config: str | None = None,
    overrides: list[str] = (),
    overwrite: bool = False,
    store: str | None = None,
) -> dict:
    """`m2d distill`: one student (a directory, or a baseline name built from the teacher) on Ray Train.

    OUT/metrics.jsonl is the validation curve, OUT/result.json the summary, OUT/logs the log; the storage
    (`--storage`, default OUT) holds student/ (the exported student), train/ (the Ray Train checkpoints:
    running the same command again resumes) and, for a baseline, init/. A finished OUT is replaced only
    with --overwrite, and only once the new student is done (the new run is made in a hidden sibling
    directory, which a killed --overwrite run resumes from).
    """
    import dataclasses

    from m2d_ray.artifacts import replace_dir, write_marker
    from m2d_ray.checkpoint import check_files, scan
    from m2d_ray.config import RayConfig, load_config
    from m2d_ray import storage
    from m2d_ray.convert.initial import InitialStudent
    from m2d_ray.distill.data import absolute_spec, check_source
    from m2d_ray.distill.loop import DistillJob
    from m2d_ray.distill.trainer import MetricsLog, fit, follow
    from m2d_ray.models import absolute, check_teacher_topk
    from m2d_ray.sweep.placement import check_storage, check_visible, teacher_for_workers
    from m2d_ray.sweep.ray_env import ensure_ray

    cfg = load_config(config, [f"distill.{o}" if not o.startswith("distill.") else o for o in overrides]).distill
    out = check_output(out, "distillation", overwrite=True).resolve()  # never a file or a foreign directory
    finished = (out / "result.json").exists()
    if finished and not overwrite:
        raise M2DError(f"--out {out} already holds a finished distillation; pass --overwrite to replace it, or choose a new path")
    teacher = absolute(teacher or default_teacher())  # Ray Train workers run in their own directories
    check_teacher(teacher)
    check_teacher_topk(teacher, cfg.teacher_topk)
    student_dir = None
    if student not in BASELINES:
        student_dir = Path(student).expanduser().resolve()
        if not (student_dir / "config.json").is_file():
            raise M2DError(f"student {student!r} is neither a model directory nor a baseline: give a directory from m2d convert, or one of {', '.join(BASELINES.names())}")
        model_config(str(student_dir))
        check_files(str(student_dir), "student")
    eval_data = absolute_spec(eval_data)
    check_spec(eval_data, "--eval-data")
    cfg = dataclasses.replace(cfg, train_data=absolute_spec(cfg.train_data))
    check_source(cfg.train_data)
    scan(teacher, "teacher")
    if student_dir is not None:
        scan(str(student_dir), "student")
    if store is not None:
        check_storage(store)

    work = out.with_name(f".{out.name}.m2d-new") if finished else out  # --overwrite: built aside, swapped in at the end
    work.mkdir(parents=True, exist_ok=True)
    write_marker(work, "distillation")
    keep_logs(work)
    where = store or str(work)
    ensure_ray(RayConfig())
    check_visible(where)
    teacher = teacher_for_workers(teacher, where)
    init = storage.join(where, "init") if student_dir is None else str(student_dir)
    build = InitialStudent(teacher, baseline=student, seed=cfg.seed) if student_dir is None else None
    device = "cuda" if cfg.gpus_per_worker > 0 else "cpu"
    job = DistillJob(teacher, init, cfg, eval_data, out=storage.join(where, "student"), device=device, build=build)
    with follow(work / "metrics.jsonl", out.name, total=cfg.steps):
        result = fit(job, name="train", storage=where, callbacks=[MetricsLog(work / "metrics.jsonl")])
    if result.error is not None:
        raise RunFailed(f"distillation failed: {str(result.error).splitlines()[0][:300]}; fix it and run the same command to resume")
    m = result.metrics
    summary = {
        "student": storage.join(store or str(out), "student"), "steps": m["step"], "tokens": m["tokens"], "resumed_from": m["resumed_from"],
        "first_val_ppl": m["val_ppl_initial"], "last_val_ppl": m["val_ppl"], "tokens_per_s": m["tokens_per_s"],
        "loss": cfg.loss, "teacher_topk": cfg.teacher_topk, "deepspeed": cfg.deepspeed, "workers": cfg.workers,
        "metrics": str(out / "metrics.jsonl"),
    }
    write_json_atomic(work / "result.json", summary)
    if work != out:
        replace_dir(out, work)
    return summary


def evaluate_one(model: str, tasks: str = "local", num_fewshot: int | None = None, limit: int | None = None,
                 batch_size: int = 16, device: str | None = None) -> dict:
    """`m2d eval`: lm-eval of one saved model (the stage-3 measurement)."""
    from m2d_ray.checkpoint import check_files
    from m2d_ray.evaluate.harness import check_tasks
    from m2d_ray.evaluate.runner import evaluate_model, local_placement

    suite, text = check_tasks(tasks, num_fewshot)  # bad task names fail before the model loads
    model_config(model)
    check_files(model)
    device = device or device_default()
    place = local_placement(model, device, batch_size)  # sharded over this machine's GPUs if it needs them; else one line
    return {"model": model, "placement": place.describe(), **evaluate_model(model, suite, place, device, limit=limit, text=text)}


STAGES = ("stage1", "stage2", "stage3", "report")


def run(config: str | None, overrides: list[str], out: str | None = None, resume: str | None = None,
        tracking_uri: str | None = None) -> dict:
    """`m2d run`: the whole pipeline into one run directory (RUN_DIR/run.json records each stage's wall time).

    A finished stage is skipped on --resume (stage 1 once promotions.json exists; stages 2 and 3 skip
    the students and models already in their ledgers); the report is always rewritten.
    """
    from m2d_ray.config import load_config
    from m2d_ray.sweep.stage1 import CONFIG_FILE, STATE_FILE, run_stage1
    from m2d_ray.sweep.stage2 import run_stage2
    from m2d_ray.sweep.stage3 import run_stage3
    from m2d_ray.track import run_tracking_uri

    if resume:
        if config or out:
            raise M2DError("--resume RUN_DIR continues with the run's saved config; drop the config and --out (key=value overrides are allowed)")
        run_dir = existing_run(resume)
        cfg = load_config(run_dir / CONFIG_FILE, overrides)
        check_resume(run_dir, cfg, tracking_uri, (1, 2, 3))
    else:
        if config is None:
            raise M2DError("give a config (e.g. experiments/tiny.yaml) or --resume RUN_DIR")
        cfg = load_config(config, overrides)
        run_dir = new_run_path(out, cfg)
        check_run_inputs(cfg, (1, 2, 3), tracking_uri)
    keep_logs(run_dir)
    state_file = run_dir / "run.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"stages": {}}

    def stage(name: str, fn) -> None:
        t0 = time.time()
        say(f"== {name} ==")
        fn()
        state["stages"][name] = {"wall_s": round(time.time() - t0, 1), "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        write_json_atomic(state_file, state)

    if not (run_dir / "promotions.json").exists():
        stage("stage1", lambda: run_stage1(None if resume else cfg, run_dir, resume=(run_dir / STATE_FILE).exists(), tracking_uri=tracking_uri))
    check_promoted(run_dir)
    stage("stage2", lambda: run_stage2(cfg, run_dir, tracking_uri=tracking_uri))
    stage("stage3", lambda: run_stage3(cfg, run_dir, tracking_uri=tracking_uri))
    stage("report", lambda: report(str(run_dir), tracking_uri))
    result = {"run_dir": str(run_dir), "report": str(run_dir / "report" / "index.html"),
              "stages": {k: v["wall_s"] for k, v in state["stages"].items()},
              "mlflow_ui": f"mlflow ui --backend-store-uri {run_tracking_uri(cfg, run_dir, tracking_uri)}",
              "outcome": check_outcome(run_dir)}
    return result


def check_promoted(run_dir: Path) -> None:
    """Stage 1 that promoted nothing (every config failed or diverged) has failed: exit 1, the table says why."""
    if not json.loads((run_dir / "promotions.json").read_text())["pairs"]:
        raise RunFailed(f"stage 1 promoted no student: every config failed or diverged (see {run_dir / 'stage1.md'} and {run_dir / 'logs'})")


def check_outcome(run_dir: Path) -> dict:
    """The run's final line (students by status, models evaluated); a run that distilled no promoted
    student, or evaluated no student, has failed (exit 1) whatever else it did — the report says why."""
    from m2d_ray.report.analysis import load_run, outcome, outcome_line

    o = outcome(load_run(run_dir))
    say(f"run done: {outcome_line(o)}")
    if o["promoted"] and not o["promoted_distilled"]:
        raise RunFailed(f"no promoted student was distilled ({o['students']['failed']} failed, {o['students']['diverged']} diverged): "
                        f"see {run_dir / 'report' / 'index.html'} and {run_dir / 'logs'}")
    if not o["evaluated"]:
        raise RunFailed(f"no student was evaluated: see {run_dir / 'report' / 'index.html'} and {run_dir / 'logs'}")
    return o


def report(run_dir: str, tracking_uri: str | None = None) -> dict:
    """`m2d report`: RUN_DIR/report/ (HTML + CSV/Markdown tables + PNG figures), also logged to the run's MLflow parent."""
    from m2d_ray.config import load_config
    from m2d_ray.report.run import write_report
    from m2d_ray.track import run_tracker, sweep_parent

    rd = existing_run(run_dir)
    index = write_report(rd)
    cfg = load_config(rd / "config.yaml")
    tracker = run_tracker(cfg, rd, tracking_uri)
    parent = sweep_parent(tracker, rd, cfg.name)
    tracker.client.log_artifacts(parent, str(index.parent), artifact_path="report")
    tracker.finish(parent)
    return {"report": str(index), "files": sorted(p.name for p in index.parent.iterdir() if not p.name.startswith("."))}
