"""`m2d prune-dense`: the dense-to-dense (Minitron) baseline, one command.

    importance (one calibration pass) -> either the candidate search at a parameter budget
    (--target-params N, or --match MOE_TEACHER: the parameters of its K = k dense student)
    or one pruned shape (--hidden/--ffn/--heads/--layers; sizes not given stay the teacher's)
    -> export, reloaded and checked before OUT appears.

Every input is checked before the teacher's weights are read: the output path, the teacher's config,
family and files, the budget or sizes (from the config alone), the data specs and texts.
"""

from __future__ import annotations

import json
from pathlib import Path

from m2d_ray.arch.dense import DenseSizes, get_dense_adapter
from m2d_ray.artifacts import check_output
from m2d_ray.checkpoint import check_files
from m2d_ray.commands.calibrate import calib_options
from m2d_ray.config import CalibConfig
from m2d_ray.console import emit
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.perplexity import EVAL_MAX_CHARS
from m2d_ray.models import (
    default_dense_teacher,
    device_default,
    load_model,
    load_tokenizer,
    model_config,
)
from m2d_ray.prune import importance as imp_mod
from m2d_ray.prune.data import data_specs, load_tokens
from m2d_ray.prune.export import export_pruned
from m2d_ray.prune.prune import check_sizes, prune
from m2d_ray.prune.search import (
    candidates,
    count_params,
    moe_student_params,
    score,
    search,
)


def prune_dense(
    model: str | None,
    out: str | Path,
    target_params: int | None = None,
    match: str | None = None,
    sizes: dict | None = None,
    calib_data: str | None = None,
    eval_data: str | None = None,
    max_tokens: int = CalibConfig.max_tokens,
    seq_len: int = CalibConfig.seq_len,
    batch_size: int = CalibConfig.batch_size,
    device: str | None = None,
    overwrite: bool = False,
) -> dict:

    given = {k: v for k, v in (sizes or {}).items() if v is not None}
    if (target_params is not None) + (match is not None) + bool(given) != 1:
        raise M2DError(
            "give exactly one of --target-params N, --match MOE_TEACHER (a search at that budget) "
            "or sizes (--hidden/--ffn/--heads/--layers: one pruned shape)"
        )
    check_output(out, "pruned", overwrite)
    name = model or default_dense_teacher()
    config = model_config(name)
    adapter = get_dense_adapter(config)
    check_files(name, "teacher")
    if match is not None:
        target_params = moe_student_params(match)
    searching = target_params is not None
    if searching:
        shapes = candidates(config, target_params)
    else:
        one = DenseSizes(**{**adapter.sizes(config).to_json(), **given})
        check_sizes(config, one)
    calib_spec, eval_spec = data_specs(
        name, calib_data, eval_data, scored=searching
    )  # one shape is scored only when asked
    tokenizer = load_tokenizer(name)
    spec, calib, eval_ids = load_tokens(name, tokenizer, calib_spec, eval_spec, seq_len, max_tokens, EVAL_MAX_CHARS)
    teacher, _ = load_model(name, device=device or device_default(), what="teacher")
    rows = None
    if searching:
        res = search(
            name, calib, target_params, eval_ids, model=teacher, shapes=shapes, batch_size=batch_size, progress=True
        )
        student, imp, rows, chosen = res.model, res.importance, res.rows, res.best.sizes
        ppl = next(r for r in rows if r["best"])
        ppl = {"ppl": ppl["ppl"], "diverged": ppl["diverged"]}
    else:
        imp = imp_mod.collect_importance(teacher, adapter, calib, batch_size=batch_size, progress=True)
        student, chosen = prune(teacher, one, imp), one
        ppl = score(student, eval_ids, 256, batch_size) if eval_ids is not None else None
    params = sum(p.numel() for p in student.parameters())
    result = {
        "model": name,
        "out": str(out),
        "dense_class": type(student).__name__,
        "sizes": chosen.to_json(),
        "kv_heads": chosen.heads // adapter.group_size(config),
        "params": params,
        "teacher_params": count_params(config),
        "target_params": target_params,
        "match": match,
        "candidates": len(rows) if rows else None,
        "calib_data": spec,
        "calib_tokens": calib.n_tokens,
        "eval_data": eval_spec,
        "perplexity": ppl,
    }
    info = {
        **result,
        "importance": imp_mod.CHOICES,
        "params_counted": "sum of model.parameters(): tied embeddings once",
    }
    export_pruned(student, tokenizer, out, chosen, imp, info, rows=rows, overwrite=overwrite)
    return result


def main(args) -> None:

    emit(
        json.dumps(
            prune_dense(
                args.model,
                args.out,
                target_params=args.target_params,
                match=args.match,
                sizes={k: getattr(args, k) for k in ("hidden", "ffn", "heads", "layers")},
                calib_data=args.calib_data,
                eval_data=args.eval_data,
                device=args.device,
                overwrite=args.overwrite,
                **calib_options(args),
            )
        )
    )
