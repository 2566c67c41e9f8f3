"""`m2d plan`: every stage's memory per device, its GPUs, the storage a run writes and its bill (FLOPs, wall
time, GPU-hours, dollars), from configs alone; and the same check that `m2d run` makes before calibration (`check_run`).

    table (stdout, via the log)    one row per stage (stage 3: per model), then the storage, then the bill per stage and
    in all
    JSON line                      {"gpu_memory", "targets": {teacher: {"targets", "shard_teacher"}},
                                   "stages": {stage: {"per_gpu_bytes", "gpus", "fits", "flops", "seconds",
                                   "gpu_hours", "dollars"}}, "storage_bytes", "storage_peak_bytes" (what stays; the most
                                   while
                                   students train), "teacher_checkpoint_bytes" (the teacher as published: quantised,
                                   its stored bytes), "seconds", "gpu_hours", "dollars" (the run's; with ASHA on,
                                   expected),
                                   "bound": {"seconds", "gpu_hours", "dollars"} (ASHA on: no student stopped early)}
    exit 2 + one line              when a stage does not fit its device, no node type can hold its request, or the run
                                   may cost more than plan.max_dollars (with ASHA on: its bound)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from m2d_ray.accelerators import host_available
from m2d_ray.artifacts import write_json_atomic
from m2d_ray.catalog.distill import AUTO
from m2d_ray.config import SweepConfig
from m2d_ray.console import emit, note, say
from m2d_ray.errors import M2DError
from m2d_ray.pipeline import plan_run
from m2d_ray.plan.devices import cluster_settings, from_cluster_yaml, local_node
from m2d_ray.plan.run_plan import Devices, RunPlan, as_record, plan_line
from m2d_ray.plan.space import needs, space_problem
from m2d_ray.plan.targets import recorded
from m2d_ray.sizes import parse_size
from m2d_ray.storage import is_remote

# Imported inside functions: Ray, torch (`m2d plan` and the checks read this module without importing them).


def show(plan: RunPlan, where: str, out=say) -> None:
    out(f"memory plan ({where}):")
    for line in plan.table().splitlines():
        out("  " + line)


def refuse(problems: list[str]) -> None:
    """Exit 2 with the first stage that cannot run (the others are in the table)."""
    if problems:
        more = f" (+{len(problems) - 1} more in the table)" if len(problems) > 1 else ""
        raise M2DError(problems[0] + more + " (`m2d plan CONFIG` shows every stage)")


def local_gpu_memory() -> int | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def others_load(seconds: float = 0.5) -> float:
    """Runnable processes besides this one: on a shared machine a local run's CPU stages get a fair share of the
    cores, and the plan's time says so. The cores' busy fraction over `seconds` (/proc/stat), or, when they are
    all busy, the 1-minute load average (which lags: it counts a burst that has ended)."""

    def sample() -> tuple[int, int]:
        v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return v[3] + (v[4] if len(v) > 4 else 0), sum(v)

    try:
        i0, t0 = sample()
        time.sleep(seconds)
        i1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return max(0.0, os.getloadavg()[0] - 1.0)
    busy = 1.0 - (i1 - i0) / max(1, t1 - t0)
    return busy * (os.cpu_count() or 1) if busy < 0.9 else max(0.0, os.getloadavg()[0] - 1.0)


def check_run(
    cfg: SweepConfig, gpu_memory: int | None = None, cluster: str | None = None, choices: dict | None = None
) -> RunPlan:
    """`m2d run`, before calibration: the plan against the devices Ray has or can start (the node types of
    `cluster` (a cluster YAML), else of Ray's autoscaler, else its live nodes; --gpu-memory for every GPU);
    a request no node type holds, or memory that does not fit, exits 2. `choices`: the stage-2 teachers' targets a
    resumed run was planned with (else the config's, or under auto the plan's choice, said in one line)."""

    head, idle = cluster_settings(cluster) if cluster else (None, 0.0)
    if cluster:
        nodes, where, local = from_cluster_yaml(cluster), f"the node types of {cluster}", False
    elif cfg.ray.address or os.environ.get("RAY_ADDRESS") or _ray_up():
        # a Ray cluster (or one this process joined): its autoscaler's node types, else its live nodes
        from m2d_ray.runtime.ray_env import (  # lazy: Ray only where a cluster is asked
            ensure_ray,
            node_types,
            on_cluster,
        )

        ensure_ray(cfg.ray)
        (nodes, where), local = node_types(), not on_cluster()
    else:  # the local Ray this run will start
        nodes, where, local = [local_node(cfg.ray.num_cpus)], "this machine", True
    devices = Devices(
        gpu_memory or (local_gpu_memory() if local else None),
        None,
        tuple(nodes) if nodes is not None else None,
        host_available() if local else None,
        head,
        idle,
        others_load() if local else 0.0,
    )
    plan = plan_run(cfg, devices, choices=choices or None)
    problems = plan.problems()
    show(
        plan,
        f"against {where}" + (f", GPUs of {gpu_memory / 2**30:.1f} GiB" if gpu_memory else ""),
        note if problems else say,
    )
    refuse(problems)
    if cfg.stage2.targets == AUTO:
        say(f"stage2.targets=auto{' (as the run was planned)' if choices else ''}: " + "; ".join(plan.targets_lines()))
    return plan


def check_space(plan: RunPlan, run_dir: Path, cfg: SweepConfig, resumed: bool) -> None:
    """The plan's storage peak against the free space of the filesystems the run writes to (plan/space.py): a disk
    too small is refused here, before any work, with one line (exit 2)."""
    if cfg.storage and is_remote(cfg.storage):
        say(f"storage {cfg.storage}: an object store reports no free space; plan.max_storage bounds what is stored")
    problem = space_problem(needs(plan.storage_peak_bytes, run_dir, cfg.storage, resumed))
    if problem:
        raise M2DError(problem)


def kept_choices(rd, cfg: SweepConfig) -> dict | None:
    """The stage-2 teachers' targets a resumed run keeps: under auto, those its plan chose once stage 2 has started
    (its students may have trained on them); before that, and for an explicit mode, the plan decides again."""
    if cfg.stage2.targets != AUTO or not rd.stage2_config.exists():
        return None
    return recorded(rd.read_memory_plan()) or None


def _ray_up() -> bool:

    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def record_plan(rd, plan: RunPlan) -> None:
    """The plan in the run directory: the report sets it beside the measured peaks."""

    rd.path.mkdir(parents=True, exist_ok=True)
    write_json_atomic(rd.memory_plan, as_record(plan))


def log_plan(ctx) -> None:
    """The run's plan on its MLflow parent run: each stage's planned bytes per device as a metric
    `plan.<stage>.per_gpu_bytes`, its bill, the whole plan as an artifact."""
    plan = ctx.rd.read_memory_plan()
    if plan is None:
        return
    tracker, parent = ctx.tracker, ctx.parent()
    bill = {
        f"plan.{k}.{key}": v[key]
        for k, v in plan["stages"].items()
        for key in ("seconds", "gpu_hours", "dollars", "flops")
        if v.get(key) is not None
    }
    bound = (plan.get("cost") or {}).get("bound") or {}  # ASHA on: the most the run can cost
    bill.update(
        {f"plan.bound.{key}": bound[key] for key in ("seconds", "gpu_hours", "dollars") if bound.get(key) is not None}
    )
    chosen = {
        f"plan.{k}.{field}": v[field]
        for k, v in (plan.get("targets") or {}).items()
        for field in ("targets", "shard_teacher")
    }  # each stage-2 teacher's targets (`auto`: the plan's choice)
    tracker.log(
        parent,
        params=chosen,
        metrics={**{f"plan.{k}.per_gpu_bytes": v["per_gpu_bytes"] for k, v in plan["stages"].items()}, **bill},
    )
    tracker.artifacts(parent, [ctx.rd.memory_plan])


def main(args) -> None:
    cfg = args.cfg  # read and checked once, by the CLI
    gpu_memory = parse_size(args.gpu_memory) if args.gpu_memory else None
    nodes = tuple(from_cluster_yaml(args.cluster)) if args.cluster else None
    host = None
    if not cfg.uses_gpus() and nodes is None:
        host = host_available()
    head, idle = cluster_settings(args.cluster) if args.cluster else (None, 0.0)
    plan = plan_run(
        cfg,
        Devices(gpu_memory, args.gpus_per_node, nodes, host, head, idle, others_load() if host else 0.0),
        args.model,
    )
    where = (
        ", ".join(
            filter(
                None,
                [
                    f"GPUs of {gpu_memory / 2**30:.1f} GiB" if gpu_memory else None,
                    f"node types of {args.cluster}" if args.cluster else None,
                ],
            )
        )
        or "this machine"
    )
    show(plan, where, emit)  # the table and the bill are the command's result: stdout
    if args.json:  # the same figures on one line, for a program (as `kubectl -o json`)
        emit(plan_line(plan))
    refuse(plan.problems())
