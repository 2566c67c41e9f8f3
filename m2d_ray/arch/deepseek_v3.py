"""DeepSeek-V3 (also Kimi-K2-style configs with model_type deepseek_v3).

Layout as DeepSeek-V2 (see `deepseek_v2`): fused routed experts, a plain-MLP `shared_experts` added
with weight 1, dense first `first_k_dense_replace` layers; E = `n_routed_experts`.

Routing (transformers' `DeepseekV3TopkRouter`): scores s = sigmoid(logits) in float32; the choice uses
s + `e_score_correction_bias`, restricted to the `topk_group` best of `n_group` groups (a group's score
is the sum of its two best biased scores); the applied weights are the *unbiased* s of the chosen
experts, divided by their sum iff `norm_topk_prob`, then multiplied by `routed_scaling_factor`.

`Routing.probs` here is NOT a softmax: it is the sigmoid scores normalised to sum 1 over all E,
p_e = s_e / sum_j s_j (no correction bias), which keeps the method's "router probability"
statistics meaningful. `Routing.index`/`weight` are the router's own (weight includes
`routed_scaling_factor`, so with `norm_topk_prob` the weights sum to that factor, not 1).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from m2d_ray.arch import register
from m2d_ray.arch.base import Routing
from m2d_ray.arch.deepseek_v2 import DeepseekAdapterBase


@register
class DeepseekV3Adapter(DeepseekAdapterBase):
    model_types = ("deepseek_v3",)
    student_model_type = "deepseek_v3"
    student_architecture = "DeepseekV3ForCausalLM"

    def renormalizes(self, config) -> bool:
        return bool(getattr(config, "norm_topk_prob", True))

    def route(self, block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Routing:
        logits, weight, index = self.router(block)(h)
        scores = torch.sigmoid(logits.float())
        return Routing(probs=scores / scores.sum(dim=-1, keepdim=True), index=index, weight=weight)
