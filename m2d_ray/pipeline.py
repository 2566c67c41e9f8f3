"""The stage order, top to bottom. Each function is one CLI command.

    load teacher -> tokenise calibration text -> calibrate (stats artifact)
      -> plan (score, select, group, scale) -> build dense student -> export + verify -> perplexity
    sweep (stage 1): calibrate on Ray Data -> plan the whole grid -> Ray Tune over distinct students
      -> stage1 table + promotions.json (the input of stage 2)
"""

from __future__ import annotations

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
from m2d_ray.models import Teacher, default_teacher, load_teacher

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
    teacher: Teacher | None = None,
) -> tuple[Teacher, StatsArtifact, bool]:
    """Stage 0: the statistics artifact (reused when `out` already matches)."""
    teacher = teacher or load_teacher(model, device=device or device_default())
    spec, tokens = calibration_tokens(teacher.tokenizer, calib_data, model, seq_len, max_tokens)
    art, reused = calibrate(teacher, tokens, spec, out=out, batch_size=batch_size)
    return teacher, art, reused


def load_or_calibrate(teacher: Teacher, stats: str | None, calib_data: str | None, model: str | None, **kw) -> StatsArtifact:
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
    teacher = load_teacher(model, device=device or device_default())
    adapter, config = teacher.adapter, teacher.config
    k, E = adapter.top_k(config), adapter.num_experts(config)
    K = k if K is None else K
    check_K(K, k, E)
    result: dict = {"model": teacher.name, "k": k, "E": E}
    if baseline:
        student = BASELINES[baseline](teacher)
        export_student(student, teacher.tokenizer, out)
        result.update(baseline=baseline)
    else:
        art = load_or_calibrate(teacher, stats, calib_data, model, device=device, **(calib_kwargs or {}))
        plan = make_plan(teacher, art.layers, scoring, grouping, scaling, K)
        student = build_from_plan(teacher, plan)
        check = export_student(student, teacher.tokenizer, out, teacher=teacher, plan=plan, extra={"stats_sha256": art.checksum})
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
    result.update(dense_class=type(student).__name__, out=str(out))
    if eval_data:
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
    """Stage 1: run (or resume) the grid of a YAML config; returns a summary (promotions included)."""
    import time

    from m2d_ray.config import load_config

    if resume:
        if config or overrides or model or calib_data or eval_data or out:
            raise M2DError("--resume RUN_DIR reuses the run's saved config; drop the config, overrides and --out/--model/--*-data")
        run_dir, cfg = resume, None
    else:
        if config is None:
            raise M2DError("give a config (e.g. experiments/tiny.yaml) or --resume RUN_DIR")
        cli = [f"{k}={v}" for k, v in (("model", model), ("calib.data", calib_data), ("eval.data", eval_data)) if v]
        cfg = load_config(config, [*overrides, *cli])
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
