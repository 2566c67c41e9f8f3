"""Stage 2's baselines, one registry of descriptors (`base.Baseline`): a new baseline is a module here and a
line below. Their order is the matched-parameter table's (the strongest competitor first)."""

from __future__ import annotations

from m2d_ray.registry import Registry
from m2d_ray.stages.baselines.base import Baseline, BaselineFailed
from m2d_ray.stages.baselines.d2d import D2D
from m2d_ray.stages.baselines.random import RandomBaseline

BASELINES: Registry[Baseline] = Registry("baseline")
for _b in (D2D(), RandomBaseline("random-ffn"), RandomBaseline("random-init")):
    BASELINES.register(_b.name)(_b)


def of(cfg) -> list[Baseline]:
    """The run's baselines (stage2.baselines), in its order; an unknown name is refused with the closest."""
    return [BASELINES[name] for name in cfg.stage2.baselines]


__all__ = ["BASELINES", "Baseline", "BaselineFailed", "of"]
