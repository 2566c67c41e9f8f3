"""The scorings' implementations: each registers under the name `catalog/methods.py` declares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.catalog.methods import SCORINGS
from m2d_ray.scoring.base import BASE_SCORES, effective_rank
from m2d_ray.scoring.dopt import greedy_logdet, kernel, ridge

__all__ = ["Selection", "select", "selection_erank"]


@dataclass(frozen=True)
class Selection:
    """Kept experts in pick order (score rank, or greedy order for D-optimal) and the per-expert
    scores s_e used for merge weights and proportional scaling."""

    experts: list[int]
    scores: Tensor  # [E] float64
    base: str  # the base score: sf/pp/ps/cp/acp


def _topk(base: str) -> Callable[[LayerStats, int], Selection]:
    def fn(st: LayerStats, K: int) -> Selection:
        s = BASE_SCORES[base](st).double()
        # stable ordering: score descending, then expert index ascending
        order = sorted(range(len(s)), key=lambda e: (-float(s[e]), e))[:K]
        return Selection(experts=order, scores=s, base=base)

    fn.__doc__ = f"Top-K experts by {base.upper()}."
    return fn


def _dopt(base: str) -> Callable[[LayerStats, int], Selection]:
    def fn(st: LayerStats, K: int) -> Selection:
        s = BASE_SCORES[base](st).double()
        Kmat = kernel(s, st.gram_mean)
        return Selection(experts=greedy_logdet(Kmat, K, ridge(Kmat, K)), scores=s, base=base)

    fn.__doc__ = f"D-optimal (greedy log-det) with base importance {base.upper()}."
    return fn


for _name in ("sf", "pp", "ps", "cp", "acp"):
    SCORINGS.register(_name)(_topk(_name))
SCORINGS.register("do-cp")(_dopt("cp"))
SCORINGS.register("do-acp")(_dopt("acp"))


def select(name: str, st: LayerStats, K: int) -> Selection:
    E = st.num_experts
    if not 1 <= K <= E:
        raise ValueError(f"K={K} outside [1, {E}]")
    return SCORINGS[name](st, K)


def selection_erank(st: LayerStats, sel: Selection) -> float:
    """Effective rank of the selected experts' output Gram G_S: how many distinct directions the kept
    experts span (1..K); the same matrix for every scoring, so sets are comparable."""
    idx = torch.tensor(sel.experts)
    return effective_rank(torch.linalg.eigvalsh(st.gram_mean[idx][:, idx]))
