"""CUDA-only choices, imported only when a worker has a GPU (flash-attn is the optional [gpu] extra)."""

from __future__ import annotations

import importlib.util


def attention_implementation() -> str:
    """FlashAttention-2 when the flash_attn package is installed (the paper's setting), else PyTorch SDPA."""
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"
