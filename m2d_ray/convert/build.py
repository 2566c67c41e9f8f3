"""One dense student from a conversion plan: merge -> concatenate -> build.

Every step takes the teacher as a `models.Teacher` (loaded) or a `weights.LazyTeacher` (weights read on
demand): a layer reads only the experts its plan merges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from m2d_ray.arch.base import DenseFFN, ExpertWeights
from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.convert.merge import append_shared, cast_ffn, concat_groups, merge_group
from m2d_ray.convert.plan import ConversionPlan, LayerPlan, make_plan
from m2d_ray.convert.student import build_student

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["convert", "layer_ffn", "merged_groups", "build_from_plan", "make_plan", "ConversionPlan"]


def merged_groups(teacher, layer: int, plan: LayerPlan) -> list[ExpertWeights]:
    """The score-weighted merge of each group of one layer, in float64 (reads only the grouped experts)."""
    needed = sorted({e for g in plan.groups for e in g})
    experts = teacher.experts(layer, needed)
    pos = {e: j for j, e in enumerate(needed)}
    return [
        merge_group(experts, [pos[e] for e in g], torch.tensor(c, dtype=torch.float64))
        for g, c in zip(plan.groups, plan.coefs)
    ]


def layer_ffn(teacher, layer: int, plan: LayerPlan) -> DenseFFN:
    """The dense FFN of one layer in float64: merged groups, concatenated, plus shared experts."""
    ffn = concat_groups(merged_groups(teacher, layer, plan), plan.alphas)
    shared = teacher.shared(layer)
    if shared is not None:
        ffn = append_shared(ffn, shared, plan.shared_scale)
    return ffn


def build_from_plan(teacher, plan: ConversionPlan) -> PreTrainedModel:
    """The student of `plan`; each layer's float64 FFN is cast to the teacher's dtype as soon as it is made."""
    ffns = {i: cast_ffn(layer_ffn(teacher, i, p), teacher.dtype) for i, p in plan.layers.items()}
    return build_student(teacher, ffns)


def convert(
    teacher, stats: dict[int, LayerStats], scoring: str, grouping: str, scaling: str, K: int
) -> tuple[PreTrainedModel, ConversionPlan]:
    """Dense student of `teacher` for one (scoring, grouping, scaling, K) recipe."""
    plan = make_plan(teacher, stats, scoring, grouping, scaling, K)
    return build_from_plan(teacher, plan), plan
