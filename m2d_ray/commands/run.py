"""`m2d run`: the whole pipeline into one run directory, top to bottom.

    checks (every stage's inputs, once; the memory plan and the bill against the devices) -> the run's context ->
    calibrate -> stage 1 -> targets (a cached mode) -> stage 2 -> stage 3 -> report; RUN_DIR/run.json records each
    stage's wall time.

A finished stage is skipped on --resume (calibration and stage 1 once promotions.json exists; stages 2 and 3
skip the students and models already in their ledgers); the report is always rewritten.
"""

from __future__ import annotations

import json
from pathlib import Path

from m2d_ray import pipeline
from m2d_ray.commands.plan import check_run, check_space, kept_choices, log_plan, record_plan
from m2d_ray.commands.runs import check_outcome, existing_run, keep_logs, new_run
from m2d_ray.config import SweepConfig, load_config
from m2d_ray.console import emit, say
from m2d_ray.errors import M2DError, StorageFull, causes, full_disk
from m2d_ray.runtime.context import RunContext
from m2d_ray.sizes import gib, parse_size


def run(
    config: str | None,
    overrides: list[str],
    out: str | None = None,
    resume: str | None = None,
    tracking_uri: str | None = None,
    gpu_memory: int | None = None,
    cluster: str | None = None,
    loaded: SweepConfig | None = None,
) -> dict:
    """The whole run of `config` (`loaded`: that config as the CLI read it with `overrides`), or a resumed one."""
    stages = pipeline.STAGES
    if resume:
        if config or out:
            raise M2DError(
                "--resume RUN_DIR continues with the run's saved config; drop the config and --out (key=value "
                "overrides are allowed)"
            )
        rd = existing_run(resume)
        cfg = load_config(rd.config, overrides)
        pipeline.check_resume(rd, cfg, stages, tracking_uri)
        chosen = kept_choices(rd, cfg)
    else:
        if config is None:
            raise M2DError("give a config (e.g. tiny, or a YAML file) or --resume RUN_DIR")
        cfg = loaded or load_config(config, overrides)
        rd = new_run(out, cfg)
        pipeline.check(cfg, stages, tracking_uri)
        chosen = None
    # every stage fits a device it can get, before any work (else exit 2); under stage2.targets=auto the plan chooses
    # each teacher's targets here, once, and the run uses them
    plan = check_run(cfg, gpu_memory, cluster, chosen)
    if plan.decided:  # what the plan decided for an auto setting: the run's config records the decided value
        cfg = load_config(rd.config if resume else config, [*overrides, *plan.overrides()])
    check_space(plan, rd.path, cfg, resumed=bool(resume))  # and the disk it writes to has room for its peak
    ctx = (
        RunContext(cfg, rd, tracking_uri, tuple(stages), plan.targets)
        if resume
        else RunContext.create(cfg, rd, tracking_uri, tuple(stages), plan.targets)
    )
    keep_logs(rd.path)
    pipeline.record_corpora(rd, cfg, stages)
    record_plan(rd, plan)
    log_plan(ctx)
    try:
        results = pipeline.run(ctx)
    except Exception as exc:
        if not isinstance(exc, StorageFull) and full_disk(exc) is None:
            raise
        raise StorageFull(full_line(exc, rd.path, cfg, plan.storage_peak_bytes)) from exc
    reported = results.get("report") or {}
    times = rd.stage_times()
    return {
        "run_dir": str(rd),
        "report": str(rd.report / "index.html"),
        "stages": {s.name: times[s.name]["wall_s"] for s in stages if s.name in times},
        "mlflow_ui": f"mlflow ui --backend-store-uri {ctx.tracker.uri}",
        "mlflow_url": reported.get("mlflow_url", ctx.tracker.ui_url()),
        "outcome": check_outcome(rd),
    }


def full_line(exc: BaseException, run_dir: Path, cfg, peak: int) -> str:
    """The one line of a run a full, over-quota or read-only filesystem stopped: what could not be written and where,
    what the plan expected there, and how to go on (what was written whole stays; a resume skips it)."""
    where = cfg.storage or str(run_dir)
    what = str(exc) if isinstance(exc, StorageFull) else f"{type(exc).__name__}: {full_disk(exc)}"
    name = next((e.filename for e in causes(exc) if isinstance(e, OSError) and e.filename), None)
    return (
        f"{what}{f' at {name}' if name else ''}; the run writes to {where}, where the plan expected {gib(peak)} at its "
        f"peak: free space there (or grow the filesystem), then m2d run --resume {run_dir}"
    )


def main(args) -> None:
    gpu_memory = parse_size(args.gpu_memory) if args.gpu_memory else None
    result = run(
        args.config, args.overrides, args.out, args.resume, args.tracking_uri, gpu_memory, args.cluster, args.cfg
    )
    say(f"report: {result['report']}")
    say(f"MLflow UI: {result['mlflow_ui']}  (then open {result['mlflow_url']})")
    emit(json.dumps(result))
