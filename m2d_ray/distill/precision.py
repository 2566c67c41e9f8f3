"""Stage 2's precision policies (`distill.precision`) and the float32 master weights of the plain-torch path.

    bf16-mixed  the teacher, its cached states and head, and the student's forward and backward in bfloat16; the
                student's master weights, the gradient the optimizer reads and AdamW's moments in float32
                (DeepSpeed's `bf16` mode, and `MasterWeights` on the plain path, alone or under DDP)
    bf16-pure   everything in bfloat16, AdamW's moments too (only when asked: a bfloat16 weight w cannot take a
                step below ~w / 256, so at the paper's decayed learning rates most updates round away)
    fp32        everything in float32 (what `auto` means on a CPU)
    auto        bf16-mixed on a GPU, fp32 on a CPU

Why master weights and not autocast: autocast keeps float32 weights and casts them at every forward, and computes
some ops in float32 that DeepSpeed's bfloat16 module computes in bfloat16. Master weights make the plain path do
what DeepSpeed ZeRO does in `bf16` mode (a bfloat16 model whose float32 partition the optimizer steps, its gradients
accumulated and reduced in bfloat16), so the paths train the same numbers and the benchmark compares the same work.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from m2d_ray.catalog.distill import AUTO, PRECISIONS


@dataclass(frozen=True)
class Precision:
    """A policy: the dtype a student and its teacher compute in, and whether float32 master weights and optimizer
    states stand behind a lower-precision student."""

    name: str
    dtype: torch.dtype
    masters: bool

    @property
    def weight_bytes(self) -> int:
        """Bytes of one weight of the model that computes (the student, the teacher, cached hidden states)."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of the optimizer's own state: float32 masters (if any) and AdamW's two moments."""
        return 12 if self.masters else 2 * self.weight_bytes


for _p in (
    Precision("bf16-mixed", torch.bfloat16, masters=True),
    Precision("bf16-pure", torch.bfloat16, masters=False),
    Precision("fp32", torch.float32, masters=False),
):
    PRECISIONS.register(_p.name)(_p)


def resolve(name: str, gpu: bool) -> Precision:
    """The policy `name` means on a GPU (`gpu`) or a CPU: auto = bf16-mixed on a GPU, fp32 on a CPU."""
    if name == AUTO:
        name = "bf16-mixed" if gpu else "fp32"
    return PRECISIONS[name]


def for_device(name: str, device: str | torch.device) -> Precision:
    return resolve(name, torch.device(device).type == "cuda")


class MasterWeights:
    """Float32 copies of a lower-precision model's trainable parameters, for the plain-torch path (one rank or DDP).

    The optimizer is built over `masters` (groups mapped by `groups`); before it steps, `take_grads` hands it each
    parameter's gradient in float32; after it, `write_back` rounds the masters into the model. The model's own
    gradients stay in its dtype (accumulated over micro-batches and reduced by DDP there, as ZeRO does in `bf16`).
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self._of = {id(p): m for p, m in zip(self.params, self.masters)}

    def groups(self, groups: list[dict]) -> list[dict]:
        """The optimizer's parameter groups over the model's parameters, mapped to their masters."""
        return [{**g, "params": [self._of[id(p)] for p in g["params"]]} for g in groups]

    def take_grads(self) -> None:
        """Each master's gradient: its parameter's, in float32 (the parameter's freed, as a step would free it)."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """The model's parameters: its masters rounded to the model's dtype."""
        torch._foreach_copy_(self.params, self.masters)

    def state_dict(self) -> dict:
        return {"masters": [m.detach() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict | None) -> None:
        """Restore the masters a checkpoint saved (the model's rounding alone would lose their low bits); a checkpoint
        without them (a plain-path run of another policy) restarts them from the model's restored weights."""
        if state is None:
            torch._foreach_copy_(self.masters, self.params)
            return
        for m, saved in zip(self.masters, state["masters"], strict=True):
            m.copy_(saved)
        self.write_back()
