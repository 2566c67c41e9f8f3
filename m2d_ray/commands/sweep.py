"""`m2d sweep`: stage 1 (a new grid, or --resume) or, with stage=2 and --resume RUN_DIR, stage 2 on its promotions."""

from __future__ import annotations

import json

from m2d_ray.commands.runs import check_inputs, check_promoted, check_resume, existing_run, keep_logs, new_run, record_corpora, run_storage
from m2d_ray.config import load_config
from m2d_ray.console import emit
from m2d_ray.errors import M2DError


def sweep(config: str | None, overrides: list[str], out: str | None = None, resume: str | None = None,
          tracking_uri: str | None = None) -> dict:
    from m2d_ray.stages.stage1 import run_stage1

    if resume:
        rd = existing_run(resume)
        cfg = load_config(config or rd.config, overrides)
        if cfg.stage == 2:
            check_resume(rd, cfg, tracking_uri, (2,))
            keep_logs(rd.path)
            record_corpora(rd, cfg, (2,))
            return _stage2(rd, cfg, tracking_uri)
        if config or overrides or out:
            raise M2DError("--resume RUN_DIR reuses the run's saved config; drop the config, overrides and --out/--model/--*-data (or add stage=2)")
        check_resume(rd, cfg, tracking_uri, (1,))
    else:
        if config is None:
            raise M2DError("give a config (e.g. experiments/tiny.yaml) or --resume RUN_DIR")
        cfg = load_config(config, overrides)
        if cfg.stage == 2:
            raise M2DError("stage=2 distils the promotions of a finished stage 1: add --resume RUN_DIR")
        rd = new_run(out, cfg)
        check_inputs(cfg, (1,), tracking_uri)
    keep_logs(rd.path)
    record_corpora(rd, cfg, (1,))
    res = run_stage1(None if resume else cfg, rd, resume=bool(resume), tracking_uri=tracking_uri, store=run_storage(cfg, rd))
    statuses = [r["status"] for r in res.records]
    check_promoted(rd)
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


def _stage2(rd, cfg, tracking_uri: str | None) -> dict:
    from m2d_ray.stages.stage2 import run_stage2

    records = run_stage2(cfg, rd, tracking_uri=tracking_uri, store=run_storage(cfg, rd)).records
    return {
        "run_dir": str(rd),
        "stage": 2,
        "table": str(rd.stage2_csv),
        "students": {r["key"]: {"status": r["status"], "val_ppl_initial": r["val_ppl_initial"], "val_ppl": r["val_ppl"], "student": r["student_path"]}
                     for r in records},
    }


def main(args) -> None:
    emit(json.dumps(sweep(args.config, args.overrides, out=args.out, resume=args.resume, tracking_uri=args.tracking_uri)))
