"""DeepSeek-V2 (and the common DeepSeek helper that DeepSeek-V3 reuses).

Layout (transformers 5): routed experts fused like Qwen3-MoE (`experts.gate_up_proj` [E, 2I, d], gate
first; `experts.down_proj` [E, d, I], I = `moe_intermediate_size`), E = `n_routed_experts`; one plain MLP
`shared_experts` of width `n_shared_experts * moe_intermediate_size`, added with weight 1; the first
`first_k_dense_replace` layers are plain MLPs of width `intermediate_size`.

Routing: softmax over all E logits (computed in float32), greedy or group-limited top-k, and the
selected probabilities are multiplied by `routed_scaling_factor`. transformers' router never
renormalises (its config carries `norm_topk_prob` but the router ignores it), so `renormalizes` is
False and avg-cp scaling is the natural one. NB: `Routing.weight` includes `routed_scaling_factor`,
`Routing.probs` does not.

Student: the same class with `first_k_dense_replace = num_hidden_layers` (every layer a plain MLP)
and `intermediate_size = W`; the router/expert fields stay in the config but are unused.
"""

from __future__ import annotations

from torch import nn

from m2d_ray.arch import register
from m2d_ray.arch.base import MoEAdapter, SharedExpert, copy_config, mlp_as_expert
from m2d_ray.errors import M2DError


class DeepseekAdapterBase(MoEAdapter):
    """What DeepSeek-V2 and -V3 share: names, shared experts, all-dense student of the same class."""

    student_architecture: str = ""

    def num_experts(self, config) -> int:
        return int(config.n_routed_experts)

    def routed_scale(self, config) -> float:
        return float(getattr(config, "routed_scaling_factor", 1.0))

    def shared(self, block: nn.Module) -> SharedExpert | None:
        mlp = getattr(block, "shared_experts", None)
        return None if mlp is None else SharedExpert(weights=mlp_as_expert(mlp))

    def student_config(self, config, width: int):
        if getattr(config, "mlp_bias", False):
            raise M2DError("DeepSeek models with mlp_bias=True are not supported")
        return copy_config(
            type(config),
            config,
            first_k_dense_replace=config.num_hidden_layers,
            intermediate_size=width,
            architectures=[self.student_architecture],
        )


@register
class DeepseekV2Adapter(DeepseekAdapterBase):
    model_types = ("deepseek_v2",)
    student_model_type = "deepseek_v2"
    student_architecture = "DeepseekV2ForCausalLM"

    def renormalizes(self, config) -> bool:
        return False
