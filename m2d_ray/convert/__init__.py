"""Conversion: plan (select, group, scale) -> merge -> concatenate -> dense student."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from m2d_ray.arch.base import DenseFFN, MoEAdapter
from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.convert.merge import append_shared, concat_groups, merge_group
from m2d_ray.convert.plan import ConversionPlan, LayerPlan, make_plan
from m2d_ray.convert.student import build_student

__all__ = ["convert", "layer_ffn", "build_from_plan", "make_plan", "ConversionPlan"]


def layer_ffn(adapter: MoEAdapter, block: torch.nn.Module, plan: LayerPlan) -> DenseFFN:
    """The dense FFN of one layer in float64: merged groups, concatenated, plus shared experts."""
    experts = adapter.experts(block)
    merged = [merge_group(experts, g, torch.tensor(c, dtype=torch.float64)) for g, c in zip(plan.groups, plan.coefs)]
    ffn = concat_groups(merged, plan.alphas)
    shared = adapter.shared(block)
    if shared is not None:
        ffn = append_shared(ffn, shared, plan.shared_scale)
    return ffn


def build_from_plan(teacher, plan: ConversionPlan) -> PreTrainedModel:
    blocks = teacher.adapter.moe_blocks(teacher.model)
    ffns = {i: layer_ffn(teacher.adapter, blocks[i], p) for i, p in plan.layers.items()}
    return build_student(teacher.model, teacher.adapter, ffns)


def convert(teacher, stats: dict[int, LayerStats], scoring: str, grouping: str, scaling: str, K: int) -> tuple[PreTrainedModel, ConversionPlan]:
    """Dense student of `teacher` for one (scoring, grouping, scaling, K) recipe."""
    plan = make_plan(teacher, stats, scoring, grouping, scaling, K)
    return build_from_plan(teacher, plan), plan
