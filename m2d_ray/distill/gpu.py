"""CUDA-only choices, imported only when a worker has a GPU (flash-attn is the optional [gpu] extra)."""

from __future__ import annotations

import importlib.util

import torch

from m2d_ray import measured

#: the student's attention implementations a GPU may run (transformers' names)
ATTENTION = ("sdpa", "flash_attention_2")


def attention_implementation() -> str:
    """The student's attention on this GPU: the implementation the last GPU acceptance call measured fastest for the
    paper student's step on this card (m2d_ray/measured_gpu.json, "attention"), where it can run here; else
    FlashAttention-2 when the flash_attn package is installed (the paper's setting), else PyTorch SDPA. A measurement
    on another card says nothing of this one."""
    flash = importlib.util.find_spec("flash_attn") is not None
    entry = measured.gpu().attention or {}
    chosen = entry.get("implementation")
    if chosen in ATTENTION and entry.get("device") == torch.cuda.get_device_name() and (chosen == "sdpa" or flash):
        return chosen
    return "flash_attention_2" if flash else "sdpa"
