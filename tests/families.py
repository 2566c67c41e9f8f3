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
    CONFIG_MAPPING,
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
            if name.endswith("tid2eid"):  # a hash router's token -> experts table: k distinct experts a token
                p.copy_(torch.stack([torch.randperm(E, generator=g)[: p.shape[1]] for _ in range(p.shape[0])]))
                continue
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


# ---- every family read from its layer's structure (m2d_ray/arch/families.py) ------------------------------------

EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOPK = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token", "moe_top_k")
SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
FIXED = dict(
    hidden_size=64,
    vocab_size=128,
    max_position_embeddings=128,
    head_dim=16,
    swa_head_dim=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    kv_lora_rank=16,
    o_lora_rank=16,
    index_head_dim=16,
    index_n_heads=2,
    index_topk=4,
    index_num_heads=2,
    indexer_head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_head_dim=16,
    linear_num_heads=4,
    mamba_d_head=16,
    mamba_head_dim=16,
    mamba_n_heads=4,
    mamba_num_heads=4,
    mamba_d_state=16,
    ssm_state_size=16,
    n_groups=1,
    mamba_n_groups=1,
    mamba_expand=2,
    mamba_dt_rank=8,
    vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=16,
    sliding_window=8,
    global_attn_every_n_layers=2,
    global_attention_every_n_layers=2,
    hc_count=2,
    moe_latent_size=None,
    index_topk_blocks=2,
    attention_chunk_size=8,
    conv_L_cache=3,
    shared_expert_intermediate_size=16,
    num_nextn_predict_layers=0,
    heads_per_ngram=2,
)
LAYER_LISTS = (
    "layer_types",
    "mlp_layer_types",
    "layers_block_type",
    "no_rope_layers",
    "layer_rope_theta",
    "expert_swiglu_limit_list",
    "share_expert_swiglu_limit_list",
    "num_attention_heads_per_layer",
    "kv_source_layers",
    "swiglu_limits",
    "swiglu_limits_shared",
    "indexer_types",
)


def tiny_config(model_type: str, layers: list[int] | None = None, **extra):
    """A tiny config of any family from its own config class: hidden 64, vocab 128, 8 experts top-2 of width 16, MLA
    and linear-attention sizes shrunk, and the layers chosen so that every kind of each per-layer list of the
    family's default config (attention kinds, dense or sparse FFNs ...) is present once."""
    cls = CONFIG_MAPPING[model_type]
    d = cls().to_dict()
    out = {}
    for k, v in d.items():
        if k in FIXED and (v is not None or k in ("moe_latent_size", "head_dim")):
            out[k] = FIXED[k]
        elif k in EXPERTS and isinstance(v, int) and v > 1:
            out[k] = 8
        elif k in TOPK and isinstance(v, int) and v >= 1:
            out[k] = 2
        elif k in SHARED and isinstance(v, int) and v > 0:
            out[k] = 1
        elif isinstance(v, int) and not isinstance(v, bool) and "intermediate_size" in k and v > 0:
            out[k] = (
                48
                if k
                in (
                    "intermediate_size",
                    "first_dense_intermediate_size",
                    "dense_intermediate_size",
                    "intermediate_size_mlp",
                    "mlp_only_intermediate_size",
                    "prefix_dense_intermediate_size",
                )
                else 16
            )
        elif k in ("num_attention_heads", "swa_num_attention_heads", "n_heads"):
            out[k] = 4
        elif k in ("num_key_value_heads", "swa_num_key_value_heads"):
            heads = d.get(k.replace("key_value", "attention"))
            out[k] = 4 if v == heads else (1 if v == 1 else 2)
        elif k == "q_lora_rank" and v:
            out[k] = 32
        elif k == "n_group" and v and v > 1:
            out[k] = 4
        elif k in ("topk_group",) and v and v > 1:
            out[k] = 2
        elif k == "num_expert_group" and v and v > 1:
            out[k] = 4
        elif k == "per_layer_config":
            out[k] = None
    n = d.get("num_hidden_layers") or d.get("num_layers")
    lists = {k: v for k, v in d.items() if k in LAYER_LISTS and isinstance(v, list) and len(v) == n}
    if layers is None:
        idx = set()
        for v in lists.values():
            seen = {}
            for i, x in enumerate(v):
                seen.setdefault(repr(x), i)
            idx |= set(seen.values())
        layers = sorted(idx) if idx else [0, 1]
        if len(layers) < 2:
            layers = [0, 1]
    for k, v in lists.items():
        out[k] = [v[i] for i in layers]
    out["num_hidden_layers" if "num_hidden_layers" in d else "num_layers"] = len(layers)
    if "qk_rope_head_dim" in d and d.get("head_dim") == d["qk_rope_head_dim"]:  # MLA's rope dim as head_dim
        out["head_dim"] = FIXED["qk_rope_head_dim"]
    if d.get("qk_head_dim") is not None and "qk_nope_head_dim" in d:
        out["qk_head_dim"] = FIXED["qk_nope_head_dim"] + FIXED["qk_rope_head_dim"]
    if d.get("index_layers") is not None and "layer_types" in out:
        out["index_layers"] = [i for i, t in enumerate(out["layer_types"]) if t == "indexed_attention"]
    if "kv_source_layers" in out:
        out["kv_source_layers"] = list(range(len(layers)))
    for k in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "num_dense_blocks"):
        if d.get(k):
            out[k] = 1
    if d.get("mlp_only_layers"):
        out["mlp_only_layers"] = [0]
    if "moe_layer_end_index" in d and d["moe_layer_end_index"] is not None:
        out["moe_layer_end_index"] = len(layers) - 1
    if "moe_layers" in d and isinstance(d["moe_layers"], list):
        out["moe_layers"] = list(range(len(layers)))
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(d.get(k), int) and d[k] >= 128:
            out[k] = 0
    out.update(tie_word_embeddings=False)
    out.update(extra)
    if "vocab_size_per_layer_input" in d:  # Gemma-4's per-layer embeddings read the same token ids
        out["vocab_size_per_layer_input"] = out.get("vocab_size", d.get("vocab_size"))
    kept = {k: v for k, v in d.items() if k not in ("model_type", "transformers_version", "architectures")}
    return cls(**{**kept, **out})


#: per family, what the generic shrinking above cannot guess (sizes its class checks against each other)
TINY_EXTRA: dict[str, dict] = {
    "dots1": {"n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "dots3_note_text": {
        "head_dim": 24,
        "per_layer_config": {
            "02": {"num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 16}
        },
    },
    "inkling2_text": {"unpadded_vocab_size": 128},
    "gemma4_text": {  # the MoE is off by default (Gemma-4's dense sizes); the 26B-A4B checkpoint turns it on
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
        "final_logit_softcapping": 30.0,
        "per_layer_config": {"1": {"head_dim": 32}},  # its global layers' wider heads (512 to 256 in the checkpoint)
    },
    "inkling2_loop_text": {"unpadded_vocab_size": 128},
    "granitemoehybrid": {"mamba_n_heads": 8, "layer_types": ["mamba", "attention"]},
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1},
    "qwen4_exp_text": {
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
    },
    "hunyuan_v1_moe": {"num_experts": 8, "moe_topk": 2},
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_dt_rank": 8,
    },
}


def tiny_structured(model_type: str, seed: int = 0, dtype=torch.float64, **extra) -> PreTrainedModel:
    """The family's tiny teacher with seeded weights, eager experts, in `dtype`, eval mode (`extra`: config fields)."""
    from m2d_ray.arch import auto_class

    cfg = tiny_config(model_type, **{**TINY_EXTRA.get(model_type, {}), **extra})
    model = auto_class(cfg).from_config(cfg, dtype=dtype, experts_implementation="eager")
    reinit_(model, seed)
    return model.eval()


#: vision-language checkpoints of an MoE family: composite model type -> its language model's (tiny_config's)
MULTIMODAL = {
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
    "kimi_k25": "deepseek_v3",
    "gemma4": "gemma4_text",
}
_VISION = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=32,
    out_hidden_size=64,
    embed_dim=32,
    num_hidden_layers=1,
    num_attention_heads=2,
)


def tiny_multimodal(model_type: str, seed: int = 0, dtype=torch.float64) -> PreTrainedModel:
    """A vision-language model of the family: the tiny language model and a one-layer vision tower."""
    from transformers import AutoModelForImageTextToText

    config = CONFIG_MAPPING[model_type]()
    text = MULTIMODAL[model_type]
    config.text_config = tiny_config(text, **TINY_EXTRA.get(text, {}))
    if getattr(config, "vision_config", 0) is None:  # Gemma-4 leaves its towers out by default
        config.vision_config = config.sub_configs["vision_config"]()
    vision = getattr(config, "vision_config", None)
    for k, v in _VISION.items():
        if vision is not None and hasattr(vision, k):
            setattr(vision, k, v)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype, experts_implementation="eager")
    reinit_(model, seed)
    return model.eval()
