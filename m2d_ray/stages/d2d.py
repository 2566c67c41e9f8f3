"""The dense-to-dense (Minitron) baseline of stage 2 (`stage2.baselines: [..., d2d]`).

    driver                      checks the dense teacher (config, family, files) before any work
    one Ray task (any node)     importance on the run's calibration data, the candidate search at the
                                K = k student's parameter count, scored by pre-distillation perplexity on
                                the run's evaluation data (prune/search.py); returns the candidate rows and
                                the promoted candidate as a `PrunedSpec` (sizes + importance: small)
    driver                      RUN_DIR/stage2/d2d/: search.json, importance.safetensors, candidates.csv/.md
                                (the paper's D2D table; resume reuses them instead of searching again)
    the stage-2 trial           rank 0 builds the promoted student from the spec into the run's storage,
                                and it is distilled from the dense teacher with the same budget as every
                                other student (distill.teacher_topk does not apply: a dense teacher has no routing)

Nothing crosses nodes through the driver's disk: the teachers and the calibration and evaluation text go
through the run's storage (`RunStorage`), the spec travels with the trial (object store). A search that
fails (on the worker: its data, its memory, a lost node) is that baseline's failure (`SearchFailed`), not
the run's: stage 2 records it and distils the other students.
"""

from __future__ import annotations

from dataclasses import replace

import ray

from m2d_ray.arch.dense import DenseSizes
from m2d_ray.artifacts import write_json_atomic, write_text_atomic
from m2d_ray.config import CalibConfig, EvalConfig, SweepConfig
from m2d_ray.console import say
from m2d_ray.prune.export import candidates_table
from m2d_ray.prune.importance import Importance
from m2d_ray.prune.prune import PrunedSpec
from m2d_ray.run_dir import RunDir
from m2d_ray.stages.run_storage import RunStorage


class SearchFailed(RuntimeError):
    """The d2d candidate search failed on its worker (the message says why, in one line)."""


def dense_teacher(cfg: SweepConfig) -> str:
    """The D2D baseline's teacher: `stage2.d2d_teacher`, else the embedded MoE teacher's dense twin."""
    from m2d_ray.models import absolute, default_dense_teacher

    return absolute(cfg.stage2.d2d_teacher or default_dense_teacher())


def check_dense_teacher(name: str) -> None:
    """From its config and files alone: a dense model the pruning supports."""
    from m2d_ray.arch.dense import get_dense_adapter
    from m2d_ray.checkpoint import check_files
    from m2d_ray.models import load_config

    get_dense_adapter(load_config(name))
    check_files(name, "teacher")


@ray.remote
def _search_task(dense: str, moe: str, calib: CalibConfig, ev: EvalConfig, device: str, threads: int) -> dict:
    """On any node: the candidate search of `dense` at the parameters of `moe`'s K = k student."""
    import torch

    from m2d_ray.models import load_model
    from m2d_ray.prune.data import data_specs, load_tokens
    from m2d_ray.prune.search import moe_student_params, search

    torch.set_num_threads(threads)
    target = moe_student_params(moe)
    calib_spec, eval_spec = data_specs(dense, calib.data, ev.data, scored=True)
    model, tokenizer = load_model(dense, device=device, what="teacher")
    spec, tokens, eval_ids = load_tokens(dense, tokenizer, calib_spec, eval_spec, calib.seq_len, calib.max_tokens, ev.max_chars)
    res = search(dense, tokens, target, eval_ids, model=model, seq_len=ev.seq_len, batch_size=ev.batch_size, device=device)
    return {"rows": res.rows, "spec": res.best, "target": target, "calib_data": spec, "calib_tokens": tokens.n_tokens, "eval_data": eval_spec}


def d2d_student(cfg: SweepConfig, rd: RunDir, store: RunStorage, moe: str, dense: str) -> PrunedSpec:
    """The promoted D2D candidate of this run (`moe`, `dense`: the teachers as workers reach them): searched
    once on Ray, its record kept in RUN_DIR/stage2/d2d/ and reused on resume; `SearchFailed` if the search fails."""
    saved = rd.read_d2d_search()
    if saved is not None:
        return PrunedSpec(dense, DenseSizes(**saved["sizes"]), Importance.load(rd.d2d_importance), saved["candidate"])
    say(f"stage 2: d2d: pruning {dense_teacher(cfg)} to the K = k student's parameter count (candidate search)")
    gpus = 1.0 if cfg.distill.gpus_per_worker > 0 else 0.0
    task = _search_task.options(num_cpus=cfg.distill.cpus_per_worker, num_gpus=gpus, max_retries=cfg.ray.max_failures)
    calib, ev = replace(cfg.calib, data=store.put_data(cfg.calib.data)), replace(cfg.eval, data=store.put_data(cfg.eval.data))
    try:
        out = ray.get(task.remote(dense, moe, calib, ev, "cuda" if gpus else "cpu", cfg.distill.threads_per_worker))
    except (ray.exceptions.RayTaskError, ray.exceptions.RayError) as exc:
        cause = getattr(exc, "cause", None) or exc
        raise SearchFailed(f"the d2d candidate search failed ({type(cause).__name__}: {str(cause).strip().splitlines()[0][:200]})") from None
    spec: PrunedSpec = out["spec"]
    for r in out["rows"]:
        say(f"stage 2: d2d candidate {r['candidate']} ({r['kind']}): {r['params']:,} parameters, pre-distillation ppl "
            + ("diverged" if r["diverged"] else f"{r['ppl']:.3f}") + (" <- promoted" if r["best"] else ""))
    rd.d2d.mkdir(parents=True, exist_ok=True)
    spec.importance.save(rd.d2d_importance)
    table_csv, table_md = candidates_table(out["rows"])
    write_text_atomic(rd.d2d_candidates_csv, table_csv)
    write_text_atomic(rd.d2d_candidates_md, table_md)
    record = {k: out[k] for k in ("rows", "target", "calib_data", "calib_tokens", "eval_data")}
    write_json_atomic(rd.d2d_search, {**record, "teacher": dense_teacher(cfg), "candidate": spec.name, "sizes": spec.sizes.to_json()})  # last
    return spec
