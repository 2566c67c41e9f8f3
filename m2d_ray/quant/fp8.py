"""Fine-grained FP8 (`quant_method: fp8`): a weight [..., R, C] stored in float8 (e4m3 or e5m2) with a scale per
block of `weight_block_size` [bm, bn], `weight_scale_inv` [..., ceil(R / bm), ceil(C / bn)] (float32, or ue8m0
powers of two; the edge blocks are partial). The value is weight x scale: transformers' `_dequantize_fp8_weight`
(integrations/finegrained_fp8.py) and DeepSeek's `weight_dequant` read it so.

`dequantize_blocks` is the one block-scale product every 8-bit format here uses (compressed-tensors' tensor,
channel, group and block scales are blocks of other shapes)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def scale_key(key: str) -> str:
    """The scale beside a stored weight: `x.weight` -> `x.weight_scale_inv`; a fused `x.gate_up_proj` ->
    `x.gate_up_proj_scale_inv` (transformers' Fp8Quantize names them so)."""
    return key + "_scale_inv"


def scales_as_float(scale: Tensor) -> Tensor:
    """Scales in float32: ue8m0 (float8_e8m0fnu) and float ones by value, raw e8m0 bytes (uint8) as 2^(b - 127)."""
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones(scale.shape), scale.to(torch.int32) - 127)
    return scale.to(torch.float32)


def block_of(shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, int]:
    """The [bm, bn] block the scales of a weight of `shape` cover: `block` when given (the config's), else the one
    the scale grid divides the weight into exactly (a scale per tensor, channel or group). ValueError when the
    grid does not fit the weight."""
    R, C = shape[-2:]
    if math.prod(scale_shape) == 1:
        sr, sc = 1, 1  # one scale for the tensor
    elif len(scale_shape) == 1:
        sr, sc = scale_shape[0], 1  # one per output channel, stored flat
    else:
        sr, sc = scale_shape[-2:]
    if block is None:
        if R % sr or C % sc:
            raise ValueError(f"a scale grid [{sr}, {sc}] does not divide a weight [{R}, {C}]")
        return R // sr, C // sc
    bm, bn = block
    if (sr, sc) != (-(-R // bm), -(-C // bn)):
        raise ValueError(f"scales [{sr}, {sc}] do not cover a weight [{R}, {C}] in [{bm}, {bn}] blocks")
    return bm, bn


def dequantize_blocks(q: Tensor, scale: Tensor, block: tuple[int, int] | None, dtype: torch.dtype) -> Tensor:
    """weight x its block's scale, in float32 (each product correctly rounded), then cast to `dtype`.

    q [..., R, C] (any leading dims: a fused [E, R, C] expert tensor has a scale grid per expert); scale
    [..., ceil(R / bm), ceil(C / bn)], or one per tensor / per channel (`block_of`). No weight-sized copy of the
    scales: they are expanded over rows and broadcast over a view of the weight's columns."""
    R, C = q.shape[-2:]
    bm, bn = block_of(tuple(q.shape), tuple(scale.shape), block)
    s = scales_as_float(scale)
    s = s.reshape(*q.shape[:-2], -(-R // bm), -(-C // bn)) if s.numel() > 1 else s.reshape(1, 1)
    w = q.to(torch.float32)
    rows = s.repeat_interleave(bm, dim=-2)[..., :R, :]  # [..., R, column blocks]
    full, rem = divmod(C, bn)
    w[..., : full * bn].unflatten(-1, (full, bn)).mul_(rows[..., :full, None])
    if rem:
        w[..., full * bn :].mul_(rows[..., full:])
    return w.to(dtype)
