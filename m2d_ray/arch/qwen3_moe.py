"""Qwen3-MoE: softmax router (optionally renormalised top-k), fused SwiGLU experts, dense student = Qwen3."""

from __future__ import annotations

from transformers import Qwen3Config

from m2d_ray.arch import register
from m2d_ray.arch.base import MoEAdapter, copy_config


@register
class Qwen3MoeAdapter(MoEAdapter):
    model_types = ("qwen3_moe",)
    student_model_type = "qwen3"

    def num_experts(self, config) -> int:
        return int(config.num_experts)

    def student_config(self, config, width: int):
        return copy_config(Qwen3Config, config, intermediate_size=width, architectures=["Qwen3ForCausalLM"])
