"""Tiny architecture specs, one per supported MoE family: the single list every per-architecture test uses.

Each config is built from the family's own transformers config class with hidden 64, vocab 128,
E = 8 routed experts, top-k = 2, expert width 16-32, plus the family's peculiarities (dense first
layers, shared experts, biases, group-limited routing ...). `tiny_model` builds the model and
re-initialises every weight with a seeded normal, wide enough (std 0.2 on experts and routers) that
routing is far from uniform.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
)

from m2d_ray.arch.qwen3_moe import moe_config

HIDDEN = 64
VOCAB = 128
E, K = 8, 2
COMMON = dict(
    hidden_size=HIDDEN,
    vocab_size=VOCAB,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class ArchSpec:
    id: str
    make_config: Callable[[], object]
    student_class: str  # type(student).__name__ expected from build_student
    teacher_class: str  # type(teacher).__name__
    plain_topk: bool = True  # the selected experts are the k largest router probabilities
    #: Routing.probs as a function of the router's logits
    probs_of_logits: Callable[[torch.Tensor], torch.Tensor] = lambda logits: torch.softmax(logits.float(), dim=-1)

    def __repr__(self) -> str:
        return self.id


def _qwen3_moe():
    # dense layer 0 of width 24 < k*I = 32: padded up in the student
    return moe_config(
        hidden=HIDDEN,
        vocab=VOCAB,
        heads=4,
        kv_heads=2,
        head_dim=16,
        max_positions=128,
        layers=3,
        experts=E,
        top_k=K,
        expert_width=16,
        ffn=24,
        mlp_only_layers=[0],
    )


def _qwen2_moe():
    # sigmoid-gated shared expert, q/k/v biases, no top-k renormalisation
    return Qwen2MoeConfig(
        **COMMON,
        num_hidden_layers=2,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        intermediate_size=48,
        qkv_bias=True,
        norm_topk_prob=False,
    )


def _mixtral():
    return MixtralConfig(
        **COMMON,
        head_dim=16,
        num_hidden_layers=2,
        num_local_experts=E,
        num_experts_per_tok=K,
        intermediate_size=32,
    )


def _olmoe():
    return OlmoeConfig(
        **COMMON,
        num_hidden_layers=2,
        num_experts=E,
        num_experts_per_tok=K,
        intermediate_size=16,
        norm_topk_prob=False,
        clip_qkv=8.0,
        eos_token_id=None,
        pad_token_id=None,
    )


_MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def _deepseek_v2():
    # dense layer 0 of width 96 > k*I + shared = 2*16 + 2*16 = 64: the MoE layers are padded up;
    # group-limited routing (topk_group < k, else it never changes the choice) with a scaling factor,
    # no renormalisation
    return DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4},
        **_MLA,
        q_lora_rank=None,
        num_hidden_layers=3,
        n_routed_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=16,
        n_shared_experts=2,
        intermediate_size=96,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
    )


def _deepseek_v3():
    # sigmoid router, correction bias, 4 groups / 2 kept, renormalised then scaled by 2.5;
    # dense layer 0 of width 40 < k*I + shared = 2*16 + 16 = 48
    return DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        **_MLA,
        q_lora_rank=32,
        num_hidden_layers=3,
        n_routed_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=16,
        n_shared_experts=1,
        intermediate_size=40,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


def _gpt_oss():
    # sliding/full alternating layers, attention sinks and biases, expert biases, clamped SwiGLU
    return GptOssConfig(
        **COMMON,
        head_dim=16,
        num_hidden_layers=2,
        num_local_experts=E,
        num_experts_per_tok=K,
        intermediate_size=16,
        sliding_window=4,
        swiglu_limit=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
    )


def _normalised_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(logits.float())
    return s / s.sum(dim=-1, keepdim=True)


FAMILIES: list[ArchSpec] = [
    ArchSpec("qwen3_moe", _qwen3_moe, "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    ArchSpec("qwen2_moe", _qwen2_moe, "Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
    ArchSpec("mixtral", _mixtral, "MistralForCausalLM", "MixtralForCausalLM"),
    ArchSpec("olmoe", _olmoe, "OlmoeForCausalLM", "OlmoeForCausalLM"),
    ArchSpec("deepseek_v2", _deepseek_v2, "DeepseekV2ForCausalLM", "DeepseekV2ForCausalLM", plain_topk=False),
    ArchSpec(
        "deepseek_v3",
        _deepseek_v3,
        "DeepseekV3ForCausalLM",
        "DeepseekV3ForCausalLM",
        plain_topk=False,
        probs_of_logits=_normalised_sigmoid,
    ),
    ArchSpec("gpt_oss", _gpt_oss, "GptOssForCausalLM", "GptOssForCausalLM"),
]
FAMILY_IDS = [f.id for f in FAMILIES]

_WIDE = ("experts", "gate", "router", "shared_expert")  # std 0.2: routing far from uniform


def reinit_(model: torch.nn.Module, seed: int) -> None:
    """Seeded re-initialisation of every parameter and persistent buffer (deterministic by name order)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or name.endswith("inv_freq") or "rotary" in name:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                value = 1.0 + 0.1 * noise  # RMSNorm gains around 1
            elif "e_score_correction_bias" in name:
                value = 0.05 * noise  # same order as the sigmoid score gaps: changes some choices
            elif any(w in name for w in _WIDE):
                value = 0.2 * noise
            else:
                value = 0.1 * noise
            p.copy_(value.to(p.dtype))


def tiny_model(spec: ArchSpec, seed: int = 0) -> PreTrainedModel:
    """The family's tiny model in float32 eval mode, eager experts, seeded weights."""
    cfg = spec.make_config()
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, experts_implementation="eager")
    reinit_(model, seed)
    return model.eval()
