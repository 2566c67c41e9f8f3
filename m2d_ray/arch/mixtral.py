"""Mixtral: softmax router with renormalised top-k, fused SwiGLU experts of width `intermediate_size`
(`experts.gate_up_proj` [E, 2I, d], gate first; `experts.down_proj` [E, d, I]), E = `num_local_experts`.
Checkpoints keep Mistral's names: `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down).
Dense student = Mistral (`MistralForCausalLM`), same attention, sliding window copied (usually None).
"""

from __future__ import annotations

from transformers import MistralConfig

from m2d_ray.arch import register
from m2d_ray.arch.base import MoEAdapter, copy_config


@register
class MixtralAdapter(MoEAdapter):
    model_types = ("mixtral",)
    student_model_type = "mistral"

    per_expert_keys = {"gate_up_proj": ("{e}.w1.weight", "{e}.w3.weight"), "down_proj": ("{e}.w2.weight",)}

    def checkpoint_names(self, name: str) -> tuple[str, ...]:
        return (name, name.replace(".mlp.", ".block_sparse_moe.", 1))

    def num_experts(self, config) -> int:
        return int(config.num_local_experts)

    def renormalizes(self, config) -> bool:
        return True

    def student_config(self, config, width: int):
        return copy_config(MistralConfig, config, intermediate_size=width, architectures=["MistralForCausalLM"])
