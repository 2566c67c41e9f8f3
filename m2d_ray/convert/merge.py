"""Pure tensor operations of the conversion: score-weighted merge, scaling, block concatenation.

Concatenating k SwiGLU experts along the hidden dimension, with the down projections scaled by
alpha_g, gives one FFN whose output is exactly sum_g alpha_g f_g(h) (the activation acts per hidden
unit). These functions compute in float64 and leave the cast to the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from m2d_ray.arch.base import DenseFFN, ExpertWeights, SharedExpert


def merge_weights(scores: Tensor, members: Sequence[int]) -> Tensor:
    """Normalised merge coefficients s_e / sum_g s (uniform when the group's scores sum to zero)."""
    s = scores[list(members)].double().clamp(min=0)
    total = s.sum()
    return s / total if total > 0 else torch.full_like(s, 1.0 / len(members))


def merge_group(w: ExpertWeights, members: Sequence[int], coef: Tensor) -> ExpertWeights:
    """Score-weighted average of the members' gate/up/down (and biases) -> one expert (E == 1)."""
    sub = w.select(list(members)).to(torch.float64)
    c = coef.to(torch.float64)

    def avg(t: Tensor | None) -> Tensor | None:
        return None if t is None else torch.tensordot(c, t, dims=([0], [0])).unsqueeze(0)

    return ExpertWeights(
        gate=avg(sub.gate),
        up=avg(sub.up),
        down=avg(sub.down),
        act=w.act,
        gate_bias=avg(sub.gate_bias),
        up_bias=avg(sub.up_bias),
        down_bias=avg(sub.down_bias),
    )


def concat_groups(groups: Sequence[ExpertWeights], alphas: Sequence[float]) -> DenseFFN:
    """Rows-concat gate/up, columns-concat alpha_g * down: output = sum_g alpha_g f_g(h) exactly."""
    if len(groups) != len(alphas):
        raise ValueError("one alpha per group")
    gate = torch.cat([g.gate[0] for g in groups], dim=0)
    up = torch.cat([g.up[0] for g in groups], dim=0)
    down = torch.cat([a * g.down[0] for g, a in zip(groups, alphas)], dim=1)
    biased = groups[0].gate_bias is not None
    return DenseFFN(
        gate=gate,
        up=up,
        down=down,
        act=groups[0].act,
        gate_bias=torch.cat([g.gate_bias[0] for g in groups]) if biased else None,
        up_bias=torch.cat([g.up_bias[0] for g in groups]) if biased else None,
        down_bias=(
            sum(a * g.down_bias[0] for g, a in zip(groups, alphas)) if groups[0].down_bias is not None else None
        ),
    )


def append_shared(ffn: DenseFFN, shared: SharedExpert, scale: float) -> DenseFFN:
    """Concatenate the layer's shared expert(s) after the routed groups, scaled by `scale`."""
    sw = shared.weights.to(torch.float64)
    if ffn.gate_bias is not None or sw.gate_bias is not None:
        raise ValueError("shared experts with biases are not supported")
    return DenseFFN(
        gate=torch.cat([ffn.gate, sw.gate[0]]),
        up=torch.cat([ffn.up, sw.up[0]]),
        down=torch.cat([ffn.down, scale * sw.down[0]], dim=1),
        act=ffn.act,
        down_bias=ffn.down_bias,
    )


def cast_ffn(ffn: DenseFFN, dtype: torch.dtype) -> DenseFFN:
    def c(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(dtype).contiguous()

    return DenseFFN(
        gate=c(ffn.gate),
        up=c(ffn.up),
        down=c(ffn.down),
        act=ffn.act,
        gate_bias=c(ffn.gate_bias),
        up_bias=c(ffn.up_bias),
        down_bias=c(ffn.down_bias),
    )
