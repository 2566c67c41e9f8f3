"""Distillation losses, computed token chunk by token chunk from the final hidden states.

A [tokens x vocab] float32 tensor is never held whole (Qwen3's vocabulary is 151,936): for each
chunk of tokens the student and teacher logits `h @ W.T` are formed, the loss and its gradient with
respect to the student logits are computed in float32, and the gradient is pushed straight back to
the hidden states and the output projection. Backward then only rescales the stored gradients.

With temperature t the loss is t^2 * KL at logits / t (Hinton et al.), so gradients keep their size.
    fkl: KL(p_teacher || p_student)  (the paper's default)
    rkl: KL(p_student || p_teacher)
From cached teacher targets (targets.py; forward KL only, the teacher's full distribution is gone):
    sparse_kl:  KL over K+1 buckets (the teacher's top-K ids and one tail bucket for every other token);
    sampled_kl: Sparse Logit Sampling (Anshumann et al., ACL 2025): N draws from the teacher give an unbiased
                estimate of the dense forward KL's gradient.
Losses are means over the tokens given (the caller drops padding before calling).
The three losses are never traced by torch.compile (`numerics.eager`): a compiled student's graph stops at
its final hidden states and the head runs eagerly on the tensor cores (m2d_ray/numerics.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from m2d_ray.catalog.distill import LOSSES  # noqa: F401  (declared there; importers of losses.LOSSES keep working)
from m2d_ray.numerics import LOW, eager, head_grads, logits


def _fkl(ls: Tensor, lt: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token KL(t || s) and its gradient w.r.t. the student logits (p_s - p_t); overwrites ls and lt."""
    pt = lt.exp()
    kl = (pt * lt.sub_(ls)).sum(-1)
    return kl, ls.exp_().sub_(pt)


def _rkl(ls: Tensor, lt: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token KL(s || t) and its gradient w.r.t. the student logits p_s * (log p_s - log p_t - KL);
    overwrites ls."""
    ps = ls.exp()
    diff = ls.sub_(lt)
    kl = (ps * diff).sum(-1)
    return kl, diff.sub_(kl[:, None]).mul_(ps)


DIVERGENCES: dict[str, Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]] = {"fkl": _fkl, "rkl": _rkl}


def log_probs(h: Tensor, w: Tensor, t: float) -> Tensor:
    """float32 log-softmax (float64 for float64 operands) of the logits h @ w.T at temperature t (the division
    skipped at t = 1)."""
    z = logits(h, w)
    return torch.log_softmax(z if t == 1.0 else z.div_(t), dim=-1)


class _Chunked(torch.autograd.Function):
    """t^2 x the mean over tokens of a per-token loss of the student log-probs, chunk by chunk.

    `per_chunk(start, ls)` gets the student's log-probs of tokens start.. (a [chunk, V] float32 tensor it
    may overwrite) and returns their losses [chunk] and the gradients w.r.t. the logits at temperature t.
    """

    @staticmethod
    def forward(
        ctx,
        h_s: Tensor,
        w_s: Tensor,
        per_chunk: Callable[[int, Tensor], tuple[Tensor, Tensor]],
        temperature: float,
        chunk: int,
    ) -> Tensor:
        n = h_s.shape[0]
        grad_h = torch.empty_like(h_s)
        wide = torch.promote_types(w_s.dtype, torch.float32)  # the head's gradient summed over chunks in float32
        grad_w = torch.zeros(w_s.shape, dtype=wide, device=w_s.device) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float64, device=h_s.device)
        t = float(temperature)
        for s in range(0, n, chunk):
            hs = h_s[s : s + chunk]
            kl, g = per_chunk(s, log_probs(hs, w_s, t))
            total += kl.double().sum()
            g.mul_(t / n)  # d(t^2 * mean KL(z / t)) / dz = t / n * dKL
            grad_h[s : s + chunk] = head_grads(g, hs, w_s, grad_w, need_w=False)[0]  # grad_w summed in place
            del kl, g
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.w_dtype = w_s.dtype
        return (total * (t * t) / max(n, 1)).to(torch.float32)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        """The stored gradients times grad_out (float32; 1 / grad_accum under accumulation) in float32, rounded once
        to the parameters' dtype. A bfloat16 head's float32 accumulator [V, d] is scaled in place, then rounded (no
        second [V, d] float32 tensor), so a second backward through the same graph (retain_graph) is refused there by
        autograd's in-place check; float32 and float64 ones (gradcheck's) are left as they are."""
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h.float().mul_(grad_out).to(grad_h.dtype) if grad_h.dtype in LOW else grad_h * grad_out
        gw = None
        if ctx.needs_input_grad[1]:
            gw = grad_w.mul_(grad_out).to(ctx.w_dtype) if ctx.w_dtype in LOW else grad_w * grad_out
        return gh, gw, None, None, None


@eager  # the head stays eager with its bfloat16 products (numerics' docstring)
def chunked_kl(
    h_s: Tensor, w_s: Tensor, h_t: Tensor, w_t: Tensor, kind: str = "fkl", temperature: float = 1.0, chunk: int = 1024
) -> Tensor:
    """Mean per-token divergence between softmax(h_s @ w_s.T) and softmax(h_t @ w_t.T), chunked.

    h_s [N, d] student hidden states (after the final norm), w_s [V, d] the student's output
    projection; h_t, w_t the teacher's (no gradient). Peak extra memory ~ 4 x chunk x V floats.
    """
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}")
    div, h_t, w_t, t = DIVERGENCES[kind], h_t.detach(), w_t.detach(), float(temperature)
    return _Chunked.apply(
        h_s, w_s, lambda s, ls: div(ls, log_probs(h_t[s : s + ls.shape[0]], w_t, t)), t, max(1, int(chunk))
    )


def _sparse_chunk(ids: Tensor, logp: Tensor, tail: Tensor) -> Callable[[int, Tensor], tuple[Tensor, Tensor]]:
    """Per-chunk KL(q || P) over the buckets {each of the K ids} + {tail}, P the student's bucket masses.

    With sum_b q_b = 1 the gradient w.r.t. the logit z_j is p_j - q_b(j) p_j / P_b(j): p_j - q_j for j
    among the ids, p_j - q_tail * p_j / P_tail for a tail token (p_j / P_tail formed as
    exp(log p_j - log P_tail), finite however small P_tail is). The teacher's bucket log-probs are
    renormalised in float32: fp16 rounding of the stored log-probs would otherwise leave a gradient that
    does not sum to zero (the loss is invariant to a shift of the logits, its gradient must be too).
    """

    def per_chunk(s: int, ls: Tensor) -> tuple[Tensor, Tensor]:
        rows = slice(s, s + ls.shape[0])
        idx = ids[rows].long()
        logq = torch.cat([logp[rows].float(), tail[rows, None].float()], dim=1)
        logq = logq - logq.logsumexp(-1, keepdim=True)
        q = logq.exp()
        ls_ids = ls.gather(1, idx)
        log_tail = ls.scatter_(1, idx, -math.inf).logsumexp(-1)  # -inf when the ids cover the vocabulary
        kl = torch.where(q > 0, q * (logq - torch.cat([ls_ids, log_tail[:, None]], dim=1)), 0.0).sum(-1)
        in_tail = ls.sub(
            torch.where(torch.isfinite(log_tail), log_tail, 0.0)[:, None]
        ).exp_()  # p_j / P_tail; 0 at the ids
        g = ls.exp_().sub_(in_tail.mul_(q[:, -1:]))
        return kl, g.scatter_(1, idx, ls_ids.exp() - q[:, :-1])

    return per_chunk


@eager
def sparse_kl(
    h_s: Tensor, w_s: Tensor, ids: Tensor, logp: Tensor, tail: Tensor, temperature: float = 1.0, chunk: int = 1024
) -> Tensor:
    """Mean forward KL from cached top-K targets: the teacher's distribution coarse-grained to K+1 buckets
    (ids [N, K] distinct token ids, logp [N, K] their log-probs, tail [N] the log of the remaining mass)
    against the student's on the same buckets; the dense forward KL when K = V. Temperature and memory as
    `chunked_kl` (~2 x chunk x V floats)."""
    return _Chunked.apply(h_s, w_s, _sparse_chunk(ids, logp, tail), float(temperature), max(1, int(chunk)))


def _sampled_chunk(ids: Tensor, counts: Tensor, logp: Tensor) -> Callable[[int, Tensor], tuple[Tensor, Tensor]]:
    """Per-chunk estimate sum_j w_j (log p_t,j - log p_s,j), w = counts / N, and its gradient p_s - w
    (whose expectation over the draws is p_s - p_t, the dense forward KL's)."""

    def per_chunk(s: int, ls: Tensor) -> tuple[Tensor, Tensor]:
        rows = slice(s, s + ls.shape[0])
        idx, c = ids[rows].long(), counts[rows].to(ls.dtype)  # float32, or float64 for a float64 reference
        w = c / c.sum(-1, keepdim=True).clamp_min(1.0)
        kl = torch.where(w > 0, w * (logp[rows].to(ls.dtype) - ls.gather(1, idx)), 0.0).sum(-1)  # padding: w = 0
        return kl, ls.exp_().scatter_add_(1, idx, -w)

    return per_chunk


@eager
def sampled_kl(
    h_s: Tensor, w_s: Tensor, ids: Tensor, counts: Tensor, logp: Tensor, temperature: float = 1.0, chunk: int = 1024
) -> Tensor:
    """Mean forward KL from N cached draws per token (Sparse Logit Sampling): ids [N_tok, N] the distinct
    drawn ids, counts [N_tok, N] how often each was drawn (0 = padding), logp [N_tok, N] their teacher
    log-probs. Value and gradient are unbiased estimates of the dense forward KL's. Temperature and memory
    as `chunked_kl` (~1 x chunk x V floats)."""
    return _Chunked.apply(h_s, w_s, _sampled_chunk(ids, counts, logp), float(temperature), max(1, int(chunk)))


def naive_kl(logits_s: Tensor, logits_t: Tensor, kind: str = "fkl", temperature: float = 1.0) -> Tensor:
    """Reference: the same divergence on whole [N, V] logits (what the chunked form must equal)."""
    ls = torch.log_softmax(logits_s.float() / temperature, dim=-1)
    lt = torch.log_softmax(logits_t.float() / temperature, dim=-1)
    a, b = (lt, ls) if kind == "fkl" else (ls, lt)
    return temperature**2 * F.kl_div(b, a, log_target=True, reduction="batchmean")


def hidden_mse(
    student_states: tuple[Tensor, ...], teacher_states: tuple[Tensor, ...], mask: Tensor | None = None
) -> Tensor:
    """Mean squared error between the hidden states of every layer (the embeddings excluded), over real
    tokens (`mask`; None = every position, as in packed training blocks)."""
    pairs = list(zip(student_states[1:], teacher_states[1:]))
    keep = None if mask is None else mask.bool()

    def pick(x: Tensor) -> Tensor:
        return x if keep is None else x[keep]

    per_layer = [F.mse_loss(pick(s).float(), pick(t).float().detach()) for s, t in pairs]
    return torch.stack(per_layer).mean()
