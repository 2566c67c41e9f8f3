"""The bill of a run before it starts: the arithmetic every stage prices its work with (FLOPs, wall time,
GPU-hours, dollars), from shapes and configs. Each stage says what it counts (`Stage.cost` in its module).

FLOPs: plan/flops.py, up to where ASHA is expected to stop a student (plan/asha.py); the table: plan/bill.py.

Time: a unit's FLOPs / (its devices' peak x plan.efficiency of its work; plan.cpu_efficiency on CPUs) + a fixed
start-up (plan.*_s; on a GPU plan.gpu_start_s), its units spread over the lanes the run will have (trials at once,
students at once, models at once, bounded by the node types' max_workers), longest first. GPU-hours: the units'
seconds x their GPUs. Dollars: the nodes a stage holds (its lanes' GPUs over a node's GPUs) x its wall time plus the
autoscaler's idle tail (idle_timeout_minutes) x the node type's hourly price (plan/prices.py; the dearest type that
can hold the request: an upper bound), and the head node for the whole run. With ASHA on, the bill is the expected
one and `bound` the same run with no student stopped: the most it can cost, what plan.max_dollars is held to.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

from m2d_ray.accelerators import GPU_PEAK_BF16
from m2d_ray.config import SweepConfig
from m2d_ray.distill.flops import matmul_rate
from m2d_ray.plan.bill import StageCost, add
from m2d_ray.plan.devices import NodeType, holders
from m2d_ray.plan.prices import hourly

# Imported inside functions: torch (a CPU's matmul rate, measured only where a stage runs on CPUs).


def lanes_wall(unit_seconds: list[float], lanes: int) -> float:
    """The wall time of units run `lanes` at a time, longest first (each starts when a lane frees)."""
    heap = [0.0] * max(1, min(lanes, len(unit_seconds) or 1))
    for s in sorted(unit_seconds, reverse=True):
        heapq.heapreplace(heap, heap[0] + s)
    return max(heap) if unit_seconds else 0.0


def cpu_rate(cfg: SweepConfig) -> float:
    """One CPU thread's fp32 FLOP/s: plan.cpu_flops, else a 512 x 512 matmul measured on one thread (~0.1 s)."""
    if cfg.plan.cpu_flops:
        return cfg.plan.cpu_flops
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return matmul_rate("cpu", torch.float32, n=512, repeats=3)
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Place:
    """Where a stage's units run: GPUs (or CPU threads) of one unit, the lanes at once, the node type priced."""

    gpus: float
    threads: int
    lanes: int
    accelerator: str | None
    node: NodeType | None


def place(
    request: dict, gpus: float, threads: int, wanted: int, nodes: tuple[NodeType, ...] | None, accelerator: str | None
) -> Place:
    """The lanes a stage gets: `wanted` at once, bounded by what the node types that hold one unit can take
    (max_workers of them); the GPU type: the pin, else the slowest among them; priced at the dearest."""
    found = holders(list(nodes), request) if nodes is not None and gpus > 0 else []
    lanes = max(1, wanted)
    if found and gpus > 0 and all(n.max_workers is not None for n in found):
        room = sum(n.max_workers * max(1, int(n.gpus // gpus)) if gpus <= n.gpus else n.max_workers for n in found)
        lanes = max(1, min(lanes, room))
    acc = accelerator or min(
        (n.accelerator for n in found if n.accelerator in GPU_PEAK_BF16), key=GPU_PEAK_BF16.get, default=None
    )
    node = max(found, key=lambda n: hourly(n) or 0.0) if found else None
    return Place(gpus, threads, lanes, acc, node)


@dataclass(frozen=True)
class Host:
    """The CPUs a CPU stage shares: one thread's FLOP/s, the cores, and the runnable processes of others (a
    shared machine's load average when the plan is made; 0 on a cluster's nodes)."""

    rate: float
    cores: int
    load: float = 0.0

    def share(self, threads: int, lanes: int) -> float:
        """The cores one unit of `threads` gets beside `lanes - 1` others and the load (fair share)."""
        return threads * min(1.0, self.cores / (self.load + lanes * threads))


def stage_cost(
    cfg: SweepConfig,
    name: str,
    unit_flops: list[float],
    p: Place,
    overhead: float,
    cpu: Host | None,
    prices: dict,
    idle_s: float,
    rounds: int = 1,
    io_s: list[float] | None = None,
    comm_s: list[float] | None = None,
    work: list[str] | None = None,
) -> StageCost:
    """Seconds, GPU-hours and dollars of `unit_flops` run at `p` in `rounds` Ray rounds (Tune experiments, Ray
    Data passes), each with its fixed start and finish (plan.stage_s); on CPUs the start-up slows as the compute
    does. A unit takes the longer of its compute and its reads (`io_s`: cached targets at the storage's bandwidth),
    plus its communication (`comm_s`: a sharded teacher's gathers, not overlapped). On a GPU each unit computes at
    the efficiency of its `work` (a stage-2 targets mode; default forward: plan.efficiency)."""
    n = len(unit_flops)
    if p.gpus > 0:
        peak = GPU_PEAK_BF16.get(p.accelerator or "")
        rates = [p.gpus * peak * cfg.plan.gpu_efficiency(w) for w in work or ["forward"] * n] if peak else None
        device = f"{p.gpus:g} x {p.accelerator or 'GPU'}"
    else:
        lanes = min(p.lanes, n) or 1
        share = cpu.share(p.threads, lanes) if cpu else 0.0
        rates = [share * cpu.rate * cfg.plan.cpu_efficiency] * n if cpu else None
        overhead = overhead * p.threads / share if cpu else overhead
        device = f"{p.threads} CPU thread" + ("s" if p.threads > 1 else "")
    if rates is None:
        return StageCost(name, sum(unit_flops), None, None, None, n, p.lanes, device)
    io_s = io_s or [0.0] * n
    comm_s = comm_s or [0.0] * n
    compute = [f / r for f, r in zip(unit_flops, rates)]
    unit_s = [max(c, io) + comm + overhead for c, io, comm in zip(compute, io_s, comm_s)]
    io_bound = sum(io > c for c, io in zip(compute, io_s))
    wall = lanes_wall(unit_s, p.lanes) + rounds * cfg.plan.stage_s * (
        1.0 if p.gpus > 0 or cpu is None else max(1.0, (cpu.load + 1) / cpu.cores)
    )
    gpu_hours = sum(unit_s) * p.gpus / 3600
    dollars = node_hours = None
    if p.gpus == 0:
        dollars = 0.0  # CPU work runs on the head (priced for the whole run) or this machine
    elif p.node is not None and p.node.gpus > 0:
        nodes = math.ceil(min(p.lanes, len(unit_flops)) * p.gpus / p.node.gpus)
        node_hours = nodes * (wall + idle_s) / 3600
        price = hourly(p.node, prices)
        dollars = None if price is None else node_hours * price
    return StageCost(
        name,
        sum(unit_flops),
        wall,
        gpu_hours,
        dollars,
        len(unit_flops),
        min(p.lanes, len(unit_flops)),
        device,
        p.node.name if p.node else None,
        node_hours,
        io_bound,
    )


def before(first: StageCost, stage: StageCost) -> StageCost:
    """`stage` with `first` run before it, as one row and one wall (a baseline's search before the students)."""
    return replace(
        stage,
        flops=stage.flops + first.flops,
        seconds=add([first.seconds, stage.seconds]),
        gpu_hours=add([first.gpu_hours, stage.gpu_hours]),
        dollars=add([first.dollars, stage.dollars]),
        node_hours=None if stage.node_hours is None else stage.node_hours + (first.node_hours or 0.0),
        io_bound=stage.io_bound + first.io_bound,
    )


def side_by_side(name: str, parts: list[StageCost]) -> StageCost:
    """Rows whose units run at the same time as one row `name`: the longest wall, the sums of the rest."""
    seconds = None if any(p.seconds is None for p in parts) else max(p.seconds for p in parts)
    return StageCost(
        name,
        sum(p.flops for p in parts),
        seconds,
        add(p.gpu_hours for p in parts),
        add(p.dollars for p in parts),
        sum(p.units for p in parts),
        sum(p.lanes for p in parts),
        " + ".join(p.device for p in parts),
        " + ".join(dict.fromkeys(filter(None, (p.node for p in parts)))) or None,
        add(p.node_hours for p in parts),
        sum(p.io_bound for p in parts),
    )
