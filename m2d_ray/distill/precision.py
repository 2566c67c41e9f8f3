"""Stage 2's precision policies (`distill.precision`); the float32 master weights of the plain-torch path are in
masters.py (torch: `m2d plan` reads the policies without it).

    bf16-mixed  the teacher, its cached states and head, and the student's forward and backward in bfloat16; the
                student's master weights, the gradient the optimizer reads and AdamW's moments in float32
                (DeepSpeed's `bf16` mode, and `MasterWeights` on the plain path, on one rank or several)
    bf16-pure   everything in bfloat16, AdamW's moments too (only when asked: a bfloat16 weight w cannot take a
                step below ~w / 256, so at the paper's decayed learning rates most updates round away)
    fp32        everything in float32 (what `auto` means on a CPU)
    auto        bf16-mixed on a GPU, fp32 on a CPU

Why master weights and not autocast: autocast keeps float32 weights and casts them at every forward, and computes
some ops in float32 that DeepSpeed's bfloat16 module computes in bfloat16. Master weights make the plain path do
what DeepSpeed ZeRO does in `bf16` mode (a bfloat16 model whose float32 partition the optimizer steps), so the paths
train the same numbers and the benchmark compares the same work. Gradients are summed in float32 on every path: over
micro-batches and ranks by `MasterWeights` on the plain path, by ZeRO's float32 accumulation and reduction
(distill/step.py ds_config) under DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from packaging.version import Version

from m2d_ray.catalog.distill import AUTO, PRECISIONS

if TYPE_CHECKING:
    import torch

# Imported inside functions: torch (a policy's dtype; `m2d plan` reads the policies' bytes without it).

#: the bytes of one weight in each dtype a policy computes in (torch's name for it)
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}

#: the first DeepSpeed whose ZeRO-2 honours `grad_accum_dtype: fp32` (a float32 gradient partition: stage_1_and_2.py's
#: `_use_compact_grad_partition_buffer`); through 0.19.7 ZeRO-2 sums micro-batches in its bfloat16
#: `grads_in_partition` and the key does nothing there (pyproject.toml's floor)
DEEPSPEED_FP32_SUMS = "0.19.8"


@dataclass(frozen=True)
class Precision:
    """A policy: the dtype a student and its teacher compute in (torch's name for it), and whether float32 master
    weights and optimizer states stand behind a lower-precision student."""

    name: str
    dtype_name: str
    masters: bool

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def weight_bytes(self) -> int:
        """Bytes of one weight of the model that computes (the student, the teacher, cached hidden states)."""
        return DTYPE_BYTES[self.dtype_name]

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of the optimizer's own state: float32 masters (if any) and AdamW's two moments."""
        return 12 if self.masters else 2 * self.weight_bytes


for _p in (
    Precision("bf16-mixed", "bfloat16", masters=True),
    Precision("bf16-pure", "bfloat16", masters=False),
    Precision("fp32", "float32", masters=False),
):
    PRECISIONS.register(_p.name)(_p)


def resolve(name: str, gpu: bool) -> Precision:
    """The policy `name` means on a GPU (`gpu`) or a CPU: auto = bf16-mixed on a GPU, fp32 on a CPU."""
    if name == AUTO:
        name = "bf16-mixed" if gpu else "fp32"
    return PRECISIONS[name]


def for_device(name: str, device: str | torch.device) -> Precision:
    import torch

    return resolve(name, torch.device(device).type == "cuda")


def installed_version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None (a module on the path without metadata)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def deepspeed_refusal(dtype: torch.dtype | str, zero_stage: int) -> str | None:
    """Why the installed DeepSpeed cannot train ZeRO-`zero_stage` in `dtype` (a torch dtype or its name: a config's
    check imports no torch) with float32 gradient sums, or None: a dtype below float32 at ZeRO-2 needs
    DEEPSPEED_FP32_SUMS (an older one would silently sum in bfloat16)."""
    name = str(dtype).removeprefix("torch.")
    if zero_stage < 2 or (getattr(dtype, "itemsize", None) or DTYPE_BYTES[name]) >= 4:
        return None
    found = installed_version("deepspeed")
    if found is None or Version(found) >= Version(DEEPSPEED_FP32_SUMS):
        return None
    return (
        f"distill.deepspeed with ZeRO-{zero_stage} in {name} needs deepspeed >= "
        f"{DEEPSPEED_FP32_SUMS} to sum gradients in float32 (found {found}, which sums micro-batches in "
        f"{name}); pip install 'deepspeed>={DEEPSPEED_FP32_SUMS}', or set "
        "distill.deepspeed=false"
    )
