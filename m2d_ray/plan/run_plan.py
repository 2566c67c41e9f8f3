"""The plan of a run: every stage's bytes per device, its devices and Ray request, and the storage it writes.

`make_plan(cfg, teacher_config, devices)` reads configs only. A stage "fits" when one unit of it (a
calibration actor, a stage-1 trial, a stage-2 rank, a stage-3 model) fits the device share it asks for;
`first_problem` is the one line `m2d plan` and `m2d run` print when something does not fit or no node type
can ever hold a stage's request, with what to change.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from m2d_ray.config import SweepConfig
from m2d_ray.errors import M2DError
from m2d_ray.plan import memory
from m2d_ray.plan.cost import RunCost, d2d_teacher, estimate
from m2d_ray.plan.devices import NodeType, bundle, holders, smallest_gpu
from m2d_ray.sizes import gib
from m2d_ray.plan.shapes import Models, Shape, models_of, shape_of

HEADROOM = 0.95  # of a device's memory a plan may fill (allocator fragmentation)
GPU_RESERVE = 1 << 30  # CUDA context and allocator slack (evaluate/placement.RESERVE)
#: the config keys of each stage's Ray request
KEYS = {"calibrate": "ray.data_gpus_per_actor / ray.data_accelerator", "targets": "ray.data_gpus_per_actor / ray.data_accelerator",
        "stage1": "ray.gpus_per_trial / ray.cpus_per_trial / ray.trial_accelerator",
        "stage2": "distill.gpus_per_worker / distill.cpus_per_worker / distill.accelerator",
        "stage3": "stage3.gpus_per_task / stage3.cpus_per_task / stage3.accelerator"}


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
        return {"gpu_memory": self.gpu_memory, "models": self.models,
                "stages": {k: {"per_gpu_bytes": s.per_device, "gpus": int(s.gpus) if float(s.gpus).is_integer() else s.gpus, "fits": False if not s.feasible else s.fits,
                               "unit": s.unit, "parts": s.parts, "request": s.request, "capacity": s.capacity, **_bill(bill.get(k))}
                           for k, s in self.by_stage().items()},
                "cost": self.cost.to_json() if self.cost else None,
                "storage_bytes": memory.total(self.storage), "storage": self.storage,
                "storage_peak_bytes": memory.total(self.storage) + memory.total(self.storage_peak), "storage_peak": self.storage_peak}

    def problems(self) -> list[str]:
        """One line per stage that cannot run: a request no node type holds, or memory that does not fit."""
        out = []
        for s in self.stages:
            req = ", ".join(f"{k} {v:g}" for k, v in s.request.items() if v)
            if not s.feasible:
                out.append(f"{s.name}: no node type can ever hold one {s.unit} ({req}; node types: {s.nodes}); change {s.keys} "
                           "or add a node type that has it")
            elif s.fits is False:
                where = f"{s.share:g} GPU of {gib(s.capacity / HEADROOM / min(1.0, s.share))}" if s.share else "this host"
                out.append(f"{s.name}: one {s.unit} needs {gib(s.per_device)} ({_top(s.parts)}) but {where} gives it "
                           f"{gib(s.capacity)}; {s.fix}")
        budget = self.cost.over_budget(self.max_dollars) if self.cost else None
        return out + ([budget] if budget else [])

    def table(self) -> str:
        rows = [("stage", "unit", "per device", "GPUs", "fits", "largest parts")]
        for s in self.stages:
            fits = "?" if s.fits is None else ("yes" if s.fits else "NO")
            fits += "" if s.feasible else " (no node type)"
            device = (f"{s.units} GPUs, sharded" if s.name.startswith("stage3") and s.units > 1 else f"{s.share:g} GPU") if s.share else "CPU"
            rows.append((s.name, f"{s.unit} ({device})", gib(s.per_device), f"{s.gpus:g}", fits, _top(s.parts, 4)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
        lines.append(f"storage written: {gib(memory.total(self.storage))} stays ({_top(self.storage, 6)})")
        if self.storage_peak:
            lines.append(f"  peak while students train: {gib(memory.total(self.storage) + memory.total(self.storage_peak))} "
                         f"({_top(self.storage_peak)}; an ended student's training state is removed: stage2.keep_training_state)")
        if self.cost:
            lines += ["", "the bill (plan/cost.py: FLOPs / (peak x plan.efficiency, plan.cpu_efficiency on CPUs) + start-up; dollars: node-hours with the idle tail):",
                      *self.cost.table().splitlines()]
        return "\n".join(lines)


def _bill(c) -> dict:
    """A stage's FLOPs, seconds, GPU-hours and dollars for its JSON entry."""
    return {} if c is None else {"flops": c.flops, "seconds": c.seconds, "gpu_hours": c.gpu_hours, "dollars": c.dollars}


def _tightness(s: StagePlan) -> float:
    if not s.feasible:
        return math.inf
    return s.per_device / s.capacity if s.capacity else s.per_device / 1e30


def _top(parts: dict, n: int = 3) -> str:
    return ", ".join(f"{k} {gib(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:n] if v)


# ---- the stages -------------------------------------------------------------------------------
def make_plan(cfg: SweepConfig, teacher_config, devices: Devices = Devices(), stage3_models: dict | None = None) -> RunPlan:
    """The plan of `cfg` for the teacher of `teacher_config`. `stage3_models`: extra {key: config} that stage 3
    evaluates besides the student and the teacher (the d2d baseline's dense teacher)."""
    from m2d_ray.distill.targets import bytes_per_token, state_bytes

    m = models_of(teacher_config)
    spec = cfg.target_spec()
    per_token = bytes_per_token(spec, state_bytes(m.teacher.hidden, cfg.ray.data_gpus_per_actor > 0)) if spec else 0
    stages = [_calibrate(cfg, m.teacher, devices), _stage1(cfg, m.student, devices)]
    if spec:
        stages.append(_targets(cfg, m.teacher, devices, per_token, logits=not spec.exact))
    stages.append(_stage2(cfg, m, devices, spec.mode if spec else "online", per_token))
    stages += _stage3(cfg, m, devices, stage3_models or {})
    at_once = _students_at_once(cfg, devices)
    extra = {k: shape_of(c) for k, c in (stage3_models or {}).items()}
    dense = d2d_teacher(cfg, m.teacher, extra) if spec else None  # with cached targets, the d2d baseline's teacher's states too
    dense_per_token = bytes_per_token(spec, state_bytes(dense.hidden, cfg.ray.data_gpus_per_actor > 0)) if dense else 0
    stays, peak = _storage(cfg, m, per_token + dense_per_token, at_once)
    cost = estimate(cfg, m, {s.name: s for s in stages}, devices.nodes, devices.head, devices.idle_minutes, spec.mode if spec else "online",
                    extra, at_once, devices.cpu_load)
    return RunPlan(tuple(stages), stays, devices.gpu_memory, {"teacher_params": m.teacher.params, "student_params": m.student.params}, peak,
                   cost, cfg.plan.max_dollars)


def _unit(name: str, unit: str, parts: dict, share: float, units: int, request: dict, devices: Devices, fix: str,
          pinned_memory: int | None = None) -> StagePlan:
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
    return StagePlan(name, unit, parts, share, units, request, capacity, fix, tuple(n.name for n in found) if found is not None else None,
                     KEYS[name.split(":")[0]], nodes)


def _teacher_pass(name: str, cfg: SweepConfig, d: Devices, parts_of) -> StagePlan:
    """A Ray Data actor holding the teacher (calibration, the targets pass): whole, or streamed a layer at a
    time when calib.stream says so or, left unset, when the whole teacher does not fit (what the actor does)."""
    c, r = cfg.calib, cfg.ray
    share = r.data_gpus_per_actor
    request = bundle(1, share, r.data_accelerator)
    smaller = "a smaller calib.batch_size or a larger GPU"
    plan = _unit(name, "actor", parts_of(bool(c.stream)), share, r.data_actors, request, d,
                 smaller if c.stream else "calib.stream=true (the teacher one layer at a time) or a larger GPU")
    if c.stream is None and plan.fits is False:
        plan = _unit(name, "actor (streamed)", parts_of(True), share, r.data_actors, request, d, smaller)
    return plan


def _calibrate(cfg: SweepConfig, t: Shape, d: Devices) -> StagePlan:
    c, gpu = cfg.calib, cfg.ray.data_gpus_per_actor > 0
    return _teacher_pass("calibrate", cfg, d, lambda streamed: memory.calibration(t, c.batch_size, c.seq_len, t.dtype_bytes, streamed, gpu))


def _stage1(cfg: SweepConfig, s: Shape, d: Devices) -> StagePlan:
    r, e = cfg.ray, cfg.eval
    return _unit("stage1", "trial", memory.trial(s, e.batch_size, e.seq_len, s.dtype_bytes), r.gpus_per_trial, r.max_concurrent_trials,
                 bundle(r.cpus_per_trial, r.gpus_per_trial, r.trial_accelerator), d,
                 "a larger ray.gpus_per_trial, a smaller eval.batch_size or a larger GPU")


def _targets(cfg: SweepConfig, t: Shape, d: Devices, per_token: int, logits: bool) -> StagePlan:
    c, seq = cfg.calib, cfg.distill.seq_len
    return _teacher_pass("targets", cfg, d, lambda streamed: memory.targets_pass(t, c.batch_size, seq, t.dtype_bytes, streamed, per_token, logits))


def _stage2(cfg: SweepConfig, m: Models, d: Devices, targets: str, per_token: int) -> StagePlan:
    x = cfg.distill
    share = x.gpus_per_worker
    b = 2 if share > 0 else 4  # bf16 on a GPU, fp32 on CPU (distill/loop.py)
    T = x.batch_size * x.seq_len
    parts = memory.student_rank(m.student, m.teacher, T, b, x.workers, x.deepspeed, x.zero_stage, x.gradient_checkpointing, x.loss_chunk,
                                targets, per_token)
    return _unit("stage2", "rank", parts, share, x.workers, bundle(x.cpus_per_worker, share, x.accelerator), d, _stage2_fix(cfg, parts))


def _stage2_fix(cfg: SweepConfig, parts: dict) -> str:
    x = cfg.distill
    big = max(parts, key=parts.get)
    if big == "teacher":
        return "stage2.targets=hidden (the teacher's final hidden states cached once: a rank holds its output head only, the loss stays exact)"
    if big == "activations" and not x.gradient_checkpointing:
        return "distill.gradient_checkpointing=true"
    if big in ("optimizer", "grads") and x.workers < 8:
        return f"more distill.workers (ZeRO-2 shards the optimizer over them; now {x.workers})"
    return f"a smaller distill.batch_size (now {x.batch_size}; raise distill.grad_accum to keep the tokens per step) or a larger GPU"


def _stage3(cfg: SweepConfig, m: Models, d: Devices, extra: dict) -> list[StagePlan]:
    from m2d_ray.sizes import parse_size
    from m2d_ray.evaluate.placement import model_size, plan_eval
    from m2d_ray.evaluate.runner import max_length, parse_batch

    c = cfg.stage3
    gpus = c.gpus_per_task if c.gpus_per_task is not None else float(cfg.uses_gpus())
    models = {"student": m.student_config, **({"teacher": m.teacher_config} if c.teacher else {}), **extra}
    out = []
    request = bundle(c.cpus_per_task, min(gpus, 1), c.accelerator)
    found = holders(list(d.nodes), request) if d.nodes is not None and gpus > 0 else None
    mem = d.gpu_memory or (smallest_gpu(found) if found else None) or parse_size(c.gpu_memory)  # (checked at config load)
    per_node = d.gpus_per_node or c.gpus_per_node or max((int(n.gpus) for n in (found or [])), default=8)
    for key, config in models.items():
        size = model_size(config)
        seq = max_length(config, c.max_length)
        name = f"stage3:{key}"
        if gpus <= 0 or mem is None:
            p = plan_eval(size, None, 0, parse_batch(c.batch_size), max_length=seq, host_bytes=d.host_memory if gpus <= 0 else None)
            parts = {"weights": p.weights, "batch": p.max_batch_size * p.sequence if c.batch_size == "auto" else p.batch_size * p.sequence}
            out.append(_unit(name, key, parts, gpus if gpus > 0 else 0, 1, bundle(c.cpus_per_task, gpus, c.accelerator), d,
                             "a smaller stage3.batch_size or stage3.max_length"))
            continue
        try:
            p = plan_eval(size, mem, per_node, parse_batch(c.batch_size), gpu_fraction=gpus if gpus < 1 else None, max_length=seq, what=key)
        except M2DError:  # on no number of a node's GPUs: what it would need on all of them
            parts = {"weights": int(size.weights / per_node * (1.05 if per_node > 1 else 1)), "batch": size.sequence_bytes(seq)}
            out.append(_unit(name, f"{key}, sharded over {per_node}" if per_node > 1 else key, parts, 1, per_node,
                             bundle(c.cpus_per_task, per_node, c.accelerator), d, "nodes with more or larger GPUs, or a shorter stage3.max_length",
                             pinned_memory=mem))
            continue
        g = max(p.gpus, gpus) if gpus >= 1 else p.gpus
        per_gpu = (p.max_memory_per_gpu or p.weights) + (p.max_batch_size if p.batch_size == "auto" else p.batch_size) * p.sequence
        share = g if g < 1 else 1
        plan = _unit(name, key, {"weights": p.max_memory_per_gpu or p.weights, "batch": per_gpu - (p.max_memory_per_gpu or p.weights)},
                     share, int(max(1, g)), bundle(c.cpus_per_task, g, c.accelerator), d, "nodes with more or larger GPUs, or a shorter stage3.max_length",
                     pinned_memory=mem)
        out.append(plan)
    return out


# ---- storage ------------------------------------------------------------------------------------
def _students_at_once(cfg: SweepConfig, d: Devices) -> int | None:
    """The most students training at once: `SweepConfig.students_at_once`, bounded on GPUs by what the node types'
    max_workers can hold (None: unbounded, or unknown)."""
    x, n = cfg.distill, cfg.students_at_once()
    if x.gpus_per_worker <= 0 or d.nodes is None:
        return n
    types = holders(list(d.nodes), bundle(x.cpus_per_worker, x.gpus_per_worker, x.accelerator))
    if not types or any(t.max_workers is None for t in types):
        return n
    room = sum(t.max_workers * int(t.gpus // (x.workers * x.gpus_per_worker)) for t in types)
    return min(n, room) if n else room


def _storage(cfg: SweepConfig, m: Models, per_token: int, at_once: int | None) -> tuple[dict, dict]:
    """(what the run leaves: statistics, students (initial and distilled), token shards, targets (`per_token`: of every
    teacher, the d2d baseline's dense one too), and the students'
    Train checkpoints with stage2.keep_training_state; the most held besides while students train: the
    checkpoints of the students `at_once` (all of them when None))."""
    x = cfg.distill
    t, s = m.teacher, m.student
    b_train = 2 if x.gpus_per_worker > 0 else 4
    pairs = len(cfg.stage2.pairs) or len(cfg.grid.scoring) * len(cfg.grid.grouping)
    n = pairs + len(cfg.stage2.baselines)
    blocks = x.steps * x.batch_size * x.grad_accum * x.workers
    optimizer = (12 if b_train < 4 else 8) * s.params if x.deepspeed else 2 * s.params * b_train
    per_student = x.keep_checkpoints * (s.params * b_train + optimizer)
    out = {"statistics": t.layers * (t.experts ** 2 + 4 * t.experts + 2) * 8,
           "initial students": n * s.params * s.dtype_bytes, "distilled students": n * s.params * b_train,
           "token shards": blocks * x.seq_len * 4 + (x.eval_max_tokens or 0) * 4}
    if per_token:
        out["targets"] = blocks * x.seq_len * per_token
    if cfg.stage2.keep_training_state:
        return {**out, "checkpoints": n * per_student}, {}
    return out, {"checkpoints": min(n, at_once or n) * per_student}


def plan_line(plan: RunPlan) -> str:
    """The JSON line `m2d plan` prints last."""
    import json

    j = plan.to_json()
    keys = ("per_gpu_bytes", "gpus", "fits", "flops", "seconds", "gpu_hours", "dollars")
    total = plan.cost.totals() if plan.cost else {}
    if plan.cost and plan.cost.bound:  # ASHA on: the most the run can cost, with no student stopped early
        total["bound"] = plan.cost.bound.totals()
    return json.dumps({"gpu_memory": j["gpu_memory"], "stages": {k: {kk: v[kk] for kk in keys if kk in v} for k, v in j["stages"].items()},
                       "storage_bytes": j["storage_bytes"], "storage_peak_bytes": j["storage_peak_bytes"], **total})


def as_record(plan: RunPlan) -> dict:
    """The whole plan as JSON (the run directory's plan file)."""
    return {**plan.to_json(), "rows": [{**asdict(s), "per_device": s.per_device, "fits": s.fits} for s in plan.stages]}
