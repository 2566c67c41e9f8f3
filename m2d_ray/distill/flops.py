"""Model FLOPs per training token of a distillation step, and the device's measured matmul rate: MFU.

FLOPs count matrix products (2 per multiply-add) over every weight a token passes through (the input
embedding is a lookup, not a product) plus causal attention (QK^T and AV over half the sequence on
average): the teacher's forward with only its k' active experts, plus the student's forward and
backward (3x its forward). Recomputation under gradient checkpointing is not counted (the usual MFU).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

from m2d_ray.arch.counts import attention_widths

# Imported inside functions: torch (`m2d plan` counts FLOPs from shapes with this module and imports no torch).


def matmul_params(model: nn.Module) -> int:
    """Weights a token is multiplied with: every matrix but the input embedding (unless it is tied to the
    head); norm gains and biases are elementwise."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p.ndim >= 2) - (emb.numel() if emb is not head else 0)


def attention_flops(config, seq_len: int) -> float:
    """Forward FLOPs per token of causal attention over `seq_len` positions, all layers."""
    return causal_attention_flops(attention_widths(config)[0], config.num_hidden_layers, seq_len)


def causal_attention_flops(q_width: int, layers: int, seq_len: int) -> float:
    """QK^T and AV of one token over half of `seq_len` positions on average, 2 FLOPs a multiply-add: what a
    plan counts from a model's shape alone."""
    return 2.0 * seq_len * q_width * layers


def inactive_expert_params(model: nn.Module, adapter, top_k: int) -> int:
    """Expert weights a token skips: (E - k') experts in every MoE layer."""
    out = 0
    for block in adapter.moe_blocks(model).values():
        w = adapter.experts(block)
        out += (w.num_experts - top_k) * sum(t[0].numel() for t in (w.gate, w.up, w.down))
    return out


def _inactive(teacher: nn.Module, adapter, teacher_topk: int | None) -> int:
    """Expert weights a token skips at k' (none in a dense teacher: `adapter` None)."""
    return (
        0
        if adapter is None
        else inactive_expert_params(teacher, adapter, teacher_topk or adapter.top_k(teacher.config))
    )


def active_params(teacher: nn.Module, adapter, teacher_topk: int | None = None) -> int:
    """Teacher parameters a token uses (every parameter but the skipped experts): the matched-parameter table's."""
    return sum(p.numel() for p in teacher.parameters()) - _inactive(teacher, adapter, teacher_topk)


def flops_per_token(
    teacher: nn.Module,
    adapter,
    student: nn.Module,
    seq_len: int,
    teacher_topk: int | None = None,
    teacher_forward: bool = True,
) -> float:
    """Model FLOPs of one training token: teacher forward (k' experts; a dense teacher: all of it; none when
    its targets were cached) + student forward and backward."""
    t = 2.0 * (matmul_params(teacher) - _inactive(teacher, adapter, teacher_topk)) + attention_flops(
        teacher.config, seq_len
    )
    t = t if teacher_forward else 0.0
    s = 2.0 * matmul_params(student) + attention_flops(student.config, seq_len)
    return t + 3.0 * s


def matmul_rate(
    device: str | torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 10, budget_s: float = 0.5
) -> float:
    """Measured FLOP/s of an n x n matmul in the training dtype on this device (best of up to `repeats` timings, at
    least three, within about `budget_s`, so that a burst of other work does not lower it): the MFU denominator. What
    the device really reaches, so an MFU against it is a little above one against a data sheet. Bounded in time, not
    in matmuls: a CPU without bfloat16 units runs a bf16 matmul ~50x slower than float32 (0.8 against 53 GFLOP/s
    here at n = 1024, where a fixed 41 matmuls took 116 s)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    n = n or (8192 if cuda else 512)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a @ b
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 3 or (runs < repeats and spent < budget_s):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        took = time.perf_counter() - t0
        best, spent, runs = min(best, took), spent + took, runs + 1
    return 2.0 * n**3 / best
