"""A run's config: the teacher, where it writes, and each stage's section (config/sections.py, config/stages.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from m2d_ray.catalog.distill import AUTO
from m2d_ray.catalog.targets import parse_targets
from m2d_ray.config import sections, stages
from m2d_ray.config.fields import plain, setting


@dataclass(frozen=True)
class SweepConfig:
    """A run: the teacher, where it writes, and each stage's section."""

    name: str = setting(
        "sweep",
        "the run's name (its default run directory runs/NAME-TIME, its MLflow parent run's name)",
    )
    stage: Literal[1, 2] = setting(
        1,
        "m2d sweep only: 1 = the pre-distillation grid; 2 = distil the promotions of a finished stage 1 (--resume "
        "RUN_DIR)",
    )
    model: str | None = setting(
        None,
        "the MoE teacher: a hub name, a directory or a storage URL (s3://...); None = the embedded tiny teacher",
    )
    storage: str | None = setting(
        None,
        "what Ray workers read and write (students, checkpoints, Tune state, the text files): a path every node "
        "mounts or s3:// / gs://; None = the run directory",
    )
    device: str | None = setting(None, "the device of a stage-1 trial; None = cuda when the trial has a GPU, else cpu")
    calib: sections.CalibConfig = field(default_factory=sections.CalibConfig)
    eval: sections.EvalConfig = field(default_factory=sections.EvalConfig)
    grid: sections.GridConfig = field(default_factory=sections.GridConfig)
    search: sections.SearchConfig = field(default_factory=sections.SearchConfig)
    ray: sections.RayConfig = field(default_factory=sections.RayConfig)
    mlflow: sections.TrackConfig = field(default_factory=sections.TrackConfig)
    distill: stages.DistillConfig = field(default_factory=stages.DistillConfig)
    stage2: stages.Stage2Config = field(default_factory=stages.Stage2Config)
    stage3: stages.Stage3Config = field(default_factory=stages.Stage3Config)
    faults: sections.FaultConfig = field(default_factory=sections.FaultConfig)
    plan: sections.PlanConfig = field(default_factory=sections.PlanConfig)

    def to_dict(self) -> dict:
        return plain(dataclasses.asdict(self))

    def uses_gpus(self) -> bool:
        """Whether the run asks for GPUs: decided from the config, not from the GPUs up right now (a cluster
        scaling from zero GPU nodes has none until someone asks)."""
        return self.distill.gpus_per_worker > 0 or self.ray.trial_gpus > 0 or self.ray.data_gpus_per_actor > 0

    def stage3_gpus(self) -> float:
        """GPUs a stage-3 or analysis model's task asks for: stage3.gpus_per_task, else 1 when the run uses GPUs."""
        c = self.stage3
        return c.gpus_per_task if c.gpus_per_task is not None else float(self.uses_gpus())

    def students_at_once(self) -> int | None:
        """Stage 2's students at a time: as set, else all of them on GPUs (Ray queues their worker groups and an
        autoscaler starts nodes for them), else `ray.max_concurrent_trials` on CPUs."""
        if self.stage2.max_concurrent_trials:
            return self.stage2.max_concurrent_trials
        return None if self.distill.gpus_per_worker > 0 else self.ray.max_concurrent_trials

    def target_spec(self):
        """stage2.targets as a TargetSpec (None: online), at the distillation temperature and seed; `auto` is the
        plan's choice per teacher (plan/targets.py), not one spec."""
        if self.stage2.targets == AUTO:
            raise ValueError("stage2.targets=auto: each teacher's mode is the plan's (Planning.choice)")
        return parse_targets(self.stage2.targets, self.distill.temperature, self.distill.seed)
