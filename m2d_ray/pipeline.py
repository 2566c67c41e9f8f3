"""The stages of a run, in order, and what they drive: `m2d run` runs them top to bottom, `m2d plan` adds up what
they need, every command checks what they read before any work, a resumed run checks what they keep, and the
report gathers what they add. Each stage is one module under stages/ (the contract: stages/contract.py).

    calibrate -> stage1 -> targets -> stage2 -> stage3 -> analysis -> report

A new stage is one module and one line in STAGES.
"""

from __future__ import annotations

import difflib
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from m2d_ray.artifacts import write_json_atomic
from m2d_ray.checkpoint import scan
from m2d_ray.config import SweepConfig, load_config
from m2d_ray.console import say
from m2d_ray.data import source
from m2d_ray.errors import M2DError
from m2d_ray.models import check_teacher, default_teacher
from m2d_ray.models import load_config as model_config
from m2d_ray.plan.cost import Host, RunCost, cpu_rate
from m2d_ray.plan.prices import hourly
from m2d_ray.plan.run_plan import Costing, Devices, Planning, RunPlan
from m2d_ray.plan.shapes import models_of, shape_of
from m2d_ray.run_dir import RunDir
from m2d_ray.stages import analysis, baselines, calibrate, report, stage1, stage2, stage3, targets
from m2d_ray.stages.contract import Stage
from m2d_ray.track import Tracker

# Imported inside functions: Ray (`m2d plan` and the checks read this module without importing it).


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

    check_config(cfg)
    teacher = cfg.model or default_teacher()
    check_teacher(teacher)
    for s in wanted(cfg, stages):
        s.check(cfg, teacher)
    if tracking_uri or cfg.mlflow.tracking_uri:
        Tracker(tracking_uri or cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    if cfg.storage:
        from m2d_ray.stages.run_storage import RunStorage

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
    cfg: SweepConfig, devices: Devices = Devices(), model: str | None = None, stages: Stages = STAGES
) -> RunPlan:
    """The plan of `cfg` (m2d plan, and m2d run before any work): the teacher's config read from `model` (a directory
    with config.json), else the config's model; the baselines' own teachers when their configs can be read here
    (not with `model` given: then their names may be the hub's)."""

    check_config(cfg)
    own = (
        {}
        if model is not None
        else {b.teacher_key: model_config(b.teacher(cfg)) for b in baselines.of(cfg) if b.has_teacher}
    )
    return plan(cfg, model_config(model or cfg.model or default_teacher()), devices, own, stages)


def plan(
    cfg: SweepConfig, teacher_config, devices: Devices = Devices(), own: dict | None = None, stages: Stages = STAGES
) -> RunPlan:
    """Every stage's rows added up, from configs alone: the MoE teacher's, and the baselines' own teachers' (`own`, by
    stage 3's key) where known (else planned at the MoE teacher's shape)."""
    own = own or {}
    p = Planning(cfg, models_of(teacher_config), devices, {k: shape_of(c) for k, c in own.items()}, own)
    run = wanted(cfg, stages)
    rows = [row for s in run for row in s.needs(p)]
    stays, peak = {}, {}
    for s in run:
        a, b = s.storage(p)
        stays, peak = {**stays, **a}, {**peak, **b}
    return RunPlan(
        tuple(rows),
        stays,
        devices.gpu_memory,
        {"teacher_params": p.models.teacher.params, "student_params": p.models.student.params},
        peak,
        _bill(p, run, {r.name: r for r in rows}),
        cfg.plan.max_dollars,
    )


def _bill(p: Planning, run: list[Stage], plans: dict, cpu: Host | None = None) -> RunCost:
    """Every stage's cost and the run's (the head node priced for its whole wall); with ASHA expected to stop some
    students, `bound` is the same run with none stopped."""
    cfg, d = p.cfg, p.devices
    if cpu is None and any(x.share == 0 for x in plans.values()):
        cpu = Host(cpu_rate(cfg), os.cpu_count() or 1, d.cpu_load)
    c = Costing(p, plans, cpu)
    rows = [row for s in run for row in s.cost(c)]
    head = next((n for n in d.nodes or () if n.name == d.head), None)
    wall = None if any(r.seconds is None for r in rows) else sum(r.seconds for r in rows)
    price = hourly(head, cfg.plan.prices) if head else None
    bound = None
    if len(p.ends) > 1:  # ASHA stops some students: the same run with none stopped is the most it can cost
        same = replace(cfg, stage2=replace(cfg.stage2, asha=False))
        bound = _bill(replace(p, cfg=same), run, plans, cpu)
    return RunCost(
        tuple(rows),
        None if price is None or wall is None else price * wall / 3600,
        cpu.rate if cpu else None,
        d.cpu_load,
        tuple(p.ends),
        bound,
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
    from m2d_ray.stages.context import RunContext

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
