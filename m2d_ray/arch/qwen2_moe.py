"""Qwen2-MoE: softmax router (top-k renormalised iff `norm_topk_prob`, default False), fused SwiGLU experts
(`experts.gate_up_proj` [E, 2I, d], gate first; `experts.down_proj` [E, d, I]) and one shared expert
(`shared_expert`, width `shared_expert_intermediate_size`) scaled per token by
sigmoid(`shared_expert_gate`(h)). Dense student = Qwen2 (`Qwen2ForCausalLM`).

Qwen2's attention always has q/k/v biases, so only teachers with `qkv_bias=True` (every released
Qwen1.5/Qwen2-MoE checkpoint) convert with a strict state-dict load.
"""

from __future__ import annotations

from transformers import Qwen2Config

from m2d_ray.arch import register
from m2d_ray.arch.base import MoEAdapter, SharedExpert, copy_config, mlp_as_expert
from m2d_ray.errors import M2DError


@register
class Qwen2MoeAdapter(MoEAdapter):
    model_types = ("qwen2_moe",)
    student_model_type = "qwen2"

    def num_experts(self, config) -> int:
        return int(config.num_experts)

    def renormalizes(self, config) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))

    def shared(self, block) -> SharedExpert | None:
        if getattr(block, "shared_expert", None) is None:
            return None
        return SharedExpert(weights=mlp_as_expert(block.shared_expert), gate=block.shared_expert_gate.weight.detach())

    def student_config(self, config, width: int):
        if not getattr(config, "qkv_bias", True):
            raise M2DError(
                "Qwen2-MoE teachers without q/k/v biases (qkv_bias=False) cannot be exported as Qwen2, "
                "whose attention always has biases"
            )
        return copy_config(Qwen2Config, config, intermediate_size=width, architectures=["Qwen2ForCausalLM"])
