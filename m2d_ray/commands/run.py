"""`m2d run`: the whole pipeline into one run directory, top to bottom.

    checks (every stage's inputs, once; the memory plan against the devices) -> stage 1 (calibrate, the grid, promotions) -> stage 2 (distil)
    -> stage 3 (lm-eval) -> report; RUN_DIR/run.json records each stage's wall time.

A finished stage is skipped on --resume (stage 1 once promotions.json exists; stages 2 and 3 skip the
students and models already in their ledgers); the report is always rewritten.
"""

from __future__ import annotations

import json
import time

from m2d_ray.artifacts import write_json_atomic
from m2d_ray.commands.plan import check_run, log_plan, record_plan
from m2d_ray.commands.report import report
from m2d_ray.commands.runs import check_inputs, check_outcome, check_promoted, check_resume, existing_run, keep_logs, new_run, record_corpora, run_storage
from m2d_ray.config import load_config
from m2d_ray.console import emit, say
from m2d_ray.errors import M2DError


def run(config: str | None, overrides: list[str], out: str | None = None, resume: str | None = None,
        tracking_uri: str | None = None, gpu_memory: int | None = None, cluster: str | None = None) -> dict:
    from m2d_ray.stages.stage1 import run_stage1
    from m2d_ray.stages.stage2 import run_stage2
    from m2d_ray.stages.stage3 import run_stage3
    from m2d_ray.track import run_tracking_uri

    if resume:
        if config or out:
            raise M2DError("--resume RUN_DIR continues with the run's saved config; drop the config and --out (key=value overrides are allowed)")
        rd = existing_run(resume)
        cfg = load_config(rd.config, overrides)
        check_resume(rd, cfg, tracking_uri, (1, 2, 3))
    else:
        if config is None:
            raise M2DError("give a config (e.g. experiments/tiny.yaml) or --resume RUN_DIR")
        cfg = load_config(config, overrides)
        rd = new_run(out, cfg)
        check_inputs(cfg, (1, 2, 3), tracking_uri)
    plan = check_run(cfg, gpu_memory, cluster)  # every stage fits a device it can get, before any work (else exit 2)
    keep_logs(rd.path)
    record_corpora(rd, cfg, (1, 2, 3))
    record_plan(rd, plan)
    store = run_storage(cfg, rd)
    state = json.loads(rd.timings.read_text()) if rd.timings.exists() else {"stages": {}}

    def stage(name: str, fn) -> None:
        """Run a stage and add its times to run.json's (a resume adds what it spent: the bill's measured side)."""
        t0 = time.time()
        say(f"== {name} ==")
        result = fn()
        spent = {"wall_s": time.time() - t0, **{k: getattr(result, k) for k in ("calibrate_s", "targets_s") if hasattr(result, k)}}
        before = state["stages"].get(name, {})
        state["stages"][name] = {**before, **{k: round(before.get(k, 0.0) + v, 1) for k, v in spent.items()},
                                 "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": before.get("runs", 1 if before else 0) + 1}
        write_json_atomic(rd.timings, state)

    if not rd.promotions.exists():
        stage("stage1", lambda: run_stage1(None if resume else cfg, rd, resume=rd.state.exists(), tracking_uri=tracking_uri, store=store))
    check_promoted(rd)
    log_plan(cfg, rd, tracking_uri)
    stage("stage2", lambda: run_stage2(cfg, rd, tracking_uri=tracking_uri, store=store))
    stage("stage3", lambda: run_stage3(cfg, rd, tracking_uri=tracking_uri, store=store))
    reported = {}
    stage("report", lambda: reported.update(report(str(rd), tracking_uri)))
    return {"run_dir": str(rd), "report": str(rd.report / "index.html"),
            "stages": {k: v["wall_s"] for k, v in state["stages"].items()},
            "mlflow_ui": f"mlflow ui --backend-store-uri {run_tracking_uri(cfg, rd, tracking_uri)}", "mlflow_url": reported["mlflow_url"],
            "outcome": check_outcome(rd)}


def main(args) -> None:
    from m2d_ray.sizes import parse_size

    result = run(args.config, args.overrides, out=args.out, resume=args.resume, tracking_uri=args.tracking_uri,
                 gpu_memory=parse_size(args.gpu_memory) if args.gpu_memory else None, cluster=args.cluster)
    say(f"report: {result['report']}")
    say(f"MLflow UI: {result['mlflow_ui']}  (then open {result['mlflow_url']})")
    emit(json.dumps(result))
