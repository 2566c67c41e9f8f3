"""The stage contract: one stage of a run, in one module, says what it checks before any work, what it needs,
how it runs and what it adds to the report. `m2d_ray/pipeline.py` holds the stages in order and drives
`m2d run`, `m2d plan`, the resume checks and the report from them; nothing else lists the stages.

    name            its key in run.json, the plan's rows, the console's `== name ==` and the resource waiter
    keys            the config keys of its Ray request (named when no node can hold it)
    wanted(cfg)     whether the run has the stage at all (the targets pass only with a cached mode)
    check_config    settings that cannot run together, from the config alone (`m2d plan` too)
    reads(cfg)      the data specs it reads: checked before any work, fingerprinted for a resume
    check(cfg, t)   every other input it will read (teacher `t`), on the driver, before anything is written
    check_resume    what a resumed run must keep for the stage's finished part to stay valid
    request(cfg)    one unit's Ray resources: what its resource waiter watches the autoscaler for
    needs(p)        memory per device, devices and Ray request of its units (`StagePlan`s)   } arithmetic over
    storage(p)      what it leaves in the run's storage, and what it holds besides while it runs  } configs and shapes,
    cost(c)         its FLOPs, wall time, GPU-hours and dollars (`StageCost`s)                   } no Ray
    finished(ctx)   done already: a resumed run skips it
    run(ctx)        the work, on the run's context (`context.RunContext`)
    sections(data)  what it adds to the report (`Section`s, in the order it gives them)

Everything here is optional but `name` and `run`; a module defines its stage as a subclass and an instance,
and `pipeline.STAGES` lists the instances in order. Ray is imported inside `run` only, so that `m2d plan`
reads every stage without starting or importing Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types of the hooks' arguments; importing them here would tie the contract to Ray
    from m2d_ray.config import SweepConfig
    from m2d_ray.plan.bill import StageCost
    from m2d_ray.plan.run_plan import Costing, Planning, StagePlan
    from m2d_ray.report.analysis import RunData
    from m2d_ray.run_dir import RunDir
    from m2d_ray.runtime.context import RunContext


@dataclass(frozen=True)
class Section:
    """One section of the report: `render(out)` writes its tables and figures into the report directory `out`
    and returns its HTML."""

    title: str
    render: Callable[[Path], str]


class Checked:
    """What a stage, or a part of one (a baseline), says of a config before any work."""

    def check_config(self, cfg: SweepConfig) -> None:
        """Settings that cannot run together, from the config alone."""
        return None

    def reads(self, cfg: SweepConfig) -> dict[str, str]:
        """The data specs it reads: key -> spec."""
        return {}


class Stage(Checked):
    """A stage of a run; see the module docstring for what each hook means."""

    name: str = ""
    keys: str = ""

    def wanted(self, cfg: SweepConfig) -> bool:
        return True

    def check(self, cfg: SweepConfig, teacher: str) -> None:
        return None

    def check_resume(self, rd: RunDir, cfg: SweepConfig) -> None:
        return None

    def request(self, cfg: SweepConfig) -> dict:
        return {}

    def needs(self, p: Planning) -> list[StagePlan]:
        return []

    def storage(self, p: Planning) -> tuple[dict, dict]:
        return {}, {}

    def cost(self, c: Costing) -> list[StageCost]:
        return []

    def finished(self, ctx: RunContext) -> bool:
        return False

    def run(self, ctx: RunContext) -> None:
        raise NotImplementedError

    def sections(self, data: RunData) -> list[Section]:
        return []
