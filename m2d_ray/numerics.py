"""Numerics shared by every layer that forms a model's logits from its hidden states, and takes their gradients.

The output head is the largest matmul of a student (Qwen3: vocabulary 151,936 x hidden 2048) and runs three times a
step: the logits h @ W.T, and in backward grad_h = g @ W and grad_W = g.T @ h. All three take the model's own
operands (bfloat16 on a GPU: tensor cores) and accumulate in float32, with no float32 copy of the head (1.24 GB at
Qwen3's head, per chunk of tokens): `torch.mm(..., out_dtype=float32)` on CUDA. The logits' gradient is rounded to
the compute dtype once, before the two gradient matmuls (as Liger Kernel and Megatron do); a bfloat16 product is exact
in float32, so elsewhere the operands are widened first and the same numbers come out. float32 and float64 operands
multiply in their own precision (float64 stays float64: the references the losses are held to).

`tensor_cores` is the one seam of the CUDA-only branches: tests force it on `meta` tensors (autograd and the
out_dtype ops' shape and dtype rules do not depend on the device), so those branches run on a CPU.

The head stays eager under torch.compile: `logits` and the chunked losses (distill/losses.py) are `eager`, so a
compiled caller's graph stops at the head (a graph break) and the head's products still take bfloat16 operands on the
tensor cores. `eager` applies `torch.compiler.disable` when a compiler traces the call, not at import: the decorator
imports torch._dynamo (1.35 s, as long as torch itself), which a process that compiles nothing (`m2d plan`, a Ray
worker that imports the loss) never needs. Traced, they would not: Dynamo's fake-tensor pass of torch 2.11
breaks on addmm(..., out_dtype=, out=) (seen on an H200, 2026-11-28), and widening the operands
instead made the compiled path four float32 GEMMs with [V, d] float32 copies of the head.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

#: the installed torch's (major, minor)
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
#: torch.mm(..., out_dtype=) (CUDA, torch >= 2.8): a bfloat16 product accumulated and returned in float32
MM_OUT_DTYPE = TORCH_VERSION >= (2, 8)
#: the first torch whose CUDA addmm(self, a, b, out_dtype=) takes a `self` in out_dtype (float32) with bfloat16
#: operands (pytorch#167931, merged 2025-11); before it the kernel wants `self` in the operands' dtype
#: (pytorch#154086), so accumulating into a float32 `out` is a product then an add
ADDMM_WIDE_SELF = (2, 10)
LOW = (torch.bfloat16, torch.float16)


def eager(fn):
    """`fn`, never traced by torch.compile: called from a compiled caller, it is `torch.compiler.disable`d then (a
    graph break; it runs eagerly), so importing it imports no torch._dynamo; called eagerly, it is `fn` itself."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # only ever true under Dynamo, which is imported by then
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def tensor_cores(t: Tensor) -> bool:
    """Whether a matmul of `t`'s device returns a low-precision product in float32 itself (CUDA, torch >= 2.8)."""
    return t.is_cuda and MM_OUT_DTYPE


def _wide(a: Tensor, b: Tensor) -> torch.dtype:
    """The precision a product of a and b accumulates in: float32 at least, float64 when either is."""
    return torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)


def mm32(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b accumulated in float32 (float64 when an operand is), returned, or added into `out` (of that dtype) and
    returned. Low-precision operands of one dtype go to the tensor cores as they are where `tensor_cores`; elsewhere
    they are widened first (the same products). Into `out` with one addmm from torch 2.10 (`ADDMM_WIDE_SELF`), else
    a product then an add (one [m, n] float32 temporary). Eager only: callers reach it through `logits` and the
    chunked losses, which torch.compile does not trace (module docstring)."""
    wide = _wide(a, b)
    if a.dtype == b.dtype and a.dtype in LOW and tensor_cores(a):
        if out is None:
            return torch.mm(a, b, out_dtype=wide)
        if TORCH_VERSION >= ADDMM_WIDE_SELF:
            return torch.addmm(out, a, b, out_dtype=wide, out=out)
        return out.add_(torch.mm(a, b, out_dtype=wide))
    a, b = a.to(wide), b.to(wide)
    return a @ b if out is None else out.addmm_(a, b)


def head_grads(g: Tensor, h: Tensor, w: Tensor, grad_w: Tensor | None = None, need_w: bool = True):
    """(grad_h, grad_w) of logits = h @ w.T for the logits' gradient g [n, V]: grad_h [n, d] in h's dtype; grad_w
    [V, d] added into the float32 accumulator `grad_w` (and returned) when given, else in w's dtype, or None when
    not `need_w`. g is rounded to the operands' dtype first (their own precision: tensor cores on a GPU)."""
    gc = g.to(h.dtype) if h.dtype == w.dtype else g
    grad_h = mm32(gc, w).to(h.dtype)
    if grad_w is not None:
        return grad_h, mm32(gc.T, h, out=grad_w)
    return grad_h, mm32(gc.T, h).to(w.dtype) if need_w else None


class _Logits(torch.autograd.Function):
    """h @ w.T in float32 (float64 for float64 operands), with `head_grads` for its backward: autograd has no
    derivative for torch.mm(..., out_dtype=)."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(h, w)
        return mm32(h, w.T)

    @staticmethod
    def backward(ctx, g: Tensor):
        h, w = ctx.saved_tensors
        grad_h, grad_w = head_grads(g, h, w, need_w=ctx.needs_input_grad[1])
        return (grad_h if ctx.needs_input_grad[0] else None), grad_w


@eager
def logits(h: Tensor, w: Tensor) -> Tensor:
    """The logits h [n, d] @ w [V, d].T in float32 (float64 for float64 operands), never rounded to a lower precision
    on the way: the KL and its gradient are differences of nearly equal distributions, and a bfloat16 logit of 20 is
    off by up to 0.06 (6% in its probability). Differentiable on every device, and never traced by torch.compile (see
    the module docstring)."""
    if h.dtype == w.dtype and h.dtype in (torch.float32, torch.float64):
        return h @ w.T
    return _Logits.apply(h, w)
