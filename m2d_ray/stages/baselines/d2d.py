"""The dense-to-dense (Minitron) baseline (`stage2.baselines: [..., d2d]`): everything it brings, in one place.

    its teacher         stage2.d2d_teacher, else the embedded MoE teacher's dense twin; checked on the driver
                        before any work (config, family, files); evaluated by stage 3 as `teacher-d2d`, and with
                        cached targets given its own targets pass (a dense teacher has no routing: no k')
    prepare (Ray task)  importance on the run's calibration data, the candidate search at the K = k student's
                        parameter count, scored by pre-distillation perplexity on the run's evaluation data
                        (prune/search.py); the candidate rows and the promoted `PrunedSpec` (sizes + importance:
                        small) come back to the driver, into RUN_DIR/stage2/d2d/ (search.json, importance,
                        candidates.csv/.md: the paper's D2D table), which a resume reuses
    its student         rank 0 builds the promoted candidate from the spec into the run's storage; it is distilled
                        from the dense teacher with the same budget as every other student
    its bill            the search (stage 2's row): the dense teacher over the calibration tokens, each candidate
                        over the perplexity tokens
    its report section  the candidate table

Nothing crosses nodes through the driver's disk: the teachers and the calibration and evaluation text go
through the run's storage (`RunStorage`), the spec travels with the trial (object store). A search that fails
(on the worker: its data, its memory, a lost node) is this baseline's failure (`BaselineFailed`), not the run's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from m2d_ray.artifacts import write_json_atomic, write_text_atomic
from m2d_ray.assets import absolute, default_dense_teacher
from m2d_ray.catalog.methods import PRUNING_MIXES
from m2d_ray.catalog.units import MODEL
from m2d_ray.config import CalibConfig, EvalConfig, SweepConfig
from m2d_ray.console import say
from m2d_ray.errors import M2DError
from m2d_ray.plan.flops import eval_tokens, forward_flops
from m2d_ray.report.page import Table, render
from m2d_ray.run_dir import RunDir
from m2d_ray.stages.baselines.base import Baseline, BaselineFailed
from m2d_ray.stages.contract import Section

if TYPE_CHECKING:
    from m2d_ray.prune.prune import PrunedSpec


# Imported inside functions: Ray, torch and the pruning modules (`m2d plan` and the checks read this module without
# them).

NAME = "d2d"
SEARCH, CANDIDATES = (
    "search.json",
    "candidates",
)  # in RUN_DIR/stage2/d2d/: the search's record (written last), its table


class D2D(Baseline):
    """Dense-to-dense (Minitron): a dense teacher of the MoE's total size pruned to the student's parameter count (the
    best of a candidate search), distilled from that dense teacher under the same budget."""

    teacher_label = "dense teacher"

    def __init__(self) -> None:
        super().__init__(NAME)

    def teacher(self, cfg: SweepConfig) -> str:
        """`stage2.d2d_teacher`, else the embedded MoE teacher's dense twin."""

        return absolute(cfg.stage2.d2d_teacher or default_dense_teacher())

    def check_config(self, cfg: SweepConfig) -> None:
        """A dense teacher given only with d2d, and given for any MoE teacher but the embedded one."""
        used, teacher = NAME in cfg.stage2.baselines, cfg.stage2.d2d_teacher
        if teacher is not None and not used:
            raise M2DError(
                f"stage2.d2d_teacher is set but {NAME} is not in stage2.baselines; add {NAME} to the baselines or drop "
                "d2d_teacher"
            )
        if used and teacher is None and cfg.model is not None:
            raise M2DError(
                f"stage2.baselines has {NAME} but no stage2.d2d_teacher: give the dense model matched to {cfg.model} "
                "in total parameters (the embedded dense twin matches only the embedded teacher, model: null)"
            )

    def check(self, cfg: SweepConfig) -> None:
        """From its config and files alone: a dense model the pruning supports."""
        from m2d_ray.arch.dense import get_dense_adapter
        from m2d_ray.checkpoint import check_files
        from m2d_ray.models import model_config

        name = self.teacher(cfg)
        get_dense_adapter(model_config(name))
        check_files(name, "teacher")

    def reads(self, cfg: SweepConfig) -> dict[str, str]:

        from m2d_ray.calibrate.tokens import resolve_calib

        return {"calib.data": resolve_calib(cfg.calib.data, cfg.model), "eval.data": cfg.eval.data}

    def prepare(self, ctx, waiting, moe: str, teacher: str | None) -> PrunedSpec:
        """The promoted candidate of this run (`moe`, `teacher`: the teachers as workers reach them): searched once
        by a Ray task (under stage 2's resource waiter), its record kept in RUN_DIR/stage2/d2d/ and reused on resume."""
        import ray

        from m2d_ray.arch.dense import DenseSizes
        from m2d_ray.prune.export import IMPORTANCE_FILE, candidates_table
        from m2d_ray.prune.importance import Importance
        from m2d_ray.prune.prune import PrunedSpec

        cfg, where = ctx.cfg, ctx.rd.baseline(NAME)
        if (where / SEARCH).exists():
            saved = _read(ctx.rd)
            return PrunedSpec(
                teacher, DenseSizes(**saved["sizes"]), Importance.load(where / IMPORTANCE_FILE), saved["candidate"]
            )
        say(f"stage 2: d2d: pruning {self.teacher(cfg)} to the K = k student's parameter count (candidate search)")
        gpus = 1.0 if cfg.distill.gpus_per_worker > 0 else 0.0
        task = ray.remote(_search_task).options(
            num_cpus=cfg.distill.cpus_per_worker, num_gpus=gpus, max_retries=cfg.ray.max_failures
        )
        calib, ev = (
            replace(cfg.calib, data=ctx.store.put_data(cfg.calib.data)),
            replace(cfg.eval, data=ctx.store.put_data(cfg.eval.data)),
        )
        try:
            out = waiting.get(
                task.remote(teacher, moe, calib, ev, "cuda" if gpus else "cpu", cfg.distill.threads_per_worker)
            )
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            raise BaselineFailed(
                f"the d2d candidate search failed ({type(cause).__name__}: {str(cause).strip().splitlines()[0][:200]})"
            ) from None
        spec: PrunedSpec = out["spec"]
        for r in out["rows"]:
            say(
                f"stage 2: d2d candidate {r['candidate']} ({r['kind']}): {r['params']:,} parameters, pre-distillation "
                "ppl " + ("diverged" if r["diverged"] else f"{r['ppl']:.3f}") + (" <- promoted" if r["best"] else "")
            )
        where.mkdir(parents=True, exist_ok=True)
        spec.importance.save(where / IMPORTANCE_FILE)
        table_csv, table_md = candidates_table(out["rows"])
        write_text_atomic(where / f"{CANDIDATES}.csv", table_csv)
        write_text_atomic(where / f"{CANDIDATES}.md", table_md)
        record = {k: out[k] for k in ("rows", "target", "calib_data", "calib_tokens", "eval_data")}
        write_json_atomic(
            where / SEARCH,
            {**record, "teacher": self.teacher(cfg), "candidate": spec.name, "sizes": spec.sizes.to_json()},
        )  # last
        return spec

    def builder(self, moe: str, prepared: PrunedSpec, seed: int) -> Callable[[Path], None]:
        return prepared  # the spec writes the pruned student where rank 0 needs it

    def distill_config(self, x):
        return replace(x, teacher_topk=None)  # a dense teacher has no routing to expand

    def prepare_cost(self, c):
        """The search: its dense teacher over the calibration tokens, each candidate shape (the student's size) over
        the perplexity tokens; one task on a stage-2 worker's device, whose node stays for the students (no idle
        tail)."""
        p = c.p
        cfg, x, t = p.cfg, p.cfg.distill, p.teachers.get(self.teacher_key, p.models.teacher)
        flops = cfg.calib.max_tokens * forward_flops(t, cfg.calib.seq_len) + len(PRUNING_MIXES) * eval_tokens(
            cfg
        ) * forward_flops(p.models.student, cfg.eval.seq_len)
        gpus = 1.0 if x.gpus_per_worker > 0 else 0.0
        return c.stage(
            "d2d",
            [flops],
            c.place("stage2", gpus, x.threads_per_worker, 1, x.accelerator),
            MODEL,
            idle=False,
        )

    def sections(self, data) -> list[Section]:
        d = _read(RunDir(data.run_dir))
        if not d or not d.get("rows"):
            return []
        return [Section("Dense-to-dense (Minitron) candidate search", render([candidates(d)]))]


def _search_task(dense: str, moe: str, calib: CalibConfig, ev: EvalConfig, device: str, threads: int) -> dict:
    """On any node (a Ray task): the candidate search of `dense` at the parameters of `moe`'s K = k student."""
    import torch

    from m2d_ray.models import load_model
    from m2d_ray.prune.data import data_specs, load_tokens
    from m2d_ray.prune.search import moe_student_params, search

    torch.set_num_threads(threads)
    target = moe_student_params(moe)
    calib_spec, eval_spec = data_specs(dense, calib.data, ev.data, scored=True)
    model, tokenizer = load_model(dense, device=device, what="teacher")
    spec, tokens, eval_ids = load_tokens(
        dense, tokenizer, calib_spec, eval_spec, calib.seq_len, calib.max_tokens, ev.max_chars
    )
    res = search(
        dense, tokens, target, eval_ids, model=model, seq_len=ev.seq_len, batch_size=ev.batch_size, device=device
    )
    return {
        "rows": res.rows,
        "spec": res.best,
        "target": target,
        "calib_data": spec,
        "calib_tokens": tokens.n_tokens,
        "eval_data": eval_spec,
    }


def _read(rd: RunDir) -> dict | None:
    """The search's record (for the report and resume), or None before the search."""

    path = rd.baseline(NAME) / SEARCH
    return json.loads(path.read_text()) if path.exists() else None


def candidates(d: dict) -> Table:
    """The D2D candidate search in the paper's layout: one row per pruned shape at the budget, the promoted one
    marked."""
    body = [
        [
            r["candidate"],
            r["kind"],
            r["hidden"],
            r["ffn"],
            f"{r['heads']} ({r['kv_heads']})",
            r["layers"],
            r["params"],
            f"{r['params_vs_target']:+.2%}",
            r["ppl"],
            "yes" if r["best"] else "",
        ]
        for r in d["rows"]
    ]
    note = (
        f"Minitron pruning of {d.get('teacher')} to {d.get('target', 0):,} parameters (the MoE teacher's K = k "
        "student); "
        f"importance on {d.get('calib_tokens', 0):,} tokens of {d.get('calib_data')}, perplexity before distillation "
        "on "
        f"{d.get('eval_data')}; the lowest is promoted and distilled."
    )
    return Table(
        "d2d_candidates",
        [
            "candidate",
            "kind",
            "d",
            "FFN",
            "heads (KV)",
            "layers",
            "params",
            "vs budget",
            "ppl before distillation",
            "promoted",
        ],
        body,
        note,
    )
