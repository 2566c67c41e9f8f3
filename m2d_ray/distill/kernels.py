"""The exact KL's kernels (`distill.kl_kernel`): one loss, the forward (or reverse) KL between the teacher's and the
student's softmax over the whole vocabulary from their final hidden states and heads, computed different ways.

    chunked   losses.chunked_kl: float32 logits, log-softmax and gradients a chunk of tokens at a time (every
              device; the reference the others are held to)
    liger     Liger Kernel's fused linear JSD (`pip install liger-kernel`, CUDA and Triton only): at beta = 0 its
              generalised JSD is the forward KL, at beta = 1 the reverse. 0.8.5 forms float32 logits from bfloat16
              products (torch.mm(out_dtype=float32), torch >= 2.8 on sm80+; before it bfloat16 logits upcast to
              float32 for the softmax), rounds the logits' gradient to the compute dtype before the two gradient
              matmuls (as chunked does), and sizes its own chunk by the tokens it is given: next_pow2(cdiv(BT,
              cdiv(V, c * H))) tokens, c = 1 before Blackwell (8 on sm_100, 16 on sm_103): 64 tokens at Qwen3's head
              and BT = 4096, 256 at the paper's 16,384-token micro-batch, so its speed at one micro-batch size says
              little of another
    auto      on a GPU, the kernel the last GPU acceptance call measured fastest at the same loss for the targets
              mode (m2d_ray/measured_gpu.json, "kl_kernel"), where this run is what it was measured on: the same
              device, loss, temperature, path (plain one rank, DDP, DeepSpeed) and tokens a micro-batch; else
              chunked, said in one line (a speed and an agreement measured at one of them say nothing of another;
              an entry that does not record one matches no run); chunked on a CPU

Each is held to chunked: on the CPU where it runs there (tests/unit/test_kernels.py), and on a GPU by the acceptance
call, which trains every kernel from the same student on the same batches and compares the loss trajectories.
Only the exact modes (online, hidden) have kernels: cached top-K and sampled targets have their own losses.
Compiling the student is not a kernel but a setting of its own, `distill.compile`, with any of them (the name
`compiled` of earlier versions is read as chunked with distill.compile=true); the compiled graph stops at the head,
which runs eagerly (m2d_ray/numerics.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from packaging.version import Version
from torch import Tensor

from m2d_ray import measured, numerics
from m2d_ray.catalog.distill import AUTO, COMPILED, KL_KERNELS
from m2d_ray.catalog.targets import mode_of
from m2d_ray.console import say
from m2d_ray.distill.losses import chunked_kl
from m2d_ray.distill.precision import installed_version
from m2d_ray.errors import M2DError

# Imported inside functions: liger_kernel (an optional GPU dependency, the [gpu] extra).

KL = Callable[..., Tensor]  # (h_s, w_s, h_t, w_t, kind=, temperature=, chunk=) -> the mean per-token loss
#: torch.compile's backend under distill.compile (the CPU tests swap in aot_eager: the same capture, no codegen)
COMPILE_BACKEND = "inductor"


@dataclass(frozen=True)
class KLKernel:
    name: str
    kl: KL
    cuda_only: bool = False
    needs: str | None = None  # the module it imports, and what installs it
    min_version: tuple[str, str] | None = None  # (distribution, the oldest version the glue works with)
    min_torch: tuple[tuple[int, int], str] | None = None  # (the oldest torch it runs on, why)

    def unavailable(self, device: str | torch.device) -> str | None:
        """Why this kernel cannot run on `device` here, or None."""
        if self.cuda_only and torch.device(device).type != "cuda":
            return "runs on CUDA devices only"
        if self.needs is not None:
            try:
                __import__(self.needs.split()[0])
            except ImportError:
                return f"needs {self.needs}"
        if self.min_torch is not None and numerics.TORCH_VERSION < self.min_torch[0]:
            oldest = ".".join(map(str, self.min_torch[0]))
            return f"needs torch >= {oldest} (found {torch.__version__}): {self.min_torch[1]}"
        if self.min_version is not None:
            dist, oldest = self.min_version
            found = installed_version(dist)
            if found is not None and Version(found) < Version(oldest):
                return f"needs {dist} >= {oldest} (found {found}; pip install '{dist}>={oldest}')"
        return None


@dataclass(frozen=True)
class Where:
    """What a kernel's speed and agreement were measured at, or what a run is, besides the targets mode."""

    loss: str = "fkl"
    temperature: float = 1.0
    path: str = "plain"  # plain (one rank), ddp (plain torch on several), deepspeed
    tokens: int | None = None  # a micro-batch's (batch_size x seq_len); None (unknown) matches no measurement

    @classmethod
    def of(cls, loss: str, temperature: float, deepspeed: bool, world: int, tokens: int | None = None) -> Where:
        path = "deepspeed" if deepspeed else "plain" if world == 1 else "ddp"
        return cls(loss, float(temperature), path, None if tokens is None else int(tokens))


def device_name(device: str | torch.device) -> str:
    """The card `device` is, as torch names it (the seam tests set: a CPU has no CUDA device to ask)."""
    return torch.cuda.get_device_name(torch.device(device))


def liger_kl(
    h_s: Tensor, w_s: Tensor, h_t: Tensor, w_t: Tensor, kind: str = "fkl", temperature: float = 1.0, chunk: int = 0
) -> Tensor:
    """`chunked_kl`'s loss by Liger Kernel's fused linear JSD (beta 0: KL(t || s); beta 1: KL(s || t)); its loss is
    the mean over tokens of the divergence at logits / t, so it is scaled by t^2 as chunked_kl's is (its own
    chunking sizes itself: `chunk` is not used)."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_jsd
    except ImportError as exc:  # kl_kernel() refuses it before any work; here for a direct caller
        raise M2DError(f"distill.kl_kernel=liger needs {KL_KERNELS['liger'].needs}") from exc

    beta = {"fkl": 0.0, "rkl": 1.0}[kind]
    t = float(temperature)
    loss = liger_fused_linear_jsd(
        h_s, w_s, h_t.detach(), w_t.detach(), None, beta, -100, t, accum_dtype=torch.float32
    )  # the head's gradient summed over chunks in float32, as chunked_kl sums it
    return loss if t == 1.0 else loss * (t * t)


for _k in (
    KLKernel("chunked", chunked_kl),
    KLKernel(
        "liger",
        liger_kl,
        cuda_only=True,
        needs="liger_kernel (pip install liger-kernel, the [gpu] extra)",
        min_version=("liger-kernel", "0.8.5"),  # liger_fused_linear_jsd's accum_dtype
        # read in liger-kernel 0.8.5: from torch 2.8 it sums its float32 grad_weight with addmm(out_dtype=float32,
        # out=) over bfloat16 operands, which CUDA refuses before torch 2.10 (pytorch#154086; numerics.py's gate)
        min_torch=(numerics.ADDMM_WIDE_SELF, "liger's float32 gradient sum crashes on CUDA before it"),
    ),
):
    KL_KERNELS.register(_k.name)(_k)


def kl_kernel(name: str, device: str | torch.device, targets=None, where: Where | None = None) -> KLKernel:
    """The kernel `distill.kl_kernel` names on `device` for the targets (None: online) and the run's loss,
    temperature, path and tokens a micro-batch (`where`, default forward KL at t = 1 on one plain rank, tokens
    unknown). auto: chunked on a CPU; on a GPU
    the measured choice for the mode where this run is what it was measured on, else chunked (one line, once); also
    chunked (said once) where the measured one cannot run here. A kernel asked for by name that cannot run here is
    one line."""
    if name != AUTO:
        kernel = KL_KERNELS[name]
        why = kernel.unavailable(device)
        if why:
            raise M2DError(f"distill.kl_kernel={name}: {why}; use chunked (every device) or auto")
        return kernel
    if torch.device(device).type != "cuda":
        return KL_KERNELS["chunked"]
    mode = mode_of(targets)
    entry = measured.gpu().kl_kernel.get(mode)
    if entry is None or entry["kernel"] in ("chunked", COMPILED):  # compiling is distill.compile's, not auto's
        return KL_KERNELS["chunked"]
    here = {"device": device_name(device), **asdict(where or Where())}
    differ = {k: (entry.get(k), v) for k, v in here.items() if entry.get(k) != v}
    if differ:
        _fallback(entry["kernel"], f"was measured at {_said(entry, differ, 0)}, this run is {_said(here, differ, 1)}")
        return KL_KERNELS["chunked"]
    kernel = KL_KERNELS[entry["kernel"]]
    if kernel.unavailable(device):
        _fallback(kernel.name, kernel.unavailable(device))
        return KL_KERNELS["chunked"]
    return kernel


def _said(values: dict, differ: dict, i: int) -> str:
    return ", ".join(f"{k} {'unrecorded' if pair[i] is None else pair[i]}" for k, pair in differ.items())


@functools.cache
def _fallback(name: str, why: str) -> None:
    say(f"distill.kl_kernel=auto: {name} (the measured choice) {why}; using chunked")
