"""The head's logits and gradients (m2d_ray/numerics.py): float32 accumulation of low-precision operands, the same
numbers on every device, differentiable everywhere, and no float32 copy of the head on a GPU.

The GPU branch (torch.mm / addmm with out_dtype=float32, CUDA only) runs here on `meta` tensors with the seam
`numerics.tensor_cores` forced: autograd and those ops' shape and dtype rules do not depend on the device, so its
forward and both gradient matmuls, the platform's chunked loss and P7's reference loop all run through it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from m2d_ray import numerics
from m2d_ray.distill.losses import chunked_kl, sparse_kl

N, D, V = 24, 16, 40


def _bf16(*shape, seed=0, grad=False, device="cpu"):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)
    return t.requires_grad_(grad)


def test_bf16_logits_and_gradients_are_the_exact_products_accumulated_in_float32():
    """Against float64 on the same bfloat16 operands: the logits exactly to float32 rounding; the gradients to the
    one rounding of the logits' gradient to bfloat16 (what the tensor cores take) and of the result."""
    h, w = _bf16(N, D, grad=True), _bf16(V, D, seed=1, grad=True)
    g = torch.randn(N, V, generator=torch.Generator().manual_seed(2))
    z = numerics.logits(h, w)
    z.backward(g)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z64 = h64 @ w64.T
    z64.backward(g.double())
    assert z.dtype == torch.float32 and torch.allclose(z.double(), z64, rtol=1e-6, atol=1e-6)
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        rel = (got.double() - ref).norm() / ref.norm()
        assert 0 < rel < 8e-3, rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64_stay_in_their_precision(dtype):
    h = torch.randn(N, D, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, dtype=dtype, requires_grad=True)
    z = numerics.logits(h, w)
    assert z.dtype == dtype
    z.sum().backward()
    assert h.grad.dtype == w.grad.dtype == dtype


def test_chunked_loss_with_float64_operands_keeps_float64_gradients():
    h, w = torch.randn(N, D, dtype=torch.float64, requires_grad=True), torch.randn(V, D, dtype=torch.float64)
    w.requires_grad_()
    chunked_kl(h, w, torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64), chunk=7).backward()
    assert h.grad.dtype == w.grad.dtype == torch.float64


def test_chunked_losses_bf16_gradients_match_autograd_through_the_same_logits():
    """`_Chunked` computes its gradients with numerics.head_grads, as the logits' own backward does: the platform's
    loss and P7's reference loop (autograd through numerics.logits) take the same head gradient."""
    h, w = _bf16(N, D, grad=True), _bf16(V, D, seed=1, grad=True)
    ht, wt = _bf16(N, D, seed=3), _bf16(V, D, seed=4)
    chunked_kl(h, w, ht, wt, chunk=N).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ls = torch.log_softmax(numerics.logits(h, w), -1)
    lt = torch.log_softmax(numerics.logits(ht, wt), -1)
    torch.nn.functional.kl_div(ls, lt, log_target=True, reduction="batchmean").backward()
    assert torch.allclose(gh.float(), h.grad.float(), rtol=2e-2, atol=1e-4)
    assert torch.allclose(gw.float(), w.grad.float(), rtol=2e-2, atol=1e-4)


class _Ops(TorchDispatchMode):
    """Every aten op run, with its tensor arguments' shapes and dtypes and its result's."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list, torch.dtype | None, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [(tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)]
        res = out if isinstance(out, torch.Tensor) else None
        self.ops.append((str(func), ins, None if res is None else res.dtype, () if res is None else tuple(res.shape)))
        return out


@pytest.fixture
def gpu_branch(monkeypatch):
    """numerics' CUDA-only branch, forced (run it on meta tensors: CPU tensors have no out_dtype matmul)."""
    monkeypatch.setattr(numerics, "tensor_cores", lambda t: True)


@pytest.mark.parametrize("loss", ["logits", "chunked_kl", "sparse_kl"])
def test_gpu_branch_takes_bf16_operands_into_float32_without_a_float32_head(gpu_branch, loss):
    """On the GPU branch (meta tensors): forward and backward run (torch.mm(out_dtype=) alone has no derivative),
    every matmul of the head takes bfloat16 operands and returns float32, and nothing copies the head to float32."""
    h, w = _bf16(N, D, grad=True, device="meta"), _bf16(V, D, seed=1, grad=True, device="meta")
    ht, wt = _bf16(N, D, seed=3, device="meta"), _bf16(V, D, seed=4, device="meta")
    with _Ops() as rec:
        if loss == "logits":
            z = numerics.logits(h, w)
            assert z.dtype == torch.float32 and z.shape == (N, V)
            z.sum().backward()
        elif loss == "chunked_kl":
            chunked_kl(h, w, ht, wt, chunk=8).backward()
        else:
            ids = torch.arange(3, device="meta").repeat(N, 1)
            sparse_kl(h, w, ids, torch.zeros(N, 3, device="meta"), torch.zeros(N, device="meta"), chunk=8).backward()
    assert h.grad.shape == (N, D) and w.grad.shape == (V, D) and h.grad.dtype == w.grad.dtype == torch.bfloat16
    mms = [op for op in rec.ops if "mm" in op[0]]
    assert mms and all(op[0] in ("aten.mm.dtype", "aten.addmm.dtype_out") for op in mms), mms
    assert all(dt == torch.bfloat16 for op in mms for shape, dt in op[1][-2:]) and {op[2] for op in mms} == {
        torch.float32
    }
    widened = [op for op in rec.ops if op[0] == "aten._to_copy.default" and op[2] == torch.float32 and op[3] == (V, D)]
    assert not widened, widened  # no float32 copy of the head


def test_torch_before_2_10_accumulates_the_head_gradient_without_addmm_into_float32(gpu_branch, monkeypatch):
    """Before torch 2.10 CUDA's addmm(self, a, b, out_dtype=float32) wants `self` in a and b's dtype (pytorch#154086,
    lifted by #167931): with the version at 2.9 and an addmm that refuses as that kernel does, the chunked loss's
    backward still runs (a float32 product, then an add into the float32 accumulator)."""
    real = torch.addmm

    def cuda_2_9_addmm(self, mat1, mat2, *args, out_dtype=None, **kwargs):
        if out_dtype is not None and self.dtype != mat1.dtype:
            raise RuntimeError(f"self and mat2 must have the same dtype, but got {self.dtype} and {mat2.dtype}")
        return real(self, mat1, mat2, *args, **({"out_dtype": out_dtype} if out_dtype else {}), **kwargs)

    monkeypatch.setattr(numerics, "TORCH_VERSION", (2, 9), raising=False)
    monkeypatch.setattr(torch, "addmm", cuda_2_9_addmm)
    h, w = _bf16(N, D, grad=True, device="meta"), _bf16(V, D, seed=1, grad=True, device="meta")
    with _Ops() as rec:
        chunked_kl(h, w, _bf16(N, D, seed=3, device="meta"), _bf16(V, D, seed=4, device="meta"), chunk=8).backward()
    assert w.grad.shape == (V, D) and w.grad.dtype == torch.bfloat16
    assert not [op for op in rec.ops if op[0].startswith("aten.addmm")]
    monkeypatch.setattr(numerics, "TORCH_VERSION", (2, 10))  # from 2.10: one addmm into the accumulator
    with pytest.raises(RuntimeError, match="same dtype"):
        chunked_kl(h, w, _bf16(N, D, seed=3, device="meta"), _bf16(V, D, seed=4, device="meta"), chunk=8)


def test_p7_reference_loop_backpropagates_on_the_gpu_branch(gpu_branch):
    """P7's plain loop (benchmarks/perf/distill_step.py, reference_path) forms its whole logits with
    numerics.logits and backpropagates through them: on the GPU branch that backward exists."""
    h, w = _bf16(N, D, grad=True, device="meta"), _bf16(V, D, seed=1, grad=True, device="meta")
    ls = torch.log_softmax(numerics.logits(h, w), -1)
    lt = torch.log_softmax(numerics.logits(_bf16(N, D, device="meta"), w.detach()), -1)
    torch.nn.functional.kl_div(ls, lt, log_target=True, reduction="batchmean").backward()
    assert w.grad.shape == (V, D) and w.grad.dtype == torch.bfloat16


def test_compiled_callers_graph_stops_at_the_head_which_runs_eagerly_on_bf16_products(gpu_branch):
    """Under torch.compile (distill.compile compiles the student's forward and its loss) the chunked loss is a graph
    break: no matmul of the head is in a graph handed to the compiler (traced, the head either broke Dynamo's
    fake-tensor pass on addmm(out_dtype=, out=) or was widened to float32 GEMMs with float32 copies of the head), and
    forward and backward run the out_dtype ops on bfloat16 operands, as eagerly."""
    targets = []

    def backend(gm, example_inputs):  # every graph, with the subgraphs of higher-order ops (autograd functions')
        graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
        targets.extend(str(n.target) for g in graphs for n in g.nodes if n.op in ("call_function", "call_method"))
        return gm.forward

    def loss(h, w, ht, wt):
        return chunked_kl(h * 2, w, ht, wt, chunk=8) * 3

    h, w = _bf16(N, D, grad=True, device="meta"), _bf16(V, D, seed=1, grad=True, device="meta")
    args = (h, w, _bf16(N, D, seed=3, device="meta"), _bf16(V, D, seed=4, device="meta"))
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend=backend)
    compiled(*args)
    assert "<built-in function mul>" in targets, targets  # the caller's own ops were compiled
    assert not any("mm" in t or "matmul" in t or "linear" in t for t in targets), targets
    with _Ops() as rec:
        compiled(*args).backward()
    mms = [op for op in rec.ops if "mm" in op[0]]
    assert {op[0] for op in mms} == {"aten.mm.dtype", "aten.addmm.dtype_out"}, mms
    assert all(dt == torch.bfloat16 for op in mms for shape, dt in op[1][-2:]), mms
    assert w.grad.dtype == torch.bfloat16 and w.grad.shape == (V, D)
