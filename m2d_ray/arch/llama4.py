"""Llama-4: what its layer does that the structure reading cannot see. Its experts module is not transformers'
decorated kind (`gate_up_proj` [E, d, 2I], `down_proj` [E, I, d], every expert run on every token), and its router's
score sigma(logit) multiplies each chosen expert's *input*: the block computes f_e(s_e x), which the method's
s_e f_e(x) approximates (exact where s_e = 1). The student is the same class with every layer dense (`moe_layers`
empty: Llama4TextMLP of width intermediate_size_mlp), the shared expert concatenated as usual."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from m2d_ray.arch.base import ExpertWeights, Routing
from m2d_ray.arch.families import Family, StructuredAdapter
from m2d_ray.arch.structure import Gated

FAMILY = Family(
    "llama4_text",
    scores="sigmoid",
    renormalized=False,
    knob=(("moe_layers", ()),),
    note="its router's score scales each expert's input, f(s x); the student's FFN scales the output, s f(x)",
)


class Llama4Adapter(StructuredAdapter):
    def __init__(self) -> None:
        super().__init__(FAMILY)

    def is_moe(self, mlp: nn.Module | None) -> bool:
        return mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "router")

    def experts(self, block: nn.Module) -> ExpertWeights:
        ex = block.experts
        gate, up = ex.gate_up_proj.detach().transpose(1, 2).chunk(2, dim=1)
        return ExpertWeights(gate=gate, up=up, down=ex.down_proj.detach().transpose(1, 2), act=Gated(ex.act_fn))

    def route(self, block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Routing:
        scores, logits = block.router(h)
        index = torch.topk(logits, block.router.top_k, dim=-1).indices
        s = torch.sigmoid(logits.float())
        return Routing(probs=s / s.sum(dim=-1, keepdim=True), index=index, weight=scores.gather(1, index))
