"""The bill of a run before it starts: the arithmetic every stage prices its work with (FLOPs, wall time,
GPU-hours, dollars), from shapes and configs. Each stage says what it counts (`Stage.cost` in its module).

FLOPs count matrix products (2 per multiply-add) as distill/flops.py does, from the shapes read on the meta
device: a forward at the top-k (or every expert), a calibration token's E x E output Gram, the output head; a
student's step is its forward and backward (4 forwards under gradient checkpointing: the recomputation is time)
plus its teacher's side (the forward online, the head from cached hidden states), with its validations, up to
where ASHA is expected to stop it (asha_ends).

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
import random
from collections import Counter
from dataclasses import asdict, dataclass, replace

import torch

from m2d_ray.accelerators import GPU_PEAK_BF16
from m2d_ray.catalog.targets import HIDDEN, ONLINE
from m2d_ray.config import SweepConfig, k_values
from m2d_ray.distill.flops import causal_attention_flops, matmul_rate
from m2d_ray.plan.devices import NodeType, holders
from m2d_ray.plan.prices import hourly
from m2d_ray.plan.shapes import Models, Shape
from m2d_ray.plan.suite import CHARS_PER_TOKEN

#: stage-1 students that outlive the probe round: P2 measured 81 full evaluations of 204 distinct students
SURVIVORS = 81 / 204


@dataclass(frozen=True)
class StageCost:
    name: str
    flops: float
    seconds: float | None  # None: no peak known for its device
    gpu_hours: float | None
    dollars: float | None  # None: no price known (or no node types)
    units: int  # trials, students, models
    lanes: int  # units at once
    device: str  # what one unit runs on, described
    node: str | None = None  # the node type priced
    node_hours: float | None = None
    io_bound: int = 0  # units whose reads of cached targets outlast their compute (their time is the reads')


@dataclass(frozen=True)
class RunCost:
    stages: tuple[StageCost, ...]
    head_dollars: float | None = None
    cpu_flops: float | None = (
        None  # one CPU thread's FLOP/s the CPU stages were timed with (measured or plan.cpu_flops)
    )
    cpu_load: float = 0.0  # others' runnable processes the CPU stages shared the cores with
    asha: tuple[
        tuple[float, int], ...
    ] = ()  # stage 2's students: (reports, students that end there), expected (asha_ends)
    bound: RunCost | None = (
        None  # the same run with no student stopped early: the most it can cost (when ASHA stops some)
    )
    storage_dollars: float = 0.0  # the run's storage for its length, at the storage kind's price a TB-month
    storage_note: str = ""  # what was priced, said below the table

    @property
    def seconds(self) -> float | None:
        return _sum(s.seconds for s in self.stages)

    @property
    def gpu_hours(self) -> float | None:
        return _sum(s.gpu_hours for s in self.stages)

    @property
    def dollars(self) -> float | None:
        return _sum([*(s.dollars for s in self.stages), self.head_dollars or 0.0, self.storage_dollars])

    def over_budget(self, max_dollars: float | None) -> str | None:
        """The one line a run that may cost more than plan.max_dollars (or cannot be priced against it) is refused
        with. It is held to the most the run can cost: with ASHA on, the bill with no student stopped early."""
        if max_dollars is None:
            return None
        most = self.bound or self
        if most.dollars is None:
            unpriced = ", ".join(s.name for s in most.stages if s.dollars is None)
            return (
                f"plan.max_dollars={max_dollars:g} but {unpriced} cannot be priced (no GPU type's peak or node type's "
                "price known); "
                "give --cluster CLUSTER_YAML and plan.prices.<node type>=DOLLARS_PER_HOUR"
            )
        if most.dollars > max_dollars:
            top = max(most.stages, key=lambda s: s.dollars or 0.0)
            asha = f" if ASHA stops no student (expected {_usd(self.dollars)})" if self.bound else ""
            return (
                f"the run would cost {'up to ' if self.bound else ''}{_usd(most.dollars)}{asha} (most in {top.name}: "
                f"{_usd(top.dollars)}, "
                f"{_num(top.gpu_hours)} GPU-hours) but plan.max_dollars is {_usd(max_dollars)}; give a smaller grid, "
                "fewer distill.steps "
                "or students (stage2.pairs), or raise plan.max_dollars"
            )
        return None

    def by_name(self) -> dict[str, StageCost]:
        return {s.name: s for s in self.stages}

    def to_json(self) -> dict:
        return {
            "stages": {s.name: asdict(s) for s in self.stages},
            "head_dollars": self.head_dollars,
            "storage_dollars": self.storage_dollars,
            "cpu_flops": self.cpu_flops,
            "cpu_load": self.cpu_load,
            **self.totals(),
            **({"asha": [list(e) for e in self.asha], "bound": self.bound.to_json()} if self.bound else {}),
        }

    def totals(self) -> dict:
        return {"seconds": self.seconds, "gpu_hours": self.gpu_hours, "dollars": self.dollars}

    def table(self) -> str:
        rows = [("stage", "units", "at once", "device", "FLOPs", "wall", "GPU-hours", "dollars")]
        for s in self.stages:
            rows.append(
                (
                    s.name,
                    str(s.units),
                    str(s.lanes),
                    s.device + (f" on {s.node}" if s.node else ""),
                    f"{s.flops:.3g}",
                    duration(s.seconds),
                    _num(s.gpu_hours),
                    _usd(s.dollars),
                )
            )
        if self.head_dollars is not None:
            rows.append(("head node", "", "", "the whole run", "", "", "", _usd(self.head_dollars)))
        if self.storage_dollars:
            rows.append(("storage", "", "", "the whole run", "", "", "", _usd(self.storage_dollars)))
        rows.append(
            (
                "total",
                "",
                "",
                "",
                f"{sum(s.flops for s in self.stages):.3g}",
                duration(self.seconds),
                _num(self.gpu_hours),
                _usd(self.dollars),
            )
        )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines += [
            f"{s.name} is I/O-bound: {s.io_bound} of {s.units} units read their cached targets slower than they "
            "compute (their time is the reads'; plan.read_bandwidth.<kind>)"
            for s in self.stages
            if s.io_bound
        ]
        lines += [self.storage_note] if self.storage_note else []
        if self.bound:
            n, (last, done) = sum(k for _, k in self.asha), self.asha[-1]
            stops = ", ".join(
                f"{k} stopped after {r:g} reports" if i == 0 else f"{k} after {r:g}"
                for i, (r, k) in enumerate(self.asha[:-1])
            )
            lines += [
                f"stage 2 under ASHA (stage2.asha; expected, students keeping their order of quality): of {n} "
                f"students, {stops}; "
                f"{done} finish all {last:g} and only they are evaluated",
                "with none stopped, the most it can cost (what plan.max_dollars is held to): "
                f"{duration(self.bound.seconds)}, "
                f"{_num(self.bound.gpu_hours)} GPU-hours, {_usd(self.bound.dollars)}",
            ]
        return "\n".join(lines)


def _sum(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else float(sum(values))


def _num(v: float | None) -> str:
    return "?" if v is None else f"{v:,.3g}" if v < 1000 else f"{v:,.0f}"


def _usd(v: float | None) -> str:
    return "?" if v is None else f"${v:,.2f}" if v < 1000 else f"${v:,.0f}"


def duration(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


# ---- FLOPs per token -------------------------------------------------------------------------------
def forward_flops(s: Shape, seq: int, all_experts: bool = False) -> float:
    """One token's forward: its matmuls (every expert, or the top-k) and causal attention over `seq`."""
    return 2.0 * (s.matmul_params - (0 if all_experts else s.inactive_expert_params)) + causal_attention_flops(
        s.q_width, s.layers, seq
    )


def calibration_flops(t: Shape, seq: int) -> float:
    """One calibration token: the teacher with every expert, and each MoE layer's E x E output Gram."""
    return forward_flops(t, seq, all_experts=True) + 2.0 * t.moe_layers * t.experts**2 * t.hidden


def head_flops(t: Shape) -> float:
    return 2.0 * t.vocab * t.hidden


def distinct_students(cfg: SweepConfig, t: Shape) -> tuple[int, int]:
    """(configs of the grid, the distinct students dedupe leaves: at K = k every grouping builds the same one)."""
    g = cfg.grid
    Ks = k_values(g.K, t.top_k, t.experts)
    configs = len(g.scoring) * len(g.grouping) * len(g.scaling) * len(Ks)
    same = (len(g.grouping) - 1) * len(g.scoring) * len(g.scaling) if (cfg.search.dedupe and t.top_k in Ks) else 0
    return configs, configs - same


def stage1_chunks(cfg: SweepConfig, distinct: int) -> tuple[int, float]:
    """(trials, perplexity chunks scored) as the search runs: a probe chunk each, then the survivors' rest."""
    c = cfg.eval.chunks
    if not cfg.search.early_stop:
        return distinct, float(distinct * c)
    survivors = math.ceil(SURVIVORS * distinct)
    if cfg.search.probe:
        return distinct + survivors, distinct + survivors * (c - 1.0)
    return distinct, survivors * c + (distinct - survivors) * min(c, cfg.search.grace_chunks + 1)


def eval_tokens(cfg: SweepConfig) -> float:
    """The perplexity tokens of stage 1 (the first eval.max_chars characters)."""
    chars = cfg.eval.max_chars or 300_000
    return chars / CHARS_PER_TOKEN


def student_tokens(cfg: SweepConfig) -> int:
    x = cfg.distill
    return x.steps * x.batch_size * x.grad_accum * x.workers * x.seq_len


def stage2_flops(
    cfg: SweepConfig, m: Models, targets: str, teacher: Shape | None = None, reports: float | None = None
) -> float:
    """One student's distillation: its training tokens and validations (the first, then one per report);
    `reports`: stopped by ASHA after that many (None: the whole budget)."""
    x = cfg.distill
    teacher = teacher or m.teacher
    student = forward_flops(m.student, x.seq_len)
    if targets == ONLINE:
        side = forward_flops(teacher, x.seq_len)
    elif targets == HIDDEN:
        side = head_flops(teacher)
    else:
        side = 0.0
    full = student_reports(cfg)
    reports = full if reports is None else reports
    train = trained(cfg, reports) * student_tokens(cfg) * (RECOMPUTE[x.checkpointing] * student + side)
    return train + (1 + reports) * (x.eval_max_tokens or 0) * (student + side)


#: the student's forward and backward in forwards, by distill.checkpointing: full runs every layer's forward again;
#: selective recomputes elementwise ops only (no matmul twice: FLOPs as none's); auto is decided before any bill
RECOMPUTE = {"none": 3.0, "selective": 3.0, "full": 4.0, "auto": 3.0}


def trained(cfg: SweepConfig, reports: float) -> float:
    """The share of its budget a student stopped after `reports` trains (it sees the stop at its next poll)."""
    x = cfg.distill
    return min(1.0, (reports * x.eval_every + (x.stop_poll if reports < student_reports(cfg) else 0)) / x.steps)


def student_reports(cfg: SweepConfig) -> int:
    """A student's reports (validations after the first): every eval_every steps and at the end (ASHA's max_t)."""
    return math.ceil(cfg.distill.steps / cfg.distill.eval_every)


# ---- ASHA in stage 2 ----------------------------------------------------------------------------
def asha_rungs(reports: int, grace: int, rf: float) -> list[float]:
    """The reports after which Ray's ASHA may stop a student: its bracket's milestones grace x rf^k, as many as
    tune's _Bracket makes, below max_t = `reports` (a report at max_t is the student's last anyway)."""
    if grace <= 0 or rf <= 1 or reports <= grace:
        return []
    count = int(math.log(reports / grace) / math.log(rf) + 1)
    return [grace * rf**k for k in range(count) if grace * rf**k < reports]


ASHA_RUNS = 200  # stage 2s simulated for the expected ends (fixed seed: the same plan every time)


def asha_ends(cfg: SweepConfig, n: int, lanes: int | None = None) -> list[tuple[float, int]]:
    """[(reports, students that end after them)] of stage 2's `n` students, `lanes` at once: where ASHA
    (stage2.asha) stops them, the last entry the students that finish; [(reports, n)] without ASHA.

    Expected over ASHA_RUNS stage 2s of students of normally distributed quality in random order, each keeping
    its loss at every report (loss curves that do not cross: the dearest case, as a student's loss early says
    much about it later), rounded to whole students. benchmarks/perf/asha_bill.py holds it to Ray's own scheduler."""
    full, s2 = student_reports(cfg), cfg.stage2
    rungs = asha_rungs(full, min(s2.grace_evals, full), s2.reduction_factor) if s2.asha else []
    if not rungs or n < 2:
        return [(full, n)]
    rng, seen = random.Random(0), Counter()
    for _ in range(ASHA_RUNS):
        seen.update(_asha_run([rng.gauss(0, 1) for _ in range(n)], full, rungs, s2.reduction_factor, lanes or n))
    counts = {r: k / ASHA_RUNS for r, k in seen.items()}
    whole = {r: math.floor(k) for r, k in counts.items()}  # largest remainders: whole students, n in all
    for r in sorted(counts, key=lambda r: whole[r] - counts[r])[: n - sum(whole.values())]:
        whole[r] += 1
    return [(r, whole[r]) for r in sorted(whole) if whole[r]]


def _asha_run(loss: list[float], full: int, rungs: list[float], rf: float, lanes: int) -> Counter:
    """{reports: students that ended after them} of one stage 2 under tune's ASHA rule: at the first report at
    or past a rung, a student is stopped when its loss is worse than numpy's interpolated (1 - 1/rf) quantile
    (of the rewards, -loss) of the students recorded there before it; one report a unit of time, `lanes` at
    once, a stopped or finished student's lane going to the next."""
    recorded: dict[float, dict[int, float]] = {m: {} for m in rungs}
    ends, running, started = Counter(), [], min(lanes, len(loss))
    for i in range(started):
        heapq.heappush(running, (1, i))
    reports = [0] * len(loss)
    while running:
        t, i = heapq.heappop(running)
        reports[i] += 1
        r = reports[i]
        stop = r >= full  # max_t: its last report
        rung = None if stop else next((m for m in reversed(rungs) if r >= m and i not in recorded[m]), None)
        if rung is not None:
            seen = sorted(recorded[rung].values())
            if seen:
                q = (1 - 1 / rf) * (len(seen) - 1)
                lo = math.floor(q)
                cutoff = seen[lo] + (seen[min(lo + 1, len(seen) - 1)] - seen[lo]) * (q - lo)
                stop = -loss[i] < cutoff
            recorded[rung][i] = -loss[i]
        if stop:
            ends[r] += 1
            if started < len(loss):
                heapq.heappush(running, (t + 1, started))
                started += 1
        else:
            heapq.heappush(running, (t + 1, i))
    return ends


# ---- time and money -----------------------------------------------------------------------------
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
        seconds=_sum([first.seconds, stage.seconds]),
        gpu_hours=_sum([first.gpu_hours, stage.gpu_hours]),
        dollars=_sum([first.dollars, stage.dollars]),
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
        _sum(p.gpu_hours for p in parts),
        _sum(p.dollars for p in parts),
        sum(p.units for p in parts),
        sum(p.lanes for p in parts),
        " + ".join(p.device for p in parts),
        " + ".join(dict.fromkeys(filter(None, (p.node for p in parts)))) or None,
        _sum(p.node_hours for p in parts),
        sum(p.io_bound for p in parts),
    )
