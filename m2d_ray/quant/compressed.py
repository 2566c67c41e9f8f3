"""compressed-tensors (`quant_method: compressed-tensors`, llm-compressor's output) with 8-bit weights
(`float-quantized`: float8_e4m3fn; `int-quantized` / `naive-quantized`: int8), symmetric: a weight [R, C] beside
its `weight_scale` per tensor ([1]), per output channel ([R, 1]), per group ([R, C / g]) or per block
([ceil(R / bh), ceil(C / bw)], `block_structure`). The value is weight x scale (compressed-tensors' `dequantize`:
`_dequantize` of x_q x scale, `_process_block` for blocks): the block-scale product of `quant.fp8`."""

from __future__ import annotations


def scale_key(key: str) -> str:
    """`x.weight` -> `x.weight_scale`; a fused `x.gate_up_proj` -> `x.gate_up_proj_scale`."""
    return key + "_scale"
