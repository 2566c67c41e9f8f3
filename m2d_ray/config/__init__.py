"""A run's configuration: frozen dataclasses read from YAML, with `key=value` overrides.

A YAML file is a (possibly partial) nested mapping of the dataclasses; `include: base.yaml` merges a base file first,
so a teacher's config is a small diff. Every key is checked: an unknown key, a wrong type, a value outside its closed
set or an unknown method name fails with one line that says what to write instead. The parts:

    fields.py     `setting` (a key's default and doc, written once) and the closed sets, declared from their registries
    sections.py   the run-wide sections (calib, eval, grid, search, ray, mlflow, plan, faults)
    stages.py     the students' sections (distill, stage2, stage3 and its analysis)
    schema.py     SweepConfig: the whole run
    grid.py       a recipe named directly and a teacher's K list (the plan's arithmetic reads them too)
    checks.py     what the types cannot say: ranges and settings that cannot run together
    loading.py    load_config: the YAML (a file or a shipped name), the overrides, the closed sets, the checks
"""

from m2d_ray.config.checks import check_config
from m2d_ray.config.fields import (
    Auto,
    CheckpointingName,
    KernelName,
    LossName,
    PrecisionName,
    QuestionSet,
    default,
    docs,
    setting,
)
from m2d_ray.config.grid import Recipe, k_values, parse_recipe
from m2d_ray.config.loading import RENAMED, RETIRED, dump_config, load_config
from m2d_ray.config.schema import SweepConfig
from m2d_ray.config.sections import (
    CalibConfig,
    EvalConfig,
    FaultConfig,
    GridConfig,
    PlanConfig,
    RayConfig,
    SearchConfig,
    TrackConfig,
)
from m2d_ray.config.stages import STOP_POLL_STEPS, AnalysisConfig, DistillConfig, Stage2Config, Stage3Config, Thresholds

__all__ = [
    "STOP_POLL_STEPS",
    "RENAMED",
    "RETIRED",
    "AnalysisConfig",
    "Auto",
    "CalibConfig",
    "CheckpointingName",
    "DistillConfig",
    "EvalConfig",
    "FaultConfig",
    "GridConfig",
    "KernelName",
    "LossName",
    "PlanConfig",
    "PrecisionName",
    "QuestionSet",
    "RayConfig",
    "Recipe",
    "SearchConfig",
    "Stage2Config",
    "Stage3Config",
    "SweepConfig",
    "Thresholds",
    "TrackConfig",
    "check_config",
    "default",
    "docs",
    "dump_config",
    "k_values",
    "load_config",
    "parse_recipe",
    "setting",
]
