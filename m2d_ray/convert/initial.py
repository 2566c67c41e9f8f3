"""The initial student of a distillation run, on disk: a converted student (from its plan) or a baseline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from m2d_ray.catalog.methods import RANDOM_BASELINES
from m2d_ray.convert.build import build_from_plan
from m2d_ray.convert.export import export_student
from m2d_ray.convert.plan import ConversionPlan
from m2d_ray.weights import open_teacher


def materialize(
    teacher, out: str | Path, plan: ConversionPlan | None = None, baseline: str | None = None, seed: int = 0
) -> Path:
    """Build and export the student once (a converted one is verified exact); reuse `out` when it exists."""
    out = Path(out)
    if (out / "config.json").exists():
        return out

    if baseline is not None:
        export_student(RANDOM_BASELINES[baseline](teacher, seed=seed), teacher.tokenizer, out)
    elif plan is not None:
        export_student(build_from_plan(teacher, plan), teacher.tokenizer, out, teacher=teacher, plan=plan)
    else:
        raise ValueError("materialize needs a plan or a baseline")
    return out


@dataclass(frozen=True)
class InitialStudent:
    """A student to materialise where it is needed (a distillation worker), from its plan or a baseline:
    picklable, so it travels with the job instead of the student travelling through a shared disk."""

    teacher: str
    plan: ConversionPlan | None = None
    baseline: str | None = None
    seed: int = 0

    def __call__(self, out: Path) -> None:

        # lazy: the builder reads only the tensors the student is made of, never the whole teacher
        materialize(open_teacher(self.teacher), out, plan=self.plan, baseline=self.baseline, seed=self.seed)
