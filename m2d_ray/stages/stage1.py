"""Stage 1: every recipe of the grid (scoring x grouping x scaling x K) planned from the statistics, deduplicated by
plan, scored by pre-distillation perplexity on Ray Tune; the best (K, scaling) of every (scoring, grouping) pair
is promoted to stage 2.

    plans of the whole grid (one Ray task)  RUN_DIR/plans.json
    dedupe by plan signature                one Tune trial per distinct student (stage1_tune.py)
    probe round, then PairwiseStopper       chunked perplexity, hopeless configs stopped (scheduler.py)
    ledger + MLflow (driver callback)       RUN_DIR/trials/*.json, the run's parent + one nested run per config
    table, heatmap, promotions              RUN_DIR/stage1.{csv,md}, stage1_heatmap.png, promotions.json

A unit is one trial: a student built a layer at a time and its perplexity batch (`memory.trial`). A resumed run
reuses the plans, skips every config in the ledger and reconciles MLflow from the ledger; a stage 1 that promoted
nothing has failed (exit 1). With `stage2.recipes` there is no search: the named recipes are planned from the
statistics (one Ray task) and promoted as they are, in their order (`stage1_tune.named`); the stage has no trial.
"""

from __future__ import annotations

import html
from functools import partial
from pathlib import Path

from m2d_ray.accelerators import spot
from m2d_ray.catalog.units import TRIAL
from m2d_ray.config import parse_recipe
from m2d_ray.errors import M2DError, RunFailed
from m2d_ray.evaluate.split import decoder_sizes, largest, spread_over
from m2d_ray.plan import memory
from m2d_ray.plan.devices import bundle
from m2d_ray.plan.flops import distinct_students, eval_tokens, forward_flops, stage1_chunks
from m2d_ray.plan.run_plan import unit
from m2d_ray.report.page import Table, md_table_html, render
from m2d_ray.report.run import (
    erank_figure,
    erank_tables,
    figure,
    overlap_figure,
    overlap_table,
)
from m2d_ray.report.stage1 import heatmap, write_tables
from m2d_ray.run_dir import STAGE1_HEATMAP, STAGE1_MD
from m2d_ray.stages.contract import Section, Stage
from m2d_ray.stages.grid import expand

# Imported inside functions: Ray, torch (`m2d plan` and the checks read this module without importing them).


class Stage1(Stage):
    name = "stage1"
    keys = "ray.gpus_per_trial / ray.cpus_per_trial / ray.trial_accelerator / ray.spot_trials"

    def check(self, cfg, teacher: str) -> None:

        from m2d_ray.data.text import check_spec
        from m2d_ray.models import check_teacher, model_config

        adapter, config = check_teacher(teacher), model_config(teacher)
        k, E = adapter.top_k(config), adapter.num_experts(config)
        if cfg.stage2.recipes:  # named students: their K, not the grid's
            bad = [r for r in map(parse_recipe, cfg.stage2.recipes) if not k <= r.K <= E]
            if bad:
                raise M2DError(
                    f"stage2.recipes: {', '.join(map(str, bad))} outside K in [k, E] = [{k}, {E}] for this model; "
                    "use K in that range"
                )
            return
        expand(cfg.grid, k, E)  # K within [k, E]
        check_spec(cfg.eval.data, "eval.data")

    def request(self, cfg) -> dict:
        r = cfg.ray
        return {**bundle(r.cpus_per_trial, r.trial_gpus, r.trial_accelerator), **spot(r.spot_trials)}

    def reads(self, cfg) -> dict[str, str]:
        return {} if cfg.stage2.recipes else {"eval.data": cfg.eval.data}

    def needs(self, p):
        """One trial; none with named recipes (their plans are one Ray task over the statistics)."""
        r, e, s = p.cfg.ray, p.cfg.eval, p.models.student
        if p.cfg.stage2.recipes:
            return []
        parts, n = memory.trial(s, e.batch_size, e.seq_len, s.dtype_bytes), spread_over(r.trial_gpus)
        if n > 1:  # whole GPUs: the student's layers spread over them in order (evaluate/split.py), a GPU's the largest
            sizes = decoder_sizes(s.params, s.layers, s.layer_params, s.vocab, s.hidden, s.tied, s.dtype_bytes)
            parts = {**parts, "student": largest(sizes, n)}
        return [
            unit(
                self.name,
                "trial" if n == 1 else f"trial, spread over {n}",
                parts,
                r.trial_gpus,
                r.max_concurrent_trials,
                self.request(p.cfg),
                p.devices,
                "a larger ray.gpus_per_trial, a smaller eval.batch_size or a larger GPU",
                self.keys,
            )
        ]

    def cost(self, c):
        """Each distinct student's probe chunk, then the survivors' remaining chunks, over the perplexity tokens."""
        cfg, r = c.p.cfg, c.p.cfg.ray
        if cfg.stage2.recipes:
            return []
        _, distinct = distinct_students(cfg, c.p.models.teacher)
        trials, chunks = stage1_chunks(cfg, distinct)
        per_trial = (
            chunks / trials * eval_tokens(cfg) / cfg.eval.chunks * forward_flops(c.p.models.student, cfg.eval.seq_len)
        )
        where = c.place(self.name, r.trial_gpus, r.threads_per_worker, r.max_concurrent_trials, r.trial_accelerator)
        return [
            c.stage(self.name, [per_trial] * trials, where, TRIAL, rounds=2 if trials > distinct else 1)
        ]  # the probe round is a Tune experiment of its own

    def finished(self, ctx) -> bool:
        if not ctx.rd.promotions.exists():
            return False
        if not ctx.rd.read_promotions()["pairs"]:
            raise _nothing_promoted(ctx.rd)
        return True

    def run(self, ctx):
        from m2d_ray.stages.stage1_tune import named, sweep

        result = (named if ctx.cfg.stage2.recipes else sweep)(ctx, self)
        if not result.promotions:
            raise _nothing_promoted(ctx.rd)
        return result

    def sections(self, data) -> list[Section]:
        if data.cfg.stage2.recipes:
            return [Section("Students named directly (stage2.recipes: no stage-1 search)", render([_named(data)]))]
        g = data.cfg.grid
        order = {"scoring": list(g.scoring), "grouping": list(g.grouping), "scaling": list(g.scaling)}

        def grid(out: Path) -> str:  # the stage-1 table's own files (as in the run directory), shown as HTML
            write_tables(data.stage1, order, out)
            criterion = html.escape(data.promotions["criterion"])
            return f"<p class='meta'>{criterion}</p>{md_table_html((out / STAGE1_MD).read_text(), 'stage1')}"

        def grid_figure(path: Path) -> Path:
            return heatmap(data.stage1, order, path, title=f"stage 1: pre-distillation perplexity, k={data.k}")

        overlap = overlap_table(data)
        return [
            Section(
                "Stage 1: pre-distillation perplexity",
                render([grid, figure(STAGE1_HEATMAP, "perplexity grid", grid_figure)]),
            ),
            Section(
                f"Selection overlap between scorings at K = k = {data.k}",
                render([overlap, figure("overlap.png", "overlap matrix", partial(overlap_figure, overlap))]),
            ),
            Section(
                "Effective rank of the selected experts",
                render(
                    [erank_tables(data), figure("erank.png", "effective rank per scoring", partial(erank_figure, data))]
                ),
            ),
        ]


def _named(data) -> Table:
    pairs = data.promotions["pairs"]
    rows = [[pair, pairs[pair]["K"], pairs[pair]["scaling"], pairs[pair]["key"]] for pair in data.promotions["order"]]
    return Table(
        "recipes",
        ["scoring/grouping", "K", "scaling", "key"],
        rows,
        "Planned from the calibration statistics and distilled in this order; no pre-distillation perplexity.",
    )


def _nothing_promoted(rd) -> RunFailed:
    """Stage 1 that promoted nothing (every config failed or diverged) has failed: exit 1, the table says why."""
    return RunFailed(f"stage 1 promoted no student: every config failed or diverged (see {rd.stage1_md} and {rd.logs})")


STAGE = Stage1()
