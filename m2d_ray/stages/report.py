"""The report: RUN_DIR/report/ (index.html, every table as CSV and Markdown, every figure as PNG) made of what each
stage of the run adds (`Stage.sections`, in the pipeline's order), logged to the run's MLflow parent as an
artifact; the report's own sections set the plan beside what the run measured (memory and time). It is always
written again, so a resumed or reported run shows what its directory holds now.
"""

from __future__ import annotations

import html
from pathlib import Path

from m2d_ray.config import load_config
from m2d_ray.report.analysis import RunData, load_run, outcome, outcome_line
from m2d_ray.report.page import render, write_page
from m2d_ray.report.run import cost_table, memory_table
from m2d_ray.run_dir import RunDir
from m2d_ray.stages import baselines
from m2d_ray.stages.baselines import BASELINES
from m2d_ray.stages.contract import Section, Stage
from m2d_ray.track import NOTE_TAG, run_description


class Report(Stage):
    name = "report"

    def run(self, ctx) -> dict:

        index = write(ctx.rd, ctx.stages)
        parent, tracker = ctx.parent(), ctx.tracker
        description = run_description(
            ctx.cfg.name, ctx.rd, ctx.rd.read_promotions()["teacher"], len(ctx.rd.stage1_ledger().records())
        )
        tracker.log(parent, tags={NOTE_TAG: description})  # a run of an older m2d gets it too
        tracker.client.log_artifacts(parent, str(index.parent), artifact_path="report")
        tracker.finish(parent)
        return {
            "report": str(index),
            "mlflow_url": tracker.ui_url(),
            "files": sorted(p.name for p in index.parent.iterdir() if not p.name.startswith(".")),
        }

    def sections(self, data: RunData) -> list[Section]:
        tables = [
            ("Memory: planned against measured", memory_table(data)),
            ("Time and money: estimated against measured", cost_table(data)),
        ]
        return [Section(title, render([t])) for title, t in tables if t.rows]  # with a plan (m2d run) only


def run_data(rd: RunDir) -> RunData:
    """The run's records, with what its baselines bring (their own teachers' rows, the matched table's order)."""

    rd.read_promotions()  # a run with no finished stage 1 has nothing to report: its error says so
    cfg = load_config(rd.config)
    teachers = tuple((b.teacher_label, b.teacher_key) for b in baselines.of(cfg) if b.has_teacher)
    return load_run(rd.path, teachers, tuple(n for n in BASELINES if n in cfg.stage2.baselines))


def write(rd: RunDir, stages) -> Path:
    """RUN_DIR/report/ from the sections of `stages` (replacing the previous report as a whole); its index.html."""
    data = run_data(rd)
    p, cfg = data.promotions, data.cfg
    timing = " · ".join(f"{k} {v['wall_s']:.0f} s" for k, v in data.timings.items() if "wall_s" in v)
    meta = (
        f"teacher <code>{html.escape(str(p['teacher']))}</code> · k = {p['k']}, E = {p['E']} · config "
        f"<code>{html.escape(cfg.name)}</code> · "
        f"{len(data.stage1)} stage-1 configs · {html.escape(outcome_line(outcome(data)))}"
        + (f" · {timing}" if timing else "")
    )
    return write_page(rd.report, cfg.name, meta, [s for stage in stages for s in stage.sections(data)])


STAGE = Report()
