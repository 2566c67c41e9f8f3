"""`m2d sweep`: calibration and stage 1 (a new grid, or --resume), or, with stage=2 and --resume RUN_DIR, the
targets pass and stage 2 on the run's promotions."""

from __future__ import annotations

import json

from m2d_ray import pipeline
from m2d_ray.catalog.distill import AUTO
from m2d_ray.commands.plan import check_run, kept_choices, record_plan
from m2d_ray.commands.runs import existing_run, keep_logs, new_run
from m2d_ray.config import SweepConfig, load_config
from m2d_ray.console import emit
from m2d_ray.errors import M2DError
from m2d_ray.runtime.context import RunContext


def sweep(
    config: str | None,
    overrides: list[str],
    out: str | None = None,
    resume: str | None = None,
    tracking_uri: str | None = None,
    loaded: SweepConfig | None = None,
) -> dict:
    """Stage 1 of `config` (`loaded`: that config as the CLI read it with `overrides`), or stage 2 of a resumed run."""
    if resume:
        rd = existing_run(resume)
        cfg = loaded or load_config(rd.config, overrides)
        if cfg.stage == 1 and (config or overrides or out):
            raise M2DError(
                "--resume RUN_DIR reuses the run's saved config; drop the config, overrides and --out/--model/--*-data "
                "(or add stage=2)"
            )
        stages = _stages(cfg.stage)
        pipeline.check_resume(rd, cfg, stages, tracking_uri)
        chosen = {}
        if cfg.stage == 2 and AUTO in (cfg.stage2.targets, cfg.distill.checkpointing, cfg.distill.zero_stage):
            # the plan decides, once
            plan = check_run(cfg, choices=kept_choices(rd, cfg))
            record_plan(rd, plan)
            chosen = plan.targets
            if plan.decided:
                cfg = load_config(config or rd.config, [*overrides, *plan.overrides()])
        ctx = RunContext(cfg, rd, tracking_uri, tuple(stages), chosen)
    else:
        if config is None:
            raise M2DError("give a config (e.g. tiny, or a YAML file) or --resume RUN_DIR")
        cfg = loaded or load_config(config, overrides)
        if cfg.stage == 2:
            raise M2DError("stage=2 distils the promotions of a finished stage 1: add --resume RUN_DIR")
        stages = _stages(1)
        rd = new_run(out, cfg)
        pipeline.check(cfg, stages, tracking_uri)
        ctx = RunContext.create(cfg, rd, tracking_uri, tuple(stages))
    keep_logs(rd.path)
    pipeline.record_corpora(rd, cfg, stages)
    results = pipeline.run(ctx)
    return _stage2(rd, results["stage2"]) if cfg.stage == 2 else _stage1(rd, results.get("stage1"))


def _stages(stage: int) -> pipeline.Stages:
    return pipeline.STAGES.only("calibrate", "stage1") if stage == 1 else pipeline.STAGES.only("targets", "stage2")


def _stage1(rd, res) -> dict:
    if res is None:  # a finished stage 1, resumed: nothing was run
        res_records = rd.stage1_ledger().records()
        return {
            "run_dir": str(rd),
            "configs": len(res_records),
            "status": _statuses(res_records),
            "promotions": _promoted(rd.read_promotions()["pairs"]),
        }
    return {
        "run_dir": str(res.run_dir),
        "configs": len(res.records),
        "status": _statuses(res.records),
        "probed": res.probed,
        "trials_run": res.evaluated,
        "full_evaluations": res.full_evaluations,
        "chunks_evaluated": res.chunks_evaluated,
        "promotions": _promoted(res.promotions),
        "wall_s": round(res.wall_s, 1),
    }


def _statuses(records: list[dict]) -> dict:
    statuses = [r["status"] for r in records]
    return {s: statuses.count(s) for s in sorted(set(statuses))}


def _promoted(promotions: dict) -> dict:
    return {p: {"K": v["K"], "scaling": v["scaling"], "ppl": v["ppl"]} for p, v in promotions.items()}


def _stage2(rd, res) -> dict:
    return {
        "run_dir": str(rd),
        "stage": 2,
        "table": str(rd.stage2_csv),
        "students": {
            r["key"]: {
                "status": r["status"],
                "val_ppl_initial": r["val_ppl_initial"],
                "val_ppl": r["val_ppl"],
                "student": r["student_path"],
            }
            for r in res.records
        },
    }


def main(args) -> None:
    emit(json.dumps(sweep(args.config, args.overrides, args.out, args.resume, args.tracking_uri, args.cfg)))
