"""The bill held to measurement (issue 33).

    python -m benchmarks.perf.bill_vs_measured --run RUN_DIR    # a finished `m2d run tiny`: its
        estimate against
    its walls
    python -m benchmarks.perf.bill_vs_measured --paper          # the paper's grid priced on cluster.yaml, and its 73 s
        step on 2 x
    B200

--run reads RUN_DIR/memory_plan.json (the estimate `m2d run` made before calibration, with the CPU thread rate it
measured) and RUN_DIR/run.json (the walls) through the report's own rows. --paper plans qwen3_30b_a3b
on cluster.yaml's node types (the published config.json, offline) and sets the step of the paper's distillation
(384 x 4,096 tokens, the teacher online) on 2 x B200 beside the paper's own 73 s.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.common import REPO, machine_line
from m2d_ray.shipped import EXPERIMENTS


def measured(run: Path, load: float | None) -> None:
    """The run's estimate (as `m2d run` made it, or re-planned by this code, with its plan.* defaults, with others'
    load `load` at the CPU rate the run recorded) beside its measured walls."""
    from m2d_ray.report.analysis import cost_rows
    from m2d_ray.run_dir import RunDir
    from m2d_ray.stages.report import run_data

    data = run_data(RunDir(run))
    if load is not None:
        from m2d_ray.config import PlanConfig, load_config
        from m2d_ray.evaluate.runner import host_available
        from m2d_ray.pipeline import plan_run
        from m2d_ray.plan.run_plan import Devices, as_record

        rate = (data.memory_plan.get("cost") or {}).get("cpu_flops")
        cfg = load_config(
            run / "config.yaml"
        )  # the plan's constants this code's defaults, at the CPU rate the run measured
        cfg = replace(cfg, plan=replace(PlanConfig(), cpu_flops=rate))
        data = replace(data, memory_plan=as_record(plan_run(cfg, Devices(host_memory=host_available(), cpu_load=load))))
        print(
            f"re-planned with others' load {load} (CPU thread rate {data.memory_plan['cost']['cpu_flops']:.3g} FLOP/s)"
        )
    rows = cost_rows(data)
    print("| stage | FLOPs | estimated s | measured s | measured / estimated |\n|---|---:|---:|---:|---:|")
    for r in rows:
        est, m = r["estimated_s"], r["measured_s"]
        print(f"| {r['stage']} | {r['flops']:.3g} | {est:.0f} | {'-' if m is None else f'{m:.0f}'} | {_ratio(r)} |")
    total_est = sum(r["estimated_s"] for r in rows)
    total_m = sum(r["measured_s"] or 0 for r in rows)
    print(f"| **total** | | {total_est:.0f} | {total_m:.0f} | {total_m / total_est:.2f} |")
    print(json.dumps({"rows": rows}))


def _ratio(r: dict) -> str:
    return "-" if r["ratio"] is None else f"{r['ratio']:.2f}"


def paper() -> None:
    from m2d_ray.accelerators import GPU_PEAK_BF16
    from m2d_ray.config import load_config
    from m2d_ray.models import model_config
    from m2d_ray.pipeline import plan as make_plan
    from m2d_ray.plan import flops
    from m2d_ray.plan.devices import cluster_settings, from_cluster_yaml
    from m2d_ray.plan.run_plan import Devices
    from m2d_ray.plan.shapes import models_of

    qwen = model_config(str(EXPERIMENTS / "configs" / "Qwen--Qwen3-30B-A3B"))
    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml")
    head, idle = cluster_settings(REPO / "cluster.yaml")
    plan = make_plan(cfg, qwen, Devices(None, None, tuple(from_cluster_yaml(REPO / "cluster.yaml")), None, head, idle))
    print(plan.cost.table())
    if plan.cost.bound:
        print("\nwith no student stopped early (the bound):\n" + plan.cost.bound.table())
    m = models_of(qwen)
    tokens = 384 * 4096
    print(
        "\n| the paper's step, 384 x 4,096 tokens | FLOPs / token | FLOPs / step | s / step on 2 x B200 at "
        "plan.efficiency "
        f"{cfg.plan.efficiency} | efficiency the paper's 73 s implies |\n|---|---:|---:|---:|---:|"
    )
    for label, targets, ckpt in (
        ("teacher online, no checkpointing", "online", "none"),
        ("teacher online, checkpointing", "online", "full"),
        ("hidden states (m2d's paper configs), checkpointing", "hidden", "full"),
    ):
        one_step = dict(steps=1, batch_size=384, grad_accum=1, workers=1, seq_len=4096, eval_max_tokens=0)
        c = replace(cfg, distill=replace(cfg.distill, **one_step, checkpointing=ckpt))
        f = flops.stage2_flops(c, m, targets)
        peak = 2 * GPU_PEAK_BF16["B200"]
        print(
            f"| {label} | {f / tokens:.3g} | {f:.3g} | {f / (peak * cfg.plan.efficiency):.1f} | {f / (73 * peak):.3f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--load", type=float, help="with --run: re-plan with this many other runnable processes")
    ap.add_argument("--paper", action="store_true")
    a = ap.parse_args()
    print(machine_line(), file=sys.stderr)
    if a.run:
        measured(a.run, a.load)
    if a.paper:
        paper()


if __name__ == "__main__":
    main()
