"""The plan of a run: every stage's bytes per device, its devices and Ray request, the storage it writes and
its bill, from configs and shapes alone (no weights, no Ray).

Each stage computes its own rows (`Stage.needs`, `storage`, `cost` in its module under stages/) from a
`Planning` (the config, the shapes, the devices) with the helpers here; `pipeline.plan_run` gathers them into
a `RunPlan`. A stage "fits" when one unit of it (a calibration actor, a stage-1 trial, a stage-2 rank, a
stage-3 model) fits the device share it asks for; `RunPlan.problems` gives the lines `m2d plan` and `m2d run`
refuse a run with, each with what to change.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property

from m2d_ray.accelerators import GPU_MEMORY, GPU_PEAK_BF16
from m2d_ray.config import SweepConfig
from m2d_ray.plan import memory
from m2d_ray.plan.asha import asha_ends
from m2d_ray.plan.bill import RunCost, StageCost
from m2d_ray.plan.cost import Host, Place, place, stage_cost
from m2d_ray.plan.devices import NodeType, bundle, holders, pin_fix, smallest_gpu
from m2d_ray.plan.shapes import Models, Shape
from m2d_ray.plan.targets import TeacherTargets, configured, per_token, storage_kind
from m2d_ray.sizes import gib

HEADROOM = 0.95  # of a device's memory a plan may fill (allocator fragmentation)
GPU_RESERVE = 1 << 30  # CUDA context and allocator slack (evaluate/placement.RESERVE)
#: the GPU-type keys the plan places a stage by when the user leaves them unset (pipeline.decide_placement)
PLACEABLE = ("ray.data_accelerator", "distill.accelerator", "stage3.accelerator")


@dataclass(frozen=True)
class Devices:
    """What the plan is checked against: one GPU's memory (None = from the node types, else unknown), the
    most GPUs of a node, the node types (None = not checked), and one host's memory for CPU stages."""

    gpu_memory: int | None = None
    gpus_per_node: int | None = None
    nodes: tuple[NodeType, ...] | None = None
    host_memory: int | None = None
    head: str | None = None  # the head node type (priced for the whole run)
    idle_minutes: float = 0.0  # the autoscaler's idle_timeout_minutes (every node's tail after its work)
    cpu_load: float = 0.0  # others' runnable processes on this machine (a local run's CPU stages share its cores)


@dataclass(frozen=True)
class StagePlan:
    name: str
    unit: str  # what one device share holds: "actor", "trial", "rank", a stage-3 model's key
    parts: dict
    share: float  # GPUs of one unit (0 = CPU)
    units: int  # units at once (actors, concurrent trials, ranks of a student)
    request: dict  # Ray resources of one unit
    capacity: int | None  # bytes one unit may use (None = unknown)
    fix: str  # what to change when it does not fit
    holders: tuple[str, ...] | None = None  # node types that can hold the request (None = not checked)
    keys: str = ""  # the config keys of the request
    nodes: str = ""  # the node types checked against, described

    @property
    def per_device(self) -> int:
        return memory.total(self.parts)

    @property
    def gpus(self) -> float:
        n = self.units * self.share
        return math.ceil(n) if n >= 1 else n

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.per_device <= self.capacity

    @property
    def feasible(self) -> bool:
        return self.holders is None or bool(self.holders)


@dataclass(frozen=True)
class RunPlan:
    stages: tuple[StagePlan, ...]
    storage: dict  # what the run leaves in its storage
    gpu_memory: int | None
    models: dict = field(default_factory=dict)  # teacher / student parameter counts
    storage_peak: dict = field(default_factory=dict)  # besides `storage`, the most held at once while students train
    cost: RunCost | None = None  # FLOPs, time, GPU-hours and dollars of every stage (plan/cost.py)
    max_dollars: float | None = None
    targets: dict[str, TeacherTargets] = field(default_factory=dict)  # each stage-2 teacher's (plan/targets.py)
    max_storage: int | None = None  # plan.max_storage in bytes
    refusals: tuple[str, ...] = ()  # lines of the plan's own choices that cannot run (auto: no exact mode fits)
    notes: tuple[str, ...] = ()  # what the plan assumed, said below the table
    decided: dict[str, str] = field(default_factory=dict)  # config key -> the value the plan decided for its auto

    def decision_lines(self) -> list[str]:
        """The notes that say what the plan decided for an auto setting, and why."""
        return [n for n in self.notes if n.partition("=")[0] in self.decided]

    def overrides(self) -> list[str]:
        """The plan's decisions as key=value overrides: what a run applies to its config (and so records in it)."""
        return [f"{k}={v}" for k, v in self.decided.items()]

    def by_stage(self) -> dict[str, StagePlan]:
        """One entry per stage: the unit that fits worst (stage 3 plans each model)."""
        out: dict[str, StagePlan] = {}
        for s in self.stages:
            key = s.name.split(":")[0]
            cur = out.get(key)
            if cur is None or _tightness(s) > _tightness(cur):
                out[key] = s
        return out

    def to_json(self) -> dict:
        bill = self.cost.by_name() if self.cost else {}
        return {
            "gpu_memory": self.gpu_memory,
            "models": self.models,
            "stages": {
                k: {
                    "per_gpu_bytes": s.per_device,
                    "gpus": int(s.gpus) if float(s.gpus).is_integer() else s.gpus,
                    "fits": False if not s.feasible else s.fits,
                    "unit": s.unit,
                    "parts": s.parts,
                    "request": s.request,
                    "capacity": s.capacity,
                    **_bill(bill.get(k)),
                }
                for k, s in self.by_stage().items()
            },
            "cost": self.cost.to_json() if self.cost else None,
            "storage_bytes": memory.total(self.storage),
            "storage": self.storage,
            "storage_peak_bytes": self.storage_peak_bytes,
            "storage_peak": self.storage_peak,
            "targets": {k: t.to_json() for k, t in self.targets.items()},
        }

    @property
    def storage_peak_bytes(self) -> int:
        return memory.total(self.storage) + memory.total(self.storage_peak)

    def problems(self) -> list[str]:
        """One line per stage that cannot run: a request no node type holds, or memory that does not fit."""
        out = []
        for s in self.stages:
            req = ", ".join(f"{k} {v:g}" for k, v in s.request.items() if v)
            if not s.feasible:
                out.append(
                    f"{s.name}: no node type can ever hold one {s.unit} ({req}; node types: {s.nodes}); change "
                    f"{s.keys} "
                    "or add a node type that has it"
                )
            elif s.fits is False:
                where = (
                    f"{s.share:g} GPU of {gib(s.capacity / HEADROOM / min(1.0, s.share))}" if s.share else "this host"
                )
                out.append(
                    f"{s.name}: one {s.unit} needs {gib(s.per_device)} ({_top(s.parts)}) but {where} gives it "
                    f"{gib(s.capacity)}; {s.fix}"
                )
        budget = self.cost.over_budget(self.max_dollars) if self.cost else None
        return (
            out + list(self.refusals) + ([budget] if budget else []) + ([full] if (full := self.over_storage()) else [])
        )

    def over_storage(self) -> str | None:
        """The line a run whose storage (at its peak) exceeds plan.max_storage is refused with: what fills it and the
        setting that avoids it."""
        if self.max_storage is None or self.storage_peak_bytes <= self.max_storage:
            return None
        parts = {**self.storage, **self.storage_peak}
        big = max(parts, key=parts.get)
        avoid = {
            "targets": "stage2.targets=online with stage2.shard_teacher=true (or auto) stores no teacher states",
            "checkpoints": "stage2.keep_training_state=false"
            if big in self.storage
            else "fewer students at once (stage2.max_concurrent_trials)",
            "token shards": "fewer distill.steps",
        }.get(big, "fewer students (stage2.pairs or stage2.recipes)")
        return (
            f"the run would store {gib(self.storage_peak_bytes)} (most: {big} {gib(parts[big])}) but plan.max_storage "
            f"is {gib(self.max_storage)}; {avoid}, or raise plan.max_storage"
        )

    def targets_lines(self) -> list[str]:
        """Each stage-2 teacher's targets, one line each (with why, when the plan chose them)."""
        return [_targets_line(k, t) for k, t in self.targets.items()]

    def table(self) -> str:
        rows = [("stage", "unit", "per device", "GPUs", "fits", "largest parts")]
        for s in self.stages:
            fits = "?" if s.fits is None else ("yes" if s.fits else "NO")
            fits += "" if s.feasible else " (no node type)"
            device = (
                (f"{s.units} GPUs, sharded" if s.name.startswith("stage3") and s.units > 1 else f"{s.share:g} GPU")
                if s.share
                else "CPU"
            )
            rows.append((s.name, f"{s.unit} ({device})", gib(s.per_device), f"{s.gpus:g}", fits, _top(s.parts, 4)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
        lines += [f"stage-2 targets of {t}" for t in self.targets_lines()] + list(self.notes)
        lines.append(f"storage written: {gib(memory.total(self.storage))} stays ({_top(self.storage, 6)})")
        if self.storage_peak:
            lines.append(
                f"  peak while students train: {gib(memory.total(self.storage) + memory.total(self.storage_peak))} "
                f"({_top(self.storage_peak)}; an ended student's training state is removed: stage2.keep_training_state)"
            )
        if self.cost:
            lines += [
                "",
                "the bill (plan/cost.py: FLOPs / (peak x plan.efficiency, plan.cpu_efficiency on CPUs) + start-up; "
                "dollars: node-hours with the idle tail):",
                *self.cost.table().splitlines(),
            ]
        return "\n".join(lines)


def _targets_line(key: str, t: TeacherTargets) -> str:
    return f"{key}: {t.label}" + (f" ({t.why})" if t.why else "")


def _bill(c) -> dict:
    """A stage's FLOPs, seconds, GPU-hours and dollars for its JSON entry."""
    return {} if c is None else {"flops": c.flops, "seconds": c.seconds, "gpu_hours": c.gpu_hours, "dollars": c.dollars}


def _tightness(s: StagePlan) -> float:
    if not s.feasible:
        return math.inf
    return s.per_device / s.capacity if s.capacity else s.per_device / 1e30


def _top(parts: dict, n: int = 3) -> str:
    return ", ".join(f"{k} {gib(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:n] if v)


# ---- what a stage's needs and cost read ------------------------------------------------------------
@dataclass(frozen=True)
class Planning:
    """What a stage's `needs` and `storage` read: the config, the teacher's and student's shapes, the devices,
    and the teachers the baselines bring (their shapes and configs, by stage 3's key: `teacher-<baseline>`)."""

    cfg: SweepConfig
    models: Models
    devices: Devices = field(default_factory=lambda: Devices())
    teachers: dict[str, Shape] = field(default_factory=dict)
    teacher_configs: dict[str, object] = field(default_factory=dict)
    targets: dict[str, TeacherTargets] = field(default_factory=dict)  # by teacher key (plan/targets.py)

    def choice(self, key: str) -> TeacherTargets:
        """How teacher `key` gives its students their targets: the plan's choice (auto), else the config's."""
        return self.targets[key] if key in self.targets else configured(self.cfg, [key])[key]

    def per_token(self, teacher: Shape, key: str) -> int:
        """Bytes a token's cached targets of teacher `key` (shaped `teacher`) take (0 online)."""
        return per_token(self.choice(key), teacher, self.cfg)

    @property
    def storage_kind(self) -> str:
        return storage_kind(self.cfg.storage)

    @cached_property
    def pairs(self) -> int:
        """Promoted students stage 2 distils: the recipes named, else the (scoring, grouping) pairs named, else every
        pair of the grid."""
        g, s2 = self.cfg.grid, self.cfg.stage2
        return len(s2.recipes) or len(s2.pairs) or len(g.scoring) * len(g.grouping)

    @cached_property
    def students_at_once(self) -> int | None:
        """The most students training at once: `SweepConfig.students_at_once`, bounded on GPUs by what the node
        types' max_workers can hold (None: unbounded, or unknown)."""
        x, n, d = self.cfg.distill, self.cfg.students_at_once(), self.devices
        if x.gpus_per_worker <= 0 or d.nodes is None:
            return n
        types = holders(list(d.nodes), bundle(x.cpus_per_worker, x.gpus_per_worker, x.accelerator))
        if not types or any(t.max_workers is None for t in types):
            return n
        room = sum(t.max_workers * int(t.gpus // (x.workers * x.gpus_per_worker)) for t in types)
        return min(n, room) if n else room

    @cached_property
    def ends(self) -> list[tuple[float, int]]:
        """Where ASHA is expected to stop stage 2's students ([(reports, students)], the last: those that finish)."""
        return asha_ends(self.cfg, self.pairs + len(self.cfg.stage2.baselines), self.students_at_once)


@dataclass(frozen=True)
class Costing:
    """What a stage's `cost` reads besides the `Planning`: every stage's plan (its request and GPUs) and the CPUs
    that CPU stages share (None: no stage runs on CPUs)."""

    p: Planning
    plans: dict[str, StagePlan]
    cpu: Host | None

    def place(
        self, name: str, gpus: float, threads: int, wanted: int, accelerator: str | None, request: dict | None = None
    ) -> Place:
        d = self.p.devices
        if accelerator is None and d.nodes is None and d.gpu_memory:  # --gpu-memory alone: no type to place it on
            accelerator = min(GPU_PEAK_BF16.keys() & GPU_MEMORY.keys(), key=lambda k: abs(GPU_MEMORY[k] - d.gpu_memory))
        return place(
            self.plans[name].request if request is None else request,
            gpus,
            threads,
            wanted,
            self.p.devices.nodes,
            accelerator,
        )

    def stage(
        self,
        name: str,
        flops: list[float],
        where: Place,
        unit: str,
        rounds: int = 1,
        idle: bool = True,
        io_s: list[float] | None = None,
        comm_s: list[float] | None = None,
        work: list[str] | None = None,
    ) -> StageCost:
        """The cost of `flops` units run at `where`, each with the fixed start of a `unit` (actor, trial, student,
        model: plan.*_s, on a GPU plan.gpu_start_s) (`idle`: its nodes wait the autoscaler's idle tail after it;
        `io_s`, `comm_s`: each unit's reads and communication; `work`: what each runs, for plan.efficiency: a
        stage-2 targets mode, default forward; plan/cost.stage_cost)."""
        d, plan = self.p.devices, self.p.cfg.plan
        return stage_cost(
            self.p.cfg,
            name,
            flops,
            where,
            plan.start_s(unit, where.gpus > 0),
            self.cpu,
            plan.prices,
            d.idle_minutes * 60 if idle else 0.0,
            rounds,
            io_s,
            comm_s,
            work,
        )


def unit(
    name: str,
    unit: str,
    parts: dict,
    share: float,
    units: int,
    request: dict,
    devices: Devices,
    fix: str,
    keys: str,
    pinned_memory: int | None = None,
) -> StagePlan:
    """A stage's plan with its capacity: a GPU share of the smallest GPU that may receive it, or a host's
    memory shared by the units running at once on CPU."""
    found = holders(list(devices.nodes), request) if devices.nodes is not None else None
    if share > 0:
        parts = {**parts, "CUDA context": GPU_RESERVE}
        mem = pinned_memory or devices.gpu_memory or (smallest_gpu(found) if found else None)
        capacity = int(min(1.0, share) * mem * HEADROOM) if mem else None
    else:
        capacity = int(devices.host_memory * HEADROOM / max(1, units)) if devices.host_memory else None
    nodes = "; ".join(n.describe() for n in devices.nodes) if devices.nodes is not None else ""
    if found == []:  # the pin alone in the way: say which key, and to what
        keys = pin_fix(request, list(devices.nodes), keys) or keys
    return StagePlan(
        name,
        unit,
        parts,
        share,
        units,
        request,
        capacity,
        fix,
        tuple(n.name for n in found) if found is not None else None,
        keys,
        nodes,
    )


def teacher_pass(name: str, p: Planning, keys: str, parts_of) -> StagePlan:
    """A Ray Data actor holding the teacher (calibration, the targets pass): whole, or streamed a layer at a
    time when calib.stream says so or, left unset, when the whole teacher does not fit (what the actor does)."""
    c, r = p.cfg.calib, p.cfg.ray
    share = r.data_gpus_per_actor
    request = bundle(1, share, r.data_accelerator)
    smaller = "a smaller calib.batch_size or a larger GPU"
    plan = unit(
        name,
        "actor",
        parts_of(bool(c.stream)),
        share,
        r.data_actors,
        request,
        p.devices,
        smaller if c.stream else "calib.stream=true (the teacher one layer at a time) or a larger GPU",
        keys,
    )
    if c.stream is None and plan.fits is False:
        plan = unit(name, "actor (streamed)", parts_of(True), share, r.data_actors, request, p.devices, smaller, keys)
    return plan


def plan_line(plan: RunPlan) -> str:
    """The JSON line `m2d plan` prints last."""

    j = plan.to_json()
    keys = ("per_gpu_bytes", "gpus", "fits", "flops", "seconds", "gpu_hours", "dollars")
    total = plan.cost.totals() if plan.cost else {}
    if plan.cost and plan.cost.bound:  # ASHA on: the most the run can cost, with no student stopped early
        total["bound"] = plan.cost.bound.totals()
    return json.dumps(
        {
            "gpu_memory": j["gpu_memory"],
            "stages": {k: {kk: v[kk] for kk in keys if kk in v} for k, v in j["stages"].items()},
            "storage_bytes": j["storage_bytes"],
            "storage_peak_bytes": j["storage_peak_bytes"],
            "teacher_checkpoint_bytes": j["models"].get("teacher_checkpoint_bytes"),
            "targets": {k: {kk: v[kk] for kk in ("targets", "shard_teacher")} for k, v in j["targets"].items()},
            **total,
        }
    )


def as_record(plan: RunPlan) -> dict:
    """The whole plan as JSON (the run directory's plan file)."""
    return {**plan.to_json(), "rows": [{**asdict(s), "per_device": s.per_device, "fits": s.fits} for s in plan.stages]}
