"""Numerics shared by every layer that forms a model's logits from its hidden states."""

from __future__ import annotations

import torch
from torch import Tensor

#: torch.mm(..., out_dtype=) (CUDA, torch >= 2.8): a bfloat16 product accumulated and returned in float32
MM_OUT_DTYPE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def logits(h: Tensor, w: Tensor) -> Tensor:
    """The float32 logits h @ w.T, never rounded to a lower precision on the way: the KL and its gradient are
    differences of nearly equal distributions, and a bfloat16 logit of 20 is off by up to 0.06 (6% in its
    probability). On a GPU a bfloat16 product is returned in float32 by the matmul itself (same tensor-core speed);
    elsewhere the operands are widened first. float32 and float64 operands multiply in their own precision."""
    if h.dtype == w.dtype and h.dtype in (torch.float32, torch.float64):
        return (h @ w.T).float()
    if h.is_cuda and h.dtype == w.dtype and MM_OUT_DTYPE:
        return torch.mm(h, w.T, out_dtype=torch.float32)
    return h.float() @ w.float().T
