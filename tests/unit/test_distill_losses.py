"""Chunked distillation losses against the naive whole-logits reference (values and gradients, float64)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from m2d_ray.distill.losses import LOSSES, chunked_kl, hidden_mse, naive_kl
from m2d_ray.errors import M2DError


def _inputs(n=37, d=12, V=53, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def mk(*s):
        return torch.randn(*s, generator=g, dtype=dtype)

    return mk(n, d).requires_grad_(), mk(V, d).requires_grad_(), mk(n, d), mk(V, d)


@pytest.mark.parametrize("kind", ["fkl", "rkl"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("chunk", [1, 8, 1000])
def test_chunked_equals_naive_value_and_gradients(kind, temperature, chunk):
    h_s, w_s, h_t, w_t = _inputs()
    ref = naive_kl(h_s @ w_s.T, h_t @ w_t.T, kind, temperature).double()
    gh_ref, gw_ref = torch.autograd.grad(ref * 3.0, (h_s, w_s))
    got = chunked_kl(h_s, w_s, h_t, w_t, kind, temperature, chunk)
    gh, gw = torch.autograd.grad(got * 3.0, (h_s, w_s))  # a non-unit upstream gradient is applied
    # the loss itself is computed in float32 (as in training): values to float32 accuracy, gradients too
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(gh, gh_ref, rtol=1e-4, atol=1e-6)
    assert torch.allclose(gw, gw_ref, rtol=1e-4, atol=1e-6)


def test_kl_is_zero_for_identical_models_and_positive_otherwise():
    h_s, w_s, h_t, w_t = _inputs()
    assert chunked_kl(h_s, w_s, h_s.detach(), w_s.detach()).item() == pytest.approx(0.0, abs=1e-6)
    assert chunked_kl(h_s, w_s, h_t, w_t).item() > 0.1


def test_forward_and_reverse_kl_differ():
    h_s, w_s, h_t, w_t = _inputs()
    assert abs(chunked_kl(h_s, w_s, h_t, w_t, "fkl").item() - chunked_kl(h_s, w_s, h_t, w_t, "rkl").item()) > 1e-3


def test_gradient_check_float64():
    """torch.autograd.gradcheck through the custom backward (finite differences, float64)."""
    h_s, w_s, h_t, w_t = _inputs(n=5, d=3, V=7)

    def f(a, b):
        return chunked_kl(a, b, h_t, w_t, "rkl", 1.7, 2).double()

    # the forward runs in float32, so finite differences need a coarse step and tolerance
    assert torch.autograd.gradcheck(f, (h_s, w_s), eps=1e-3, atol=5e-3, rtol=5e-3)


def test_hidden_mse_ignores_padding_and_embeddings():
    s = tuple(torch.randn(2, 4, 3) for _ in range(3))
    t = tuple(x.clone() for x in s)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    t[0].add_(5.0)  # embeddings: excluded
    t[1][0, 3] += 100.0  # a padded position: excluded
    assert hidden_mse(s, t, mask).item() == 0.0
    t[2][1, 1, 0] += 1.0
    assert hidden_mse(s, t, mask).item() == pytest.approx(1.0 / (5 * 3) / 2)


def test_unknown_loss_suggests():
    with pytest.raises(M2DError, match="did you mean 'fkl'"):
        LOSSES["fkll"]


def _bf16_inputs(n=37, d=12, V=53):
    return [t.detach().to(torch.bfloat16).requires_grad_(i < 2) for i, t in enumerate(_inputs(n, d, V, seed=5))]


def test_a_scaled_loss_rounds_its_bf16_gradients_once():
    """Under gradient accumulation the loss is divided by grad_accum (12 here) before backward: the body's gradient
    is the stored one times 1/12 in float32, rounded once to bfloat16 (not times a bfloat16-rounded 1/12, 0.2% off),
    and the head's is its float32 accumulator times 1/12, rounded once."""
    h_s, w_s, h_t, w_t = _bf16_inputs()
    chunked_kl(h_s, w_s, h_t, w_t, chunk=8).backward()
    unscaled_h, h_s.grad, w_s.grad = h_s.grad.clone(), None, None
    saved = []

    def pack(t):
        saved.append(t.clone())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_kl(h_s, w_s, h_t, w_t, chunk=8)
    (loss / 12).backward()
    scale = torch.tensor(1.0) / 12
    (accum,) = [t for t in saved if t.dtype == torch.float32 and t.shape == w_s.shape]
    assert torch.equal(h_s.grad, (unscaled_h.float() * scale).to(torch.bfloat16))
    assert torch.equal(w_s.grad, (accum * scale).to(torch.bfloat16))


class _NewFloat32(TorchDispatchMode):
    """The ops that return a new float32 tensor of a shape (a result sharing no input's memory)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.new = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and tuple(out.shape) == self.shape:
            if out.untyped_storage().data_ptr() not in ins:
                self.new.append(str(func))
        return out


def test_backward_makes_no_second_float32_head():
    """A bfloat16 head's float32 gradient accumulator [V, d] is scaled in place: backward allocates no second one
    (and a second backward through the graph, which would scale it twice, is refused)."""
    h_s, w_s, h_t, w_t = _bf16_inputs()
    loss = chunked_kl(h_s, w_s, h_t, w_t, chunk=8) / 12
    with _NewFloat32(w_s.shape) as mode:
        loss.backward(retain_graph=True)
    assert w_s.grad.dtype == torch.bfloat16 and not mode.new, mode.new
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()
