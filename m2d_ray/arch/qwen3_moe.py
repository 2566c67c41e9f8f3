"""Qwen3-MoE: softmax router (optionally renormalised top-k), fused SwiGLU experts, dense student = Qwen3."""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3MoeConfig

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


def moe_config(
    *,
    hidden: int,
    experts: int,
    top_k: int,
    expert_width: int,
    vocab: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    ffn: int | None = None,
    max_positions: int = 256,
    **extra,
) -> Qwen3MoeConfig:
    """A Qwen3-MoE config of the given shape, renormalised top-k and untied embeddings as Qwen3-30B-A3B: the one
    place the random teachers of the tests and benchmarks are shaped (workshop/random_models.py builds them). `ffn`,
    the width of dense layers (`mlp_only_layers`), defaults to top_k x expert_width; `extra` (any config field) goes
    to the config as is."""
    shape = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_width,
        intermediate_size=ffn or top_k * expert_width,
        max_position_embeddings=max_positions,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    return Qwen3MoeConfig(**{**shape, **extra})
