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
import sys
from pathlib import Path

import torch

from m2d_ray.calibrate import StatsArtifact, calibrate
from m2d_ray.calibrate.artifact import load_stats
from m2d_ray.convert import build_from_plan, make_plan
from m2d_ray.convert.baselines import BASELINES
from m2d_ray.convert.export import export_student
from m2d_ray.convert.plan import check_K, check_methods
from m2d_ray.data.text import calibration_set, load_text, tokenize
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.perplexity import Perplexity, perplexity
from m2d_ray.models import Teacher, default_teacher
from m2d_ray.weights import LazyTeacher, open_teacher

#: defaults of the embedded teacher's corpus; other teachers calibrate on WikiText (as the paper)
EMBEDDED_CALIB, EMBEDDED_EVAL = "synthetic:valid", "synthetic:test"
HUB_CALIB = "wikitext2:train"
EVAL_MAX_CHARS = 300_000


def resolve_calib(spec: str | None, model: str | None) -> str:
    if spec:
        return spec
    return EMBEDDED_CALIB if model in (None, default_teacher()) else HUB_CALIB


def load_text_with_fallback(spec: str) -> str:
    """Load `spec`; when WikiText cannot be fetched (offline) fall back to the embedded corpus."""
    try:
        return load_text(spec)
    except M2DError as exc:
        if not spec.startswith("wikitext2"):
            raise
        print(f"m2d: warning: {exc}; using the embedded synthetic corpus instead", file=sys.stderr)
        return load_text(EMBEDDED_CALIB)


def device_default() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def calibration_tokens(tokenizer, calib_data: str | None, model: str | None, seq_len: int, max_tokens: int):
    """(resolved data spec, TokenSet) of the calibration text, packed into padded sequences."""
    spec = resolve_calib(calib_data, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return spec, calibration_set(tokenizer, load_text_with_fallback(spec), seq_len=seq_len, max_tokens=max_tokens, pad_id=pad)


def run_calibrate(
    model: str | None,
    calib_data: str | None,
    out: str | Path | None,
    max_tokens: int = 32768,
    seq_len: int = 256,
    batch_size: int = 8,
    device: str | None = None,
    teacher: Teacher | LazyTeacher | None = None,
    stream: bool | None = None,
    max_memory: str | None = None,
) -> tuple[Teacher | LazyTeacher, StatsArtifact, bool]:
    """Stage 0: the statistics artifact (reused when `out` already matches); the teacher is streamed layer
    by layer when `stream` is set or it does not fit `max_memory` (default: the device's free memory)."""
    device = device or device_default()
    teacher = teacher or open_teacher(model, device=device)
    spec, tokens = calibration_tokens(teacher.tokenizer, calib_data, model, seq_len, max_tokens)
    art, reused = calibrate(teacher, tokens, spec, out=out, batch_size=batch_size, device=device, stream=stream, max_memory=max_memory)
    return teacher, art, reused


def load_or_calibrate(teacher: Teacher | LazyTeacher, stats: str | None, calib_data: str | None, model: str | None, **kw) -> StatsArtifact:
    """--stats DIR alone loads it; with --calib-data it is (re)computed into DIR when it doesn't match."""
    if stats and not calib_data:
        art = load_stats(stats)
        if art.manifest["model"]["config_sha256"] != teacher.fingerprint()["config_sha256"]:
            raise M2DError(f"statistics in {stats} were computed for {art.manifest['model']['name']}, not this model; recalibrate")
        return art
    return run_calibrate(model, calib_data, stats, teacher=teacher, **kw)[1]


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
) -> dict:
    """Stages 0-2 for one recipe: statistics -> plan -> dense student -> verified export (-> ppl)."""
    if baseline:
        BASELINES.check(baseline)
    else:
        check_methods(scoring, grouping, scaling)
    teacher = open_teacher(model, device=device or device_default())  # weights read as the student needs them
    adapter, config = teacher.adapter, teacher.config
    k, E = adapter.top_k(config), adapter.num_experts(config)
    K = k if K is None else K
    check_K(K, k, E)
    result: dict = {"model": teacher.name, "k": k, "E": E}
    if baseline:
        export_student(BASELINES[baseline](teacher), teacher.tokenizer, out)
        result.update(baseline=baseline)
    else:
        art = load_or_calibrate(teacher, stats, calib_data, model, device=device, **(calib_kwargs or {}))
        plan = make_plan(teacher, art.layers, scoring, grouping, scaling, K)
        check = export_student(build_from_plan(teacher, plan), teacher.tokenizer, out, teacher=teacher, plan=plan, extra={"stats_sha256": art.checksum})
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
    import time

    from m2d_ray.config import load_config

    cli = [f"{k}={v}" for k, v in (("model", model), ("calib.data", calib_data), ("eval.data", eval_data)) if v]
    if resume:
        saved = Path(resume) / "config.yaml"
        if not saved.exists():
            raise M2DError(f"{resume} holds no sweep to resume (no config.yaml); start one with m2d sweep CONFIG --out {resume}")
        cfg = load_config(config or saved, [*overrides, *cli])
        if cfg.stage == 2:
            return _stage2_summary(resume, cfg, tracking_uri)
        if config or overrides or cli or out:
            raise M2DError("--resume RUN_DIR reuses the run's saved config; drop the config, overrides and --out/--model/--*-data (or add stage=2)")
        run_dir, cfg = resume, None
    else:
        if config is None:
            raise M2DError("give a config (e.g. experiments/tiny.yaml) or --resume RUN_DIR")
        cfg = load_config(config, [*overrides, *cli])
        if cfg.stage == 2:
            raise M2DError("stage=2 distils the promotions of a finished stage 1: add --resume RUN_DIR")
        run_dir = out or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    from m2d_ray.sweep.stage1 import run_stage1

    res = run_stage1(cfg, run_dir, resume=bool(resume), tracking_uri=tracking_uri)
    statuses = [r["status"] for r in res.records]
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


def _stage2_summary(run_dir: str, cfg, tracking_uri: str | None) -> dict:
    from m2d_ray.sweep.stage2 import run_stage2

    records = run_stage2(cfg, run_dir, tracking_uri=tracking_uri)
    return {
        "run_dir": str(Path(run_dir).resolve()),
        "stage": 2,
        "table": str(Path(run_dir).resolve() / "stage2.csv"),
        "students": {r["key"]: {"status": r["status"], "val_ppl_initial": r["val_ppl_initial"], "val_ppl": r["val_ppl"], "student": r["student_path"]} for r in records},
    }


def check_teacher_topk(model: str, k_prime: int | None) -> None:
    """On the driver, from the config alone: expanded teacher routing needs k <= k' <= E."""
    if k_prime is not None:
        from m2d_ray.arch import get_adapter
        from m2d_ray.models import load_config as model_config

        config = model_config(model)
        get_adapter(config).check_top_k(config, k_prime)


def distill_one(
    teacher: str | None,
    student: str,
    out: str | Path,
    eval_data: str,
    config: str | None = None,
    overrides: list[str] = (),
) -> dict:
    """`m2d distill`: one student (a directory, or a baseline name built from the teacher) on Ray Train.

    OUT/student is the exported student, OUT/train the Ray Train storage (checkpoints: running the same
    command again resumes), OUT/metrics.jsonl the validation curve, OUT/result.json the summary.
    """
    import dataclasses

    from m2d_ray.artifacts import write_json_atomic
    from m2d_ray.config import RayConfig, load_config
    from m2d_ray.convert.initial import materialize
    from m2d_ray.distill.data import absolute_spec, check_source
    from m2d_ray.distill.loop import DistillJob
    from m2d_ray.distill.trainer import MetricsLog, fit, follow
    from m2d_ray.sweep.ray_env import ensure_ray

    cfg = load_config(config, [f"distill.{o}" if not o.startswith("distill.") else o for o in overrides]).distill
    cfg = dataclasses.replace(cfg, train_data=absolute_spec(cfg.train_data))
    eval_data = absolute_spec(eval_data)
    check_source(cfg.train_data)
    out = Path(out).resolve()
    if (out / "result.json").exists():
        raise M2DError(f"{out} already holds a finished distillation ({out / 'result.json'}); choose another --out")
    teacher = str(Path(teacher).expanduser().resolve()) if teacher and Path(teacher).expanduser().exists() else (teacher or default_teacher())
    if student in BASELINES:
        student_dir = materialize(open_teacher(teacher), out / "init", baseline=student, seed=cfg.seed)
    else:
        student_dir = Path(student).expanduser().resolve()
        if not (student_dir / "config.json").exists():
            raise M2DError(f"student {student!r} is neither a model directory nor a baseline ({', '.join(BASELINES.names())})")
    check_teacher_topk(teacher, cfg.teacher_topk)
    device = "cuda" if cfg.gpus_per_worker > 0 else "cpu"
    job = DistillJob(teacher, str(student_dir), cfg, eval_data, out=str(out / "student"), device=device)
    out.mkdir(parents=True, exist_ok=True)
    ensure_ray(RayConfig())
    with follow(out / "metrics.jsonl", out.name):
        result = fit(job, name="train", storage=out, callbacks=[MetricsLog(out / "metrics.jsonl")])
    if result.error is not None:
        raise M2DError(f"distillation failed: {str(result.error).splitlines()[0][:300]}; fix it and run the same command to resume")
    m = result.metrics
    summary = {
        "student": m.get("student_path"), "steps": m["step"], "tokens": m["tokens"], "resumed_from": m["resumed_from"],
        "first_val_ppl": m["val_ppl_initial"], "last_val_ppl": m["val_ppl"], "tokens_per_s": m["tokens_per_s"],
        "loss": cfg.loss, "teacher_topk": cfg.teacher_topk, "deepspeed": cfg.deepspeed, "workers": cfg.workers,
        "metrics": str(out / "metrics.jsonl"),
    }
    write_json_atomic(out / "result.json", summary)
    return summary


def evaluate_one(model: str, tasks: str = "local", num_fewshot: int | None = None, limit: int | None = None,
                 batch_size: int = 16, device: str | None = None) -> dict:
    """`m2d eval`: lm-eval of one saved model (the stage-3 measurement)."""
    from m2d_ray.evaluate.harness import evaluate, parse_tasks, text_source
    from m2d_ray.models import load_model

    suite, text = parse_tasks(tasks, num_fewshot), text_source(tasks)  # bad task specs fail before the model loads
    device = device or device_default()
    lm, tok = load_model(model, device=device)
    return {"model": model, **evaluate(lm, tok, suite, batch_size=batch_size, device=device, limit=limit, text=text)}


STAGES = ("stage1", "stage2", "stage3", "report")


def run(config: str | None, overrides: list[str], out: str | None = None, resume: str | None = None,
        tracking_uri: str | None = None) -> dict:
    """`m2d run`: the whole pipeline into one run directory (RUN_DIR/run.json records each stage's wall time).

    A finished stage is skipped on --resume (stage 1 once promotions.json exists; stages 2 and 3 skip
    the students and models already in their ledgers); the report is always rewritten.
    """
    import time

    from m2d_ray.artifacts import write_json_atomic
    from m2d_ray.config import load_config
    from m2d_ray.sweep.stage1 import CONFIG_FILE, STATE_FILE, run_stage1
    from m2d_ray.sweep.stage2 import run_stage2
    from m2d_ray.sweep.stage3 import run_stage3
    from m2d_ray.track import run_tracking_uri

    if resume:
        run_dir = Path(resume).resolve()
        if config or out:
            raise M2DError("--resume RUN_DIR continues with the run's saved config; drop the config and --out (key=value overrides are allowed)")
        if not (run_dir / CONFIG_FILE).exists():
            raise M2DError(f"{run_dir} holds no run to resume (no {CONFIG_FILE}); start one with m2d run CONFIG --out {run_dir}")
        cfg = load_config(run_dir / CONFIG_FILE, overrides)
    else:
        if config is None:
            raise M2DError("give a config (e.g. experiments/tiny.yaml) or --resume RUN_DIR")
        cfg = load_config(config, overrides)
        run_dir = Path(out or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        if (run_dir / STATE_FILE).exists():
            raise M2DError(f"{run_dir} already holds a run; continue it with m2d run --resume {run_dir} or choose another --out")
    state_file = run_dir / "run.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"stages": {}}

    def stage(name: str, fn) -> None:
        t0 = time.time()
        print(f"== {name} ==", file=sys.stderr, flush=True)
        fn()
        state["stages"][name] = {"wall_s": round(time.time() - t0, 1), "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        write_json_atomic(state_file, state)

    if not (run_dir / "promotions.json").exists():
        stage("stage1", lambda: run_stage1(None if resume else cfg, run_dir, resume=(run_dir / STATE_FILE).exists(), tracking_uri=tracking_uri))
    stage("stage2", lambda: run_stage2(cfg, run_dir, tracking_uri=tracking_uri))
    stage("stage3", lambda: run_stage3(cfg, run_dir, tracking_uri=tracking_uri))
    stage("report", lambda: report(str(run_dir), tracking_uri))
    uri = run_tracking_uri(cfg, run_dir, tracking_uri)
    return {"run_dir": str(run_dir), "report": str(run_dir / "report" / "index.html"),
            "stages": {k: v["wall_s"] for k, v in state["stages"].items()},
            "mlflow_ui": f"mlflow ui --backend-store-uri {uri}"}


def report(run_dir: str, tracking_uri: str | None = None) -> dict:
    """`m2d report`: RUN_DIR/report/ (HTML + CSV/Markdown tables + PNG figures), also logged to the run's MLflow parent."""
    from m2d_ray.config import load_config
    from m2d_ray.report.run import write_report
    from m2d_ray.track import run_tracker, sweep_parent

    index = write_report(run_dir)
    rd = Path(run_dir).resolve()
    cfg = load_config(rd / "config.yaml")
    tracker = run_tracker(cfg, rd, tracking_uri)
    parent = sweep_parent(tracker, rd, cfg.name)
    tracker.client.log_artifacts(parent, str(index.parent), artifact_path="report")
    tracker.finish(parent)
    return {"report": str(index), "files": sorted(p.name for p in index.parent.iterdir() if not p.name.startswith("."))}
