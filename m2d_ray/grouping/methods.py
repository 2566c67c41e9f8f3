"""The groupings' implementations: each registers under the name `catalog/methods.py` declares.

Every method returns groups as lists of expert ids. Groups are ordered by their best-scored member
and members by score (descending), so identical partitions give identical students.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from m2d_ray.arch.base import ExpertWeights
from m2d_ray.catalog.methods import GROUPINGS
from m2d_ray.grouping.cluster import average_linkage, cosine_distance

__all__ = ["GroupingInputs", "group"]


@dataclass
class GroupingInputs:
    """What the grouping methods may look at for one layer (weights are read lazily)."""

    selected: list[int]
    scores: Tensor  # [E]
    gram: Tensor  # [E, E] mean output Gram
    router: Callable[[], Tensor]  # -> [E, d]
    experts: Callable[[], ExpertWeights]  # -> the selected experts, in `selected` order

    def ranked(self) -> list[int]:
        return sorted(self.selected, key=lambda e: (-float(self.scores[e]), e))

    @cached_property
    def router_rows(self) -> Tensor:
        return self.router()[self.selected].double()


def _clusters_to_ids(inp: GroupingInputs, clusters: list[list[int]]) -> list[list[int]]:
    return [[inp.selected[i] for i in c] for c in clusters]


@GROUPINGS.register("rr")
def round_robin(inp: GroupingInputs, k: int) -> list[list[int]]:
    """Rank r (by score) goes to group r mod k."""
    ranked = inp.ranked()
    return [ranked[g::k] for g in range(k)]


@GROUPINGS.register("wc")
def weight_clustering(inp: GroupingInputs, k: int) -> list[list[int]]:
    """Average-linkage on cosine distance of the flattened concat(gate, up, down)."""
    w = inp.experts()
    return _clusters_to_ids(inp, average_linkage(cosine_distance(w.gate, w.up, w.down), k))


@GROUPINGS.register("rc")
def router_clustering(inp: GroupingInputs, k: int) -> list[list[int]]:
    """Average-linkage on cosine distance of the router weight rows."""
    return _clusters_to_ids(inp, average_linkage(cosine_distance(inp.router_rows), k))


@GROUPINGS.register("ab")
def anchor_based(inp: GroupingInputs, k: int) -> list[list[int]]:
    """MC-SMoE: the k best-scored experts anchor; every other one joins its most router-similar anchor."""
    ranked = inp.ranked()
    anchors, rest = ranked[:k], ranked[k:]
    router = inp.router().double()
    sim = 1.0 - cosine_distance(router[anchors + rest])[len(anchors) :, : len(anchors)]
    groups = [[a] for a in anchors]
    for i, e in enumerate(rest):
        groups[int(sim[i].argmax())].append(e)
    return groups


@GROUPINGS.register("oc")
def output_clustering(inp: GroupingInputs, k: int) -> list[list[int]]:
    """HC-SMoE: average-linkage on 1 - rho, rho_ij = G_ij / sqrt(G_ii G_jj) (output cosine)."""
    idx = torch.tensor(inp.selected)
    G = inp.gram.double()[idx][:, idx]
    d = torch.diagonal(G).clamp(min=0).sqrt()
    rho = G / (d[:, None] * d[None, :]).clamp(min=1e-300)
    dist = (1.0 - rho).clamp(min=0.0)
    dist.fill_diagonal_(0.0)
    return _clusters_to_ids(inp, average_linkage(dist, k))


def group(name: str, inp: GroupingInputs, k: int) -> list[list[int]]:
    """Exactly k non-empty groups, canonically ordered (see module docstring)."""
    if not 1 <= k <= len(inp.selected):
        raise ValueError(f"cannot split {len(inp.selected)} experts into {k} groups")
    groups = GROUPINGS[name](inp, k)
    rank = {e: r for r, e in enumerate(inp.ranked())}
    groups = [sorted(g, key=rank.__getitem__) for g in groups]
    groups.sort(key=lambda g: rank[g[0]])
    if len(groups) != k or any(not g for g in groups) or sorted(sum(groups, [])) != sorted(inp.selected):
        raise AssertionError(f"grouping {name} produced an invalid partition: {groups}")
    return groups
