"""The bill as a table: what each stage costs (`StageCost`: FLOPs, wall time, GPU-hours, dollars) and the run's
(`RunCost`: the sum, the budget check, the rows `m2d plan` prints); plan/cost.py prices the stages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
        return add(s.seconds for s in self.stages)

    @property
    def gpu_hours(self) -> float | None:
        return add(s.gpu_hours for s in self.stages)

    @property
    def dollars(self) -> float | None:
        return add([*(s.dollars for s in self.stages), self.head_dollars or 0.0, self.storage_dollars])

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
            asha = f" if ASHA stops no student (expected {usd(self.dollars)})" if self.bound else ""
            return (
                f"the run would cost {'up to ' if self.bound else ''}{usd(most.dollars)}{asha} (most in {top.name}: "
                f"{usd(top.dollars)}, "
                f"{num(top.gpu_hours)} GPU-hours) but plan.max_dollars is {usd(max_dollars)}; give a smaller grid, "
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
                    num(s.gpu_hours),
                    usd(s.dollars),
                )
            )
        if self.head_dollars is not None:
            rows.append(("head node", "", "", "the whole run", "", "", "", usd(self.head_dollars)))
        if self.storage_dollars:
            rows.append(("storage", "", "", "the whole run", "", "", "", usd(self.storage_dollars)))
        rows.append(
            (
                "total",
                "",
                "",
                "",
                f"{sum(s.flops for s in self.stages):.3g}",
                duration(self.seconds),
                num(self.gpu_hours),
                usd(self.dollars),
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
                f"{num(self.bound.gpu_hours)} GPU-hours, {usd(self.bound.dollars)}",
            ]
        return "\n".join(lines)


def add(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else float(sum(values))


def num(v: float | None) -> str:
    return "?" if v is None else f"{v:,.3g}" if v < 1000 else f"{v:,.0f}"


def usd(v: float | None) -> str:
    return "?" if v is None else f"${v:,.2f}" if v < 1000 else f"${v:,.0f}"


def duration(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"
