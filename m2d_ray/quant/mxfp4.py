"""MXFP4 (`quant_method: mxfp4`, gpt-oss's experts): a weight stored as `<name>_blocks` [..., R, G, 16] uint8, two
e2m1 values a byte (low nibble first), and `<name>_scales` [..., R, G] uint8, an e8m0 exponent (2^(s - 127)) per
32 values; the row [R, G * 32] dequantised is transposed into the in-memory layout [..., G * 32, R], as
transformers' `convert_moe_packed_tensors` (integrations/mxfp4.py) does for gpt-oss's fused experts."""

from __future__ import annotations

import torch
from torch import Tensor

#: the sixteen e2m1 values by nibble
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight of `blocks` and `scales` in `dtype` (exact: every value is e2m1 x a power of two), transposed
    over its last two dims as the model holds it."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    out = torch.empty(*b.shape[:-1], b.shape[-1] * 2, dtype=torch.float32)
    out[..., 0::2] = lut[(b & 0x0F).long()]
    out[..., 1::2] = lut[(b >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return out.flatten(-2).transpose(-1, -2).contiguous().to(dtype)
