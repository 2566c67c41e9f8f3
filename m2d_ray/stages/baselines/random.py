"""The random baselines: the student's architecture with a fresh FFN under the teacher's attention (random-ffn),
or with nothing kept (random-init), built on the distillation's rank 0 from the MoE teacher (convert/baselines.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from m2d_ray.catalog.methods import RANDOM_BASELINES
from m2d_ray.stages.baselines.base import Baseline

# Imported inside functions: torch and the conversion (`m2d plan` reads this baseline without them).


class RandomBaseline(Baseline):
    @property
    def summary(self) -> str:
        """The docstring of the function that builds its student (`convert/baselines.py`)."""
        return RANDOM_BASELINES[self.name].__doc__ or ""

    def builder(self, moe: str, prepared: object | None, seed: int) -> Callable[[Path], None]:
        from m2d_ray.convert.initial import InitialStudent

        return InitialStudent(moe, None, self.name, seed)
