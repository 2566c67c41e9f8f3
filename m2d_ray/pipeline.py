"""The stages of a run, in order, and what they drive: `m2d run` runs them top to bottom, `m2d plan` adds up what
they need, every command checks what they read before any work, a resumed run checks what they keep, and the
report gathers what they add. Each stage is one module under stages/ (the contract: stages/contract.py).

    calibrate -> stage1 -> targets -> stage2 -> stage3 -> analysis -> report

A new stage is one module and one line in STAGES.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from m2d_ray import shipped
from m2d_ray.accelerators import GPU_MEMORY
from m2d_ray.arch import json_config
from m2d_ray.artifacts import write_json_atomic
from m2d_ray.assets import default_teacher
from m2d_ray.catalog.distill import AUTO, CHECKPOINTING, LOSSES
from m2d_ray.catalog.targets import HIDDEN, ONLINE
from m2d_ray.config import SweepConfig, load_config
from m2d_ray.console import say
from m2d_ray.data import source
from m2d_ray.errors import M2DError
from m2d_ray.plan.bill import RunCost, duration
from m2d_ray.plan.cost import Host, cpu_rate
from m2d_ray.plan.prices import hourly
from m2d_ray.plan.run_plan import PLACEABLE, Costing, Devices, Planning, RunPlan
from m2d_ray.plan.shapes import Shape, models_of, shape_of
from m2d_ray.plan.targets import MOE, TeacherTargets, configured, storage_dollars
from m2d_ray.run_dir import RunDir
from m2d_ray.sizes import gib, parse_size
from m2d_ray.stages import analysis, baselines, calibrate, report, stage1, stage2, stage3, targets
from m2d_ray.stages.contract import Stage
from m2d_ray.stages.students import taught
from m2d_ray.track import Tracker

# Imported inside functions: Ray, and the model loader and checkpoint reader (torch) (`m2d plan` reads this module
# without importing them: a config whose counts are arithmetic is read as JSON).


class Stages:
    """The stages in order, found by name (with the closest names for a typo)."""

    def __init__(self, stages: Iterable[Stage]) -> None:
        self._all = list(stages)

    def __iter__(self) -> Iterator[Stage]:
        return iter(self._all)

    def __getitem__(self, name: str) -> Stage:
        for s in self._all:
            if s.name == name:
                return s
        close = difflib.get_close_matches(name, self.names(), n=1)
        raise M2DError(
            f"unknown stage {name!r};"
            + (f" did you mean {close[0]!r}?" if close else "")
            + f" the stages: {', '.join(self.names())}"
        )

    def names(self) -> list[str]:
        return [s.name for s in self._all]

    def only(self, *names: str) -> Stages:
        """These stages, in the pipeline's order."""
        return Stages(s for s in self._all if s.name in {self[n].name for n in names})

    def with_stage(self, stage: Stage, after: str) -> Stages:
        """The pipeline with `stage` inserted after the stage named `after`."""
        i = self.names().index(self[after].name)
        return Stages([*self._all[: i + 1], stage, *self._all[i + 1 :]])


STAGES = Stages(
    [calibrate.STAGE, stage1.STAGE, targets.STAGE, stage2.STAGE, stage3.STAGE, analysis.STAGE, report.STAGE]
)


def wanted(cfg: SweepConfig, stages: Stages = STAGES) -> list[Stage]:
    return [s for s in stages if s.wanted(cfg)]


# ---- before any work ----------------------------------------------------------------------------
def check_config(cfg: SweepConfig) -> None:
    """Settings that cannot run together, from the config alone: every stage's, whichever stages a command runs (a
    config describes the whole run; `m2d sweep` refuses a misspelt baseline before stage 1, not after it)."""
    for s in wanted(cfg, STAGES):
        s.check_config(cfg)


def check(cfg: SweepConfig, stages: Stages = STAGES, tracking_uri: str | None = None) -> None:
    """Every input the stages will read, checked on the driver before anything is written. The teacher's weights
    are read once, one tensor at a time, for NaN/inf (local checkpoints): workers that load it later need not fail
    one by one. A tracking server named by the user must answer; the storage must read back what is written."""

    from m2d_ray.checkpoint import scan
    from m2d_ray.models import check_teacher

    check_config(cfg)
    teacher = cfg.model or default_teacher()
    check_teacher(teacher)
    for s in wanted(cfg, stages):
        s.check(cfg, teacher)
    if tracking_uri or cfg.mlflow.tracking_uri:
        Tracker(tracking_uri or cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    if cfg.storage:
        from m2d_ray.runtime.run_storage import RunStorage

        RunStorage(cfg.storage).check()
    scan(teacher, "teacher")


def check_resume(rd: RunDir, cfg: SweepConfig, stages: Stages = STAGES, tracking_uri: str | None = None) -> None:
    """A resumed run keeps what its finished stages were computed with, and its inputs are checked again (the corpora
    it read unchanged)."""

    saved = load_config(rd.config).storage
    if cfg.storage != saved:
        raise M2DError(f"{rd} keeps its students and checkpoints in {saved or rd}; resume it without changing storage")
    for s in wanted(cfg, stages):
        s.check_resume(rd, cfg)
    check(cfg, stages, tracking_uri)

    before = json.loads(rd.corpora.read_text()) if rd.corpora.exists() else {}
    for key, fp in corpora(cfg, stages).items():
        if key in before and before[key]["spec"] == fp["spec"]:
            changed = source.changes(before[key], fp)
            if changed:
                raise M2DError(
                    f"{key} {fp['spec']} changed since {rd} started ({changed}); restore it, or start a new run with "
                    "another --out"
                )


def corpora(cfg: SweepConfig, stages: Stages = STAGES) -> dict:
    """Fingerprints of the file corpora the stages read (data spec key -> data.source.fingerprint)."""

    specs = {k: v for s in wanted(cfg, stages) for k, v in s.reads(cfg).items()}
    return {k: source.fingerprint(v) for k, v in specs.items() if source.parse(v).kind == "files"}


def record_corpora(rd: RunDir, cfg: SweepConfig, stages: Stages = STAGES) -> None:
    """Remember the corpora's fingerprints (new keys only: a resume keeps what the run started with)."""
    saved = json.loads(rd.corpora.read_text()) if rd.corpora.exists() else {}
    now = {**corpora(cfg, stages), **saved}
    if now != saved:
        write_json_atomic(rd.corpora, now)


# ---- the plan -----------------------------------------------------------------------------------
def plan_run(
    cfg: SweepConfig,
    devices: Devices = Devices(),
    model: str | None = None,
    stages: Stages = STAGES,
    choices: dict[str, TeacherTargets] | None = None,
) -> RunPlan:
    """The plan of `cfg` (m2d plan, and m2d run before any work): the teacher's config read from `model` (a directory
    with config.json), else the config's model; the baselines' own teachers when their configs can be read here (with
    `model` given, only those in a local directory or shipped: the others' names may be the hub's). `choices`: each
    stage-2 teacher's targets already chosen (a resumed run's), else the config's or, under auto, the plan's choice."""

    check_config(cfg)
    teachers = {b.teacher_key: b.teacher(cfg) for b in baselines.of(cfg) if b.has_teacher}  # each asked once
    own = {
        key: _shape(name)
        for key, name in teachers.items()
        if model is None or Path(name).expanduser().is_dir() or shipped.shape(name)
    }
    pins = _user_pins(cfg, devices)
    return _pins_said(plan(cfg, _shape(model or cfg.model or default_teacher()), devices, own, stages, choices), pins)


def _user_pins(cfg: SweepConfig, devices: Devices) -> list[str]:
    """The GPU-type keys (`PLACED`) the user set, on a cluster of several GPU types (where leaving one unset would
    have the plan place its stages)."""
    kinds = {n.accelerator for n in devices.nodes or () if n.gpus > 0 and n.gpu_memory}
    return [k for k, (_, section, name) in PLACED.items() if getattr(getattr(cfg, section), name) and len(kinds) > 1]


def _pins_said(out: RunPlan, pins: list[str]) -> RunPlan:
    """A GPU type the user pinned stays as given; where a unit of its stages does not fit there, its refusal says
    that leaving the key unset lets the plan place it."""
    said = "or leave {} unset (null: the plan places it on the cheapest GPU type that holds it)"
    rows = tuple(
        replace(r, fix=f"{r.fix}, {said.format(key)}") if key and r.fits is False else r
        for r in out.stages
        for key in [next((k for k in pins if r.name.split(":")[0] in PLACED[k][0]), None)]
    )
    return replace(out, stages=rows) if pins else out


def _shape(model: str):
    """A model's config for the plan: a hub name whose config.json ships with m2d (shipped.shape) is read from that,
    offline; a directory's config.json of a family whose plan is arithmetic as plain JSON (arch/json_config.py: no
    torch imported); anything else as the model loader reads it."""
    where = str(shipped.shape(model) or model)
    if Path(where).expanduser().is_dir() and (config := json_config.read(where)) is not None:
        return config
    from m2d_ray.models import model_config

    return model_config(where)


def plan(
    cfg: SweepConfig,
    teacher_config,
    devices: Devices = Devices(),
    own: dict | None = None,
    stages: Stages = STAGES,
    choices: dict[str, TeacherTargets] | None = None,
) -> RunPlan:
    """Every stage's rows added up, from configs alone: the MoE teacher's, and the baselines' own teachers' (`own`, by
    stage 3's key) where known (else planned at the MoE teacher's shape). Under stage2.targets=auto each stage-2
    teacher's targets are chosen first (`choose_targets`). A stage whose GPU type is not pinned is placed first
    (`decide_placement`)."""
    unplaced = [key for key in PLACED if _placing(cfg, key, devices, stages)]
    if unplaced:
        return decide_placement(cfg, unplaced[0], teacher_config, devices, own, stages, choices)
    if cfg.ray.gpus_per_trial == AUTO:
        return decide_trial_gpus(cfg, teacher_config, devices, own, stages, choices)
    if cfg.distill.zero_stage == AUTO:
        return decide_zero(cfg, teacher_config, devices, own, stages, choices)
    if cfg.distill.checkpointing == AUTO:
        return decide_checkpointing(cfg, teacher_config, devices, own, stages, choices)
    own = own or {}
    p = Planning(cfg, models_of(teacher_config), devices, {k: shape_of(c) for k, c in own.items()}, own)
    run = wanted(cfg, stages)
    keys = [t.key for t in taught(p)]
    online = replace(p, targets={k: TeacherTargets() for k in keys})
    on_cpu = any(r.share == 0 for s in run for r in s.needs(online))
    cpu = Host(cpu_rate(cfg), os.cpu_count() or 1, devices.cpu_load) if on_cpu else None
    chosen, refusals = choices or configured(cfg, keys), ()
    if not chosen:
        chosen, refusals = choose_targets(p, run, cpu)
    unread = [k for k in keys if k != MOE and k not in p.teachers]
    notes = p.models.notes + tuple(
        f"{k}: planned at the MoE teacher's shape (its config was not read here: a hub name beside --model; name that "
        "teacher by a directory with its config.json to plan its own)"
        for k in unread
    )
    notes += _published(p.models.teacher)
    if cfg.stage3.teacher and cfg.stage3.teacher_scores:  # said, never silently left out
        notes += (
            f"stage3:teacher: its scores read from {cfg.stage3.teacher_scores} (stage3.teacher_scores): the teacher is "
            "neither evaluated nor analysed here",
        )
    return replace(_plan_with(replace(p, targets=chosen), run, cpu, refusals), notes=notes)


def _published(teacher: Shape) -> tuple[str, ...]:
    """The line on a teacher published quantised: what is downloaded and copied to each node, what is held."""
    if not teacher.quantisation:
        return ()
    return (
        f"teacher: {gib(teacher.checkpoint_bytes)} as published in {teacher.quantisation}, downloaded and copied to "
        f"each node that reads it; held dequantised on read in {8 * teacher.dtype_bytes}-bit floats "
        f"({gib(teacher.weights)}: what the memory above counts)",
    )


def decide_checkpointing(cfg: SweepConfig, teacher_config, devices, own, stages, choices) -> RunPlan:
    """distill.checkpointing=auto: the least recompute (none, selective, full: CHECKPOINTING's order) under which every
    stage fits its device (`decide`)."""
    return decide(
        cfg, "checkpointing", tuple(CHECKPOINTING), lambda c: plan(c, teacher_config, devices, own, stages, choices)
    )


def decide_zero(cfg: SweepConfig, teacher_config, devices, own, stages, choices) -> RunPlan:
    """distill.zero_stage=auto: the least sharding whose rank fits (`decide`): ZeRO-2 (the paper's), else ZeRO-3 (the
    weights partitioned too); without DeepSpeed (one worker) ZeRO-2 is recorded and nothing said."""
    candidates = ZERO_STAGES if cfg.distill.uses_deepspeed else ZERO_STAGES[:1]
    return decide(cfg, "zero_stage", candidates, lambda c: plan(c, teacher_config, devices, own, stages, choices))


#: ray.gpus_per_trial=auto's shares of one GPU, the smallest first (a trial runs on one device)
TRIAL_SHARES = (0.125, 0.25, 0.5, 1.0)
#: then, where no GPU of the cluster holds a trial whole, whole GPUs of one node its student is spread over in order
TRIAL_SPREADS = (2, 4, 8)


def decide_trial_gpus(cfg: SweepConfig, teacher_config, devices, own, stages, choices) -> RunPlan:
    """ray.gpus_per_trial=auto: the smallest share of a GPU whose stage-1 trial fits, on the pinned GPU type first
    (ray.trial_accelerator), then on each other GPU type of the cluster's node types, the smallest GPU first; where no
    GPU holds it whole, the fewest whole GPUs of one node (2, 4, 8) its student's layers are spread over in order
    (evaluate/split.py); where none holds it, the last of those (the plan refuses it there, at its smallest). The trials
    alone are planned per candidate; the run is planned once at the choice. Said in one line and recorded in
    `RunPlan.decided` (both keys: a trial moved to another GPU type is pinned to it)."""
    r = cfg.ray
    if "stage1" not in stages.names():  # a plan of other stages: nothing to decide (the trials' share read as one GPU)
        return plan(
            replace(cfg, ray=replace(r, gpus_per_trial=r.trial_gpus)), teacher_config, devices, own, stages, choices
        )
    kinds = sorted({n.accelerator for n in devices.nodes or () if n.gpus > 0 and n.gpu_memory}, key=GPU_MEMORY.get)
    types = [r.trial_accelerator, *(k for k in kinds if k != r.trial_accelerator)] if kinds else [r.trial_accelerator]
    most = {k: max((n.gpus for n in devices.nodes or () if n.accelerator == k), default=0) for k in kinds}
    candidates = [(share, kind) for kind in types for share in TRIAL_SHARES] + [
        (float(n), kind) for n in TRIAL_SPREADS for kind in types if most.get(kind, 0) >= n
    ]

    def at(c: tuple) -> SweepConfig:
        return replace(cfg, ray=replace(r, gpus_per_trial=c[0], trial_accelerator=c[1]))

    def trial(c: tuple):
        return plan(at(c), teacher_config, devices, own, stages.only("stage1"), choices).stages

    rows = {}
    chosen = next((c for c in candidates if all(x.fits is not False for x in rows.setdefault(c, trial(c)))), None)
    if chosen is None:
        chosen = candidates[-1]
    out = plan(at(chosen), teacher_config, devices, own, stages, choices)
    row = next((x for x in rows.get(chosen) or trial(chosen) if x.name == "stage1"), None)
    if row is None:  # no stage 1 in this run (named recipes, a plan of other stages): nothing decided
        return out
    i = candidates.index(chosen)
    before = f"; {_share(candidates[i - 1])} gives {gib(rows[candidates[i - 1]][0].capacity or 0)}" if i else ""
    whole = f" whole, {gib(row.per_device)} a GPU spread" if chosen[0] > 1 else ""
    need = gib(rows[candidates[i - 1]][0].per_device) if whole else gib(row.per_device)
    note = f"ray.gpus_per_trial=auto: {_share(chosen)} (a trial needs {need}{whole}{before})"
    decided = {"ray.gpus_per_trial": str(chosen[0]), "ray.trial_accelerator": chosen[1] or "null"}
    return replace(out, notes=(*out.notes, note), decided={**out.decided, **decided})


#: the GPU-type keys the plan places a stage by when the user left them unset (null): each with the stages it pins
#: (they share the one request) and the section and field of the config it lives in
PLACED = dict(
    zip(
        PLACEABLE,
        [
            (("calibrate", "targets"), "ray", "data_accelerator"),
            (("stage2",), "distill", "accelerator"),
            (("stage3", "analysis"), "stage3", "accelerator"),
        ],
    )
)


def _pinned(cfg: SweepConfig, key: str, value: str | None) -> SweepConfig:
    _, section, name = PLACED[key]
    return replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})


def _placing(cfg: SweepConfig, key: str, devices: Devices, stages: Stages) -> bool:
    """Whether the plan places `key`'s stages: the key is unset, one of its stages runs here on GPUs, and the cluster's
    node types have more than one GPU type to choose from (with one, any GPU is that one)."""
    names, section, name = PLACED[key]
    if getattr(getattr(cfg, section), name) is not None or devices.nodes is None:
        return False
    kinds = {n.accelerator for n in devices.nodes if n.gpus > 0 and n.gpu_memory}
    gpus = {
        "ray.data_accelerator": cfg.ray.data_gpus_per_actor,
        "distill.accelerator": cfg.distill.gpus_per_worker,
        "stage3.accelerator": cfg.stage3_gpus(),
    }[key]
    run = {s.name for s in wanted(cfg, stages)}
    return len(kinds) > 1 and gpus > 0 and any(n in run for n in names)


def decide_placement(cfg: SweepConfig, key: str, teacher_config, devices, own, stages, choices) -> RunPlan:
    """A stage whose GPU type the user left unset (`PLACED`: null) is placed by the plan on a GPU type of the cluster's
    node types: of those under which every unit of its stages fits (their rows planned alone, the other `auto`
    settings decided under each), the cheapest by those stages' bill (dollars, else GPU-hours), the smallest GPU on a
    tie; a student's ranks only on a node type that holds all of its workers (ZeRO within one node). A unit no type
    holds (a teacher too large for any node) does not decide it: it is refused wherever the rest is placed, in its own
    line; where no type holds all the others, the largest GPU (refused at its smallest). Said in one line and
    recorded in `RunPlan.decided`, for the run's config to pin its Ray request to it (a resume keeps it); a pinned key
    stays as given."""
    names = [n for n in PLACED[key][0] if n in stages.names()]
    x = cfg.distill
    per_node = x.workers * x.gpus_per_worker if key == "distill.accelerator" and x.uses_deepspeed else 0
    kinds = sorted(
        {n.accelerator for n in devices.nodes if n.gpus > 0 and n.gpu_memory and n.gpus >= per_node},
        key=GPU_MEMORY.get,
    ) or sorted({n.accelerator for n in devices.nodes if n.gpus > 0 and n.gpu_memory}, key=GPU_MEMORY.get)
    # the targets pass stores what stage 2 reads, so stage 2 is planned beside it (its targets chosen as in the run)
    beside = [n for n in ("stage2",) if "targets" in names and n in stages.names()]
    sub = stages.only(*names, *beside)
    tried = {k: plan(_pinned(cfg, key, k), teacher_config, devices, own, sub, choices) for k in kinds}
    unfit = {
        k: [r for r in p.stages if r.name.split(":")[0] in names and (r.fits is False or not r.feasible)]
        for k, p in tried.items()
    }
    somewhere = set.intersection(*({r.name for r in rows} for rows in unfit.values()))  # fits under no type

    def price(k: str) -> tuple:
        bill = tried[k].cost.by_name() if tried[k].cost else {}
        rows = [bill[n] for n in names if n in bill]
        dollars = [r.dollars for r in rows]
        hours = [r.gpu_hours for r in rows]
        return (
            sum(dollars) if rows and None not in dollars else math.inf,
            sum(hours) if rows and None not in hours else math.inf,
            GPU_MEMORY[k],
        )

    fitting = [k for k in kinds if {r.name for r in unfit[k]} <= somewhere]
    chosen = min(fitting, key=price) if fitting else kinds[-1]
    out = plan(_pinned(cfg, key, chosen), teacher_config, devices, own, stages, choices)
    why = "; ".join(f"{k}: {_placed_text([r for r in unfit[k] if r.name not in somewhere], price(k))}" for k in kinds)
    node = next(n.name for n in devices.nodes if n.accelerator == chosen)
    what = " and ".join(names)
    nowhere = f"; {', '.join(sorted(somewhere))} fits no GPU type (refused below)" if somewhere else ""
    note = (
        f"{key}={chosen}: placed by the plan on {node}, the cheapest GPU type whose {what} fit ({why}{nowhere})"
        if fitting
        else f"{key}={chosen}: placed by the plan on {node}, the largest GPU type; none holds {what} ({why})"
    )
    return replace(out, notes=(*out.notes, note), decided={**out.decided, key: chosen})


def _placed_text(unfit: list, price: tuple) -> str:
    """A GPU type as placement weighed it: what does not fit there (the worst unit), else its price."""
    if unfit:
        row = max(unfit, key=lambda r: r.per_device)
        where = f"{gib(row.capacity)} there" if row.feasible else "no node type holds it"
        return f"{row.name} needs {gib(row.per_device)} a {row.unit.split(' (')[0].split(',')[0]}, {where}"
    return f"fits, ${price[0]:,.0f}" if price[0] < math.inf else "fits"


def _share(c: tuple) -> str:
    if c[0] > 1:
        return f"{c[0]:g} {c[1] + 's' if c[1] else 'GPUs'}, the student spread over {c[0]:g} GPUs (its layers in order)"
    return f"{c[0]:g} of {'an ' + c[1] if c[1] else 'a GPU'}"


#: distill.zero_stage=auto's candidates, the least sharding first
ZERO_STAGES = (2, 3)


def decide(cfg: SweepConfig, key: str, candidates: tuple, build) -> RunPlan:
    """distill.`key`=auto: the first of `candidates` (the least recompute or sharding first) under which every stage
    fits its device, each planned by `build`; where something does not fit whatever the value (a stage-3 model, a rank
    too large even at the last), the first that needs no more than the last anywhere it does not fit (the plan then
    refuses that alone, at its smallest). Said in one note (when there was a choice) and recorded in
    `RunPlan.decided`, for the run to apply to its config (its workers and a resume read a decided value)."""
    plans: dict = {}

    def over(value) -> list:
        if value not in plans:
            plans[value] = build(replace(cfg, distill=replace(cfg.distill, **{key: value})))
        return [r for r in plans[value].stages if r.fits is False]

    chosen = next((v for v in candidates if not over(v)), None)
    if chosen is None:  # the first that needs no more than the last anywhere it does not fit
        least = {r.name: r.per_device for r in over(candidates[-1])}
        chosen = next(v for v in candidates if all(least.get(r.name, -1) >= r.per_device for r in over(v)))
    tried = [f"{v}: {_worst(over(v))}" for v in candidates[: candidates.index(chosen) + 1]]
    out = plans[chosen]
    notes = (*out.notes, f"distill.{key}=auto: {chosen} ({'; '.join(tried)})") if len(candidates) > 1 else out.notes
    return replace(out, notes=notes, decided={**out.decided, f"distill.{key}": str(chosen)})


def _worst(bad: list) -> str:
    """What a candidate of an auto setting leaves unfit, the stage-2 rank first (what the settings change)."""
    if not bad:
        return "fits"
    row = next((r for r in bad if r.name.startswith("stage2")), None)
    if row is None:
        return f"the rank fits, not the rest ({gib(bad[0].per_device)} a {bad[0].unit.split(' (')[0]})"
    return f"{gib(row.per_device)} a {row.unit.split(' (')[0]}"


def _plan_with(p: Planning, run: list[Stage], cpu: Host | None, refusals: tuple[str, ...] = ()) -> RunPlan:
    """The plan of `p` (its teachers' targets decided) over the stages `run`."""
    rows = [row for s in run for row in s.needs(p)]
    stays, peak = {}, {}
    for s in run:
        a, b = s.storage(p)
        stays, peak = {**stays, **a}, {**peak, **b}
    cfg = p.cfg
    return RunPlan(
        tuple(rows),
        stays,
        p.devices.gpu_memory,
        {
            "teacher_params": p.models.teacher.params,
            "student_params": p.models.student.params,
            "teacher_checkpoint_bytes": p.models.teacher.checkpoint_bytes,
        },
        peak,
        _bill(p, run, {r.name: r for r in rows}, cpu, sum(stays.values()) + sum(peak.values())),
        cfg.plan.max_dollars,
        dict(p.targets),
        parse_size(cfg.plan.max_storage) if cfg.plan.max_storage else None,
        refusals,
    )


def choose_targets(p: Planning, run: list[Stage], cpu: Host | None) -> tuple[dict[str, TeacherTargets], tuple]:
    """stage2.targets=auto: for each stage-2 teacher in turn, the cheapest of its exact candidates (`_candidates`) whose
    stage-2 rank, targets pass and storage fit, priced as the whole run's bill (dollars, else GPU-hours, else wall
    time) with the teachers before it as chosen and those after it online. Each choice says why, with what every
    candidate would cost; a teacher none of whose candidates fits gets the first of them and a refusal naming every
    limit it meets (`RunPlan.problems`)."""
    teachers = taught(p)
    chosen = {t.key: _candidates(p, t)[-1] if _candidates(p, t) else TeacherTargets() for t in teachers}
    refusals = []
    for t in teachers:
        tried = []
        for c in _candidates(p, t):
            plan = _plan_with(replace(p, targets={**chosen, t.key: c}), run, cpu)
            tried.append((c, plan, _unfit(plan, t.key, c)))
        fitting = [(c, plan) for c, plan, unfit in tried if unfit is None]
        options = "; ".join(unfit or f"{c.label}: {_price_text(plan)}" for c, plan, unfit in tried)
        if not fitting:
            refusals.append(
                f"stage2.targets=auto: no exact mode fits {t.key} ({options}); raise plan.max_storage, give more "
                "distill.workers (the teacher is sharded over them) or larger GPUs"
            )
            chosen[t.key] = replace(tried[0][0] if tried else TeacherTargets(), why="no exact mode fits")
            continue
        best = min(fitting, key=lambda cp: _price(cp[1]))[0]
        reason = (
            "it serves one student: stored states would cost its forward once anyway, and their storage"
            if t.students <= 1
            else "the cheapest exact mode that fits"
        )
        chosen[t.key] = replace(best, why=f"{reason}: {options}")
    return chosen, tuple(refusals)


def _candidates(p: Planning, t) -> list[TeacherTargets]:
    """The exact modes `auto` weighs for teacher `t`: hidden (when it serves more than one student and the loss trains
    from the final states), online whole (unless stage2.shard_teacher), online sharded (over more than one worker)."""
    cfg, out = p.cfg, []
    if t.students > 1 and not LOSSES[cfg.distill.loss][1]:  # fkl+mse needs every layer's states: online only
        out.append(TeacherTargets(HIDDEN))
    if not cfg.stage2.shard_teacher:
        out.append(TeacherTargets(ONLINE))
    if cfg.distill.workers > 1:
        out.append(TeacherTargets(ONLINE, shard=True))
    return out


def _unfit(plan: RunPlan, key: str, c: TeacherTargets) -> str | None:
    """Why candidate `c` of teacher `key` cannot run in `plan` (None: it can): its stage-2 rank or its targets pass
    does not fit a device, or the run's storage exceeds plan.max_storage."""
    rows = [
        r
        for r in plan.stages
        if r.name in (f"stage2:{key}", f"targets:{key}") or (key == MOE and r.name in ("stage2", "targets"))
    ]
    for r in rows:
        if not r.feasible or r.fits is False:
            what = "its targets pass" if r.name.startswith("targets") else "a rank"
            return f"{c.label} needs {gib(r.per_device)} {what}, over the {gib(r.capacity or 0)} a device gives it"
    if plan.over_storage():
        return f"{c.label} stores {gib(plan.storage_peak_bytes)}, over plan.max_storage {gib(plan.max_storage)}"
    return None


def _price(plan: RunPlan) -> tuple[float, float, float]:
    c = plan.cost
    return (c.dollars or 0.0, c.gpu_hours or 0.0, c.seconds or 0.0)


def _price_text(plan: RunPlan) -> str:
    """What the whole run would cost with a candidate: dollars (when priced), wall time, the storage it fills."""
    c = plan.cost
    money = f"${c.dollars:,.0f}, " if c.dollars else ""
    return f"the run {money}{duration(c.seconds)}, {gib(plan.storage_peak_bytes)} stored"


def _bill(p: Planning, run: list[Stage], plans: dict, cpu: Host | None, stored: int = 0) -> RunCost:
    """Every stage's cost and the run's (the head node priced for its whole wall, the storage for it at its kind's
    price); with ASHA expected to stop some students, `bound` is the same run with none stopped."""
    cfg, d = p.cfg, p.devices
    c = Costing(p, plans, cpu)
    rows = [row for s in run for row in s.cost(c)]
    head = next((n for n in d.nodes or () if n.name == d.head), None)
    wall = None if any(r.seconds is None for r in rows) else sum(r.seconds for r in rows)
    price = hourly(head, cfg.plan.prices) if head else None
    bound = None
    if len(p.ends) > 1:  # ASHA stops some students: the same run with none stopped is the most it can cost
        same = replace(cfg, stage2=replace(cfg.stage2, asha=False))
        bound = _bill(replace(p, cfg=same), run, plans, cpu, stored)
    kept = storage_dollars(cfg, p.storage_kind, stored, wall) or 0.0
    note = (
        f"storage: {gib(stored)} ({p.storage_kind}) for the run's {duration(wall)}, at plan.tb_month.{p.storage_kind}"
        if kept
        else ""
    )
    return RunCost(
        tuple(rows),
        None if price is None or wall is None else price * wall / 3600,
        cpu.rate if cpu else None,
        d.cpu_load,
        tuple(p.ends),
        bound,
        kept,
        note,
    )


# ---- the run ------------------------------------------------------------------------------------
def run(ctx, stages: Stages | None = None) -> dict:
    """Run the stages of `ctx` (or `stages`) in order, skipping those a resumed run finished; each one's wall time
    is added to RUN_DIR/run.json (summed over resumes: the bill's measured side). Returns each stage's result."""
    state = json.loads(ctx.rd.timings.read_text()) if ctx.rd.timings.exists() else {"stages": {}}
    results = {}
    for stage in wanted(ctx.cfg, stages or ctx.stages):
        if stage.finished(ctx):
            continue
        t0 = time.time()
        say(f"== {stage.name} ==")
        results[stage.name] = stage.run(ctx)
        before = state["stages"].get(stage.name, {})
        state["stages"][stage.name] = {
            **before,
            "wall_s": round(before.get("wall_s", 0.0) + time.time() - t0, 1),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "runs": before.get("runs", 1 if before else 0) + 1,
        }
        write_json_atomic(ctx.rd.timings, state)
    return results


def run_stages(cfg: SweepConfig, run_dir, *names: str, tracking_uri: str | None = None) -> dict:
    """The stages `names` on `run_dir` (a new run made there, else the run there continued), without the commands'
    checks: for tests, benchmarks and notebooks. Returns each stage's result."""
    from m2d_ray.runtime.context import RunContext

    rd, stages = RunDir(run_dir), tuple(STAGES)
    ctx = (
        RunContext(cfg, rd, tracking_uri, stages)
        if rd.state.exists()
        else RunContext.create(cfg, rd, tracking_uri, stages)
    )
    return run(ctx, STAGES.only(*names))


def write_report(run_dir) -> Path:
    """RUN_DIR/report/ from every stage's sections (`m2d report`, and the tests)."""
    return report.write(RunDir(run_dir), STAGES)
