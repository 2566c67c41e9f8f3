"""What a stage-2 baseline is: a student distilled under the same budget as the promoted ones, which says what
it brings besides (its own teacher, work before the students, its share of the bill, its report section).

    name              its key in stage2.baselines; its student is `baseline-NAME`
    teacher_label     the report's row of its own teacher (None: distilled from the run's MoE teacher)
    check_config      settings that cannot run together, from the config alone (m2d plan and m2d run)
    check             its inputs on the driver, before any work
    reads             the data specs its preparation reads
    teacher(cfg)      its own teacher (a name or directory), when it has one
    teacher_students  the students its own teacher serves (one: never stores states under auto)
    prepare(...)      work on Ray before the students (under stage 2's resource waiter); `BaselineFailed` is
                      that student's failure, not the run's
    builder(...)      what writes its initial student where the distillation's rank 0 needs it (picklable)
    distill_config    its distillation settings, from the run's
    prepare_cost      the bill of `prepare` (stage 2's row counts it before the students)
    sections          what it adds to the report
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from m2d_ray.stages.contract import Checked, Section

if TYPE_CHECKING:  # argument types only
    from m2d_ray.config import DistillConfig, SweepConfig
    from m2d_ray.plan.bill import StageCost
    from m2d_ray.plan.run_plan import Costing
    from m2d_ray.report.analysis import RunData
    from m2d_ray.runtime.context import RunContext


class BaselineFailed(RuntimeError):
    """A baseline's preparation failed on its worker (the message says why, in one line)."""


class Baseline(Checked):
    """A stage-2 baseline; see the module docstring. The base is a student built from the MoE teacher alone.
    `key`: its student's key in stage 2's ledger and stage 3's results; `teacher_key`: stage 3's key of its own
    teacher."""

    teacher_label: str | None = None

    def __init__(self, name: str) -> None:
        self.name, self.key, self.teacher_key = name, f"baseline-{name}", f"teacher-{name}"

    @property
    def summary(self) -> str:
        """What this baseline is, in a sentence (the registries reference): its class's own docstring."""
        return type(self).__dict__.get("__doc__") or ""

    @property
    def has_teacher(self) -> bool:
        """Whether it is distilled from a teacher of its own (then stage 3 evaluates that teacher too)."""
        return self.teacher_label is not None

    @property
    def teacher_students(self) -> int:
        """Students distilled from its own teacher: its own one. A teacher that serves one student never stores its
        states under stage2.targets=auto (the pass would run its forward once anyway, and add the storage)."""
        return 1 if self.has_teacher else 0

    def check(self, cfg: SweepConfig) -> None:
        return None

    def teacher(self, cfg: SweepConfig) -> str | None:
        return None

    def prepare(self, ctx: RunContext, waiting, moe: str, teacher: str | None) -> object | None:
        return None

    def builder(self, moe: str, prepared: object | None, seed: int) -> Callable[[Path], None]:
        raise NotImplementedError

    def distill_config(self, x: DistillConfig) -> DistillConfig:
        return x

    def prepare_cost(self, c: Costing) -> StageCost | None:
        return None

    def sections(self, data: RunData) -> list[Section]:
        return []
