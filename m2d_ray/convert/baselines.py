"""Baseline students of the same shape as a converted one: random FFN (teacher attention kept) and
random init (nothing kept). They bound what the MoE-derived initialisation buys after distillation."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from m2d_ray.arch import auto_class
from m2d_ray.arch.base import DenseFFN
from m2d_ray.catalog.methods import RANDOM_BASELINES
from m2d_ray.convert.student import build_student, student_width

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Imported inside functions: transformers' model classes (seconds of modelling code; `m2d plan` reads this module
# without building a model).


def dense_width(teacher) -> int:
    """k * d_expert plus the width of the shared experts: the converted student's MoE-layer width."""
    adapter = teacher.adapter
    block = next(iter(adapter.moe_blocks(teacher.skeleton).values()))  # shapes only
    shared = adapter.shared(block)
    return adapter.top_k(teacher.config) * adapter.experts(block).width + (shared.weights.width if shared else 0)


def _random_ffn(teacher, width: int, gen: torch.Generator) -> DenseFFN:
    d = teacher.config.get_text_config().hidden_size
    std = float(getattr(teacher.config, "initializer_range", 0.02))
    layout = teacher.adapter.experts(next(iter(teacher.adapter.moe_blocks(teacher.skeleton).values())))

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64) * std

    def zeros(n):
        return torch.zeros(n, dtype=torch.float64) if layout.gate_bias is not None else None

    return DenseFFN(
        gate=rnd(width, d),
        up=rnd(width, d),
        down=rnd(d, width),
        act=layout.act,
        gate_bias=zeros(width),
        up_bias=zeros(width),
        down_bias=zeros(d),
    )


@RANDOM_BASELINES.register("random-ffn")
def random_ffn_student(teacher, seed: int = 0) -> PreTrainedModel:
    """Teacher attention, embeddings, norms and head; every MoE FFN freshly initialised."""
    gen = torch.Generator().manual_seed(seed)
    width = dense_width(teacher)
    ffns = {i: _random_ffn(teacher, width, gen) for i in teacher.moe_layers()}
    return build_student(teacher, ffns)


@RANDOM_BASELINES.register("random-init")
def random_init_student(teacher, seed: int = 0) -> PreTrainedModel:
    """The student architecture with every weight freshly initialised (transformers' own init)."""
    width = student_width(teacher.skeleton, teacher.adapter, dense_width(teacher))
    config = teacher.adapter.dense_config(teacher.config, width)
    torch.manual_seed(seed)
    return auto_class(config).from_config(config, dtype=teacher.dtype).eval()
