"""`m2d convert`: statistics -> plan (score, select, group, scale) -> dense student -> verified export (-> ppl)."""

from __future__ import annotations

import json
from pathlib import Path

from m2d_ray.arch import mtp_left_out
from m2d_ray.artifacts import check_output
from m2d_ray.calibrate.artifact import load_stats
from m2d_ray.catalog.methods import RANDOM_BASELINES
from m2d_ray.commands.calibrate import calib_options, run_calibrate
from m2d_ray.config import EvalConfig
from m2d_ray.console import emit, say
from m2d_ray.convert.build import build_from_plan
from m2d_ray.convert.export import export_student
from m2d_ray.convert.plan import check_K, check_method_names, make_plan
from m2d_ray.data.text import check_spec, load_text, tokenize
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.perplexity import EVAL_MAX_CHARS, Perplexity, perplexity
from m2d_ray.models import (
    check_teacher,
    default_teacher,
    device_default,
    load_model,
    model_config,
    model_fingerprint,
)
from m2d_ray.weights import open_teacher


def evaluate_ppl(
    model,
    tokenizer,
    eval_data: str,
    seq_len: int = EvalConfig.seq_len,
    max_chars: int | None = EVAL_MAX_CHARS,
    batch_size: int = EvalConfig.batch_size,
) -> Perplexity:
    ids = tokenize(tokenizer, load_text(eval_data, max_chars=max_chars), max_chars=max_chars)
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
        RANDOM_BASELINES.check(baseline)
    else:
        check_method_names(scoring, grouping, scaling)
    check_output(out, "student", overwrite)
    name = model or default_teacher()
    adapter, config = check_teacher(name), model_config(name)
    if adapter.approximation:  # the family's block is not the method's FFN: said once, before any work
        say(f"{config.model_type}: the student approximates its MoE blocks: {adapter.approximation}")
    if mtp := mtp_left_out(config):
        say(mtp)
    k, E = adapter.top_k(config), adapter.num_experts(config)
    K = k if K is None else K
    check_K(K, k, E)
    art = None
    if not baseline and stats and not calib_data:
        art = load_stats(stats)
        if art.manifest["model"]["config_sha256"] != model_fingerprint(name, config)["config_sha256"]:
            raise M2DError(
                f"statistics in {stats} were computed for {art.manifest['model']['name']}, not this model; recalibrate"
            )
    if eval_data:
        check_spec(eval_data, "evaluation data")
    teacher = None
    if not baseline and art is None:
        teacher, art, _ = run_calibrate(
            model, calib_data, stats, device=device, overwrite=overwrite, what="--stats", **(calib_kwargs or {})
        )
    teacher = teacher or open_teacher(name, device=device or device_default())  # weights read as the student needs them
    result: dict = {"model": teacher.name, "k": k, "E": E}
    if baseline:
        export_student(RANDOM_BASELINES[baseline](teacher), teacher.tokenizer, out, overwrite=overwrite)
        result.update(baseline=baseline)
    else:
        plan = make_plan(teacher, art.layers, scoring, grouping, scaling, K)
        check = export_student(
            build_from_plan(teacher, plan),
            teacher.tokenizer,
            out,
            teacher=teacher,
            plan=plan,
            extra={"stats_sha256": art.checksum},
            overwrite=overwrite,
        )  # one student in memory at a time
        result.update(
            scoring=scoring,
            grouping=grouping,
            scaling=scaling,
            K=K,
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
        student, _ = load_model(str(out), device=device or device_default())  # the exported student, as users load it
        result["perplexity"] = evaluate_ppl(student, teacher.tokenizer, eval_data).to_json()
    return result


def main(args) -> None:
    result = convert_one(
        args.model,
        args.scoring,
        args.grouping,
        args.scaling,
        args.K,
        args.out,
        stats=args.stats,
        calib_data=args.calib_data,
        eval_data=args.eval_data,
        baseline=args.baseline,
        device=args.device,
        calib_kwargs=calib_options(args),
        overwrite=args.overwrite,
    )
    for layer, sel in result.get("selected", {}).items():
        say(f"layer {layer}: experts {sel} groups {result['groups'][layer]}")
    emit(json.dumps(result))
