"""Scalings alpha_g of each merged group's down projection in the concatenated FFN."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.catalog.methods import SCALINGS

ScalingFn = Callable[[LayerStats, list[list[int]], Tensor, float], list[float]]


@SCALINGS.register("uniform")
def uniform(st: LayerStats, groups: list[list[int]], scores: Tensor, routed_scale: float = 1.0) -> list[float]:
    """alpha_g = 1/k (times the router's routed_scaling_factor): the mean weight of a renormalised top-k router."""
    return [routed_scale / len(groups)] * len(groups)


@SCALINGS.register("proportional")
def proportional(st: LayerStats, groups: list[list[int]], scores: Tensor, routed_scale: float = 1.0) -> list[float]:
    """alpha_g = group score mass / total score mass (x routed_scaling_factor; uniform for all-zero scores)."""
    s = scores.double().clamp(min=0)
    mass = [float(s[g].sum()) for g in groups]
    total = sum(mass)
    return [routed_scale * m / total for m in mass] if total > 0 else uniform(st, groups, scores, routed_scale)


@SCALINGS.register("avg-cp")
def avg_cp(st: LayerStats, groups: list[list[int]], scores: Tensor, routed_scale: float = 1.0) -> list[float]:
    """alpha_g = mean over the group of the weight the router applies to e when it selects e.

    For a softmax router without top-k renormalisation (DeepSeek-V2) this is the mean conditional
    probability CP of the group times routed_scaling_factor, already part of the applied weight.
    """
    cw = st.cw
    return [float(cw[g].mean()) for g in groups]
