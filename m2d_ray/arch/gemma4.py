"""Gemma-4: the MoE is not a block of its own but two branches of the decoder layer. After attention the layer runs its
dense MLP on `pre_feedforward_layernorm(x)` and, beside it, the experts on `pre_feedforward_layernorm_2(x)`, routed by
`router(x)` from the residual stream itself (a scale-free RMSNorm, a learned scale, softmax, renormalised top-k, then a
per-expert scale); each branch has its own output norm and their sum a third. So the "block" here is the layer: its
input is what the router reads (the residual `x`), the experts' input is `pre_feedforward_layernorm_2(x)`, and the
method's FFN replaces the routed experts only. The student is the same class with one expert of the concatenated width
chosen every time by a zeroed router (a softmax over one logit is exactly 1, its renormalisation 1, its per-expert scale
set to 1): the dense MLP, every norm and the per-layer inputs are the teacher's, so the layer computes the teacher's
function with the method's FFN in place of the routed sum, exactly."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from m2d_ray.arch.base import DenseFFN, Routing
from m2d_ray.arch.families import Family, StructuredAdapter
from m2d_ray.arch.structure import experts_state, is_experts, name_of

FAMILY = Family(
    "gemma4_text",
    renormalized=True,
    student="one-expert",
    unstreamed="its layers read per-layer inputs computed from the token ids beside the hidden state",
)


class Gemma4Adapter(StructuredAdapter):
    def __init__(self) -> None:
        super().__init__(FAMILY)

    def ffn(self, layer: nn.Module) -> nn.Module | None:
        """The layer itself where it holds experts (router and experts are its own children), else its MLP."""
        return layer if self.is_moe(layer) else layer.mlp

    def is_moe(self, mlp: nn.Module | None) -> bool:
        return mlp is not None and is_experts(getattr(mlp, "experts", None) or nn.Module())

    def input_module(self, block: nn.Module) -> nn.Module:
        return block.router  # its forward reads the residual stream, flattened to tokens

    def expert_input(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.pre_feedforward_layernorm_2(h)

    def route(self, block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Routing:
        probs, weight, index = block.router.forward(h)  # not through its hooks: calibration observes it there
        return Routing(probs=probs.float(), index=index.long(), weight=weight)

    def block_output(self, block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Tensor:
        """The routed branch before its output norm: the sum the method's FFN replaces."""
        flat = h.reshape(-1, h.shape[-1])
        r = self.route(block, flat)
        out = block.experts(self.expert_input(block, flat), r.index, r.weight.to(flat.dtype))
        return out.reshape(h.shape)

    def set_top_k(self, model: nn.Module, k: int) -> None:
        """The router reads its k from its config (the model's, shared): each router gets its own copy."""
        self.check_top_k(model.config, k)
        for block in self.moe_blocks(model).values():
            block.router.config = copy.copy(block.router.config)
            block.router.config.top_k_experts = k

    def student_config(self, config, width: int):
        """One expert of width `width`; the dense MLP beside it keeps the teacher's width."""
        out = super().student_config(config, width)
        out.intermediate_size = config.intermediate_size
        return out

    def student_ffn_state(self, student: nn.Module, layer: int, ffn: DenseFFN) -> dict[str, Tensor]:
        block = self.layers(student)[layer]
        prefix = name_of(student, block) + "."
        router = block.router
        state = experts_state(block.experts, prefix + "experts.", [ffn])
        state[prefix + "router.proj.weight"] = torch.zeros(router.proj.weight.shape, dtype=ffn.down.dtype)
        state[prefix + "router.per_expert_scale"] = torch.ones(router.per_expert_scale.shape, dtype=ffn.down.dtype)
        return state

    def student_ffn(self, mlp: nn.Module) -> Callable[[Tensor], Tensor]:
        """The student's routed branch on the experts' input: its zeroed router gives weight 1 whatever it reads."""

        def run(x: Tensor) -> Tensor:
            _, weight, index = mlp.router(x)
            return mlp.experts(x, index, weight.to(x.dtype))

        return run
