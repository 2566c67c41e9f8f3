"""The float32 master weights of the plain-torch path under a lower-precision policy (distill/precision.py says
which policies keep them): apart from the policies, which `m2d plan` reads without torch."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

HOOK = "_m2d_master_hook"  # a parameter's float32-sum hook (one at a time: a second step object replaces it)


class MasterWeights:
    """Float32 copies of a lower-precision model's trainable parameters, for the plain-torch path (one rank or more).

    The optimizer is built over `masters` (groups mapped by `groups`). Gradients are summed in float32: as soon as
    autograd has accumulated a parameter's gradient of a micro-batch (a post-accumulate-grad hook), it is added into a
    flat float32 buffer and the lower-precision one freed, so no sum over micro-batches is ever rounded to bfloat16
    (its error grows with the count: 2.7e-3 relative at 4, 9e-3 at 64); over `world` ranks the buffer is all-reduced
    in float32 once per step (`take_grads`), as Megatron's `accumulate_allreduce_grads_in_fp32` and torchtitan's
    float32 reduce do, and the masters are broadcast from rank 0 here, as DDP broadcasts a module's. Before the
    optimizer steps `take_grads` hands it the sums; after it `write_back` rounds the masters into the model.
    """

    def __init__(self, params: Iterable[nn.Parameter], world: int = 1) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self._of = {id(p): m for p, m in zip(self.params, self.masters)}
        self.world = world
        device = self.params[0].device if self.params else "cpu"
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32, device=device)
        self.grads = [g.view_as(p) for g, p in zip(self.flat.split([p.numel() for p in self.params]), self.params)]
        self.seen = [False] * len(self.params)  # which parameters had a gradient since the last step
        for i, p in enumerate(self.params):
            if hasattr(p, HOOK):  # an earlier MasterWeights over the same model: its sums are no longer read
                getattr(p, HOOK).remove()
            setattr(p, HOOK, p.register_post_accumulate_grad_hook(functools.partial(self._accumulate, i)))
        if world > 1 and dist.is_initialized():
            for m in self.masters:
                dist.broadcast(m.data, 0)
            self.write_back()

    def _accumulate(self, i: int, p: nn.Parameter) -> None:
        self.grads[i].add_(p.grad)
        self.seen[i] = True
        p.grad = None

    def groups(self, groups: list[dict]) -> list[dict]:
        """The optimizer's parameter groups over the model's parameters, mapped to their masters."""
        return [{**g, "params": [self._of[id(p)] for p in g["params"]]} for g in groups]

    def take_grads(self) -> None:
        """Each master's gradient: the float32 sum of its parameter's over the micro-batches (and the mean over the
        ranks); None for a parameter no micro-batch reached on any rank."""
        if self.world > 1 and dist.is_initialized():
            seen = torch.tensor(self.seen, dtype=torch.float32, device=self.flat.device)
            dist.all_reduce(self.flat)
            dist.all_reduce(seen)
            self.flat.div_(self.world)
            self.seen = [bool(x) for x in seen.tolist()]
        for m, g, seen in zip(self.masters, self.grads, self.seen):
            m.grad = g if seen else None

    @torch.no_grad()
    def write_back(self) -> None:
        """The model's parameters: its masters rounded to the model's dtype; the gradient sums restarted."""
        torch._foreach_copy_(self.params, self.masters)
        self.flat.zero_()
        self.seen = [False] * len(self.params)

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
