"""A model's parameters by arithmetic over its config: what `m2d plan` needs of a model without building one.

Building the model on the meta device gives the same counts but imports transformers' modelling code (seconds of
imports for each plan). Each family's layout is the one its adapter documents; `tests/unit/test_counts.py` holds
every supported family, its dense student and the dense twins to the meta model's own count, tensor kind by tensor
kind. A model type without an entry here is counted on the meta device (`plan.shapes`).

    Counts.params          every parameter
    Counts.layers          per decoder layer: parameters (what a layer-streamed pass holds)
    Counts.vector_params   norm gains and biases (elementwise, no products)
    Counts.moe_layers      the layers whose FFN is the routed experts
    Counts.tied            the output head is the input embedding
    Counts.expert_width    a routed expert's width (0: a dense model); shared_width: the shared experts' together
    Counts.dense_width     the width of the layers that are not MoE (0: none)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Counts:
    params: int
    layers: tuple[int, ...]
    vector_params: int
    moe_layers: tuple[int, ...]
    tied: bool
    expert_width: int = 0
    shared_width: int = 0
    dense_width: int = 0


@dataclass
class _Tally:
    matrix: int = 0
    vector: int = 0

    def add(self, other: _Tally) -> _Tally:
        return _Tally(self.matrix + other.matrix, self.vector + other.vector)

    @property
    def total(self) -> int:
        return self.matrix + self.vector


def _get(config, name: str, default=None):
    value = getattr(config, name, default)
    return default if value is None else value


def _head_dim(c) -> int:
    return int(_get(c, "head_dim") or c.hidden_size // c.num_attention_heads)


def _kv_heads(c) -> int:
    return int(_get(c, "num_key_value_heads") or c.num_attention_heads)


def layer_attention_widths(text) -> list[tuple[int, int, int, int]]:
    """(query width, key/value width, heads, key/value heads) of each distinct layer: one for a config whose layers
    are alike, one a layer where it sets them per layer (Gemma-4's wider global-attention heads), whose global
    attribute transformers refuses to read."""
    per_layer = getattr(text, "per_layer_config", None)
    views = [per_layer[i] for i in range(text.num_hidden_layers)] if per_layer is not None else [text]

    def widths(c) -> tuple[int, int, int, int]:
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        return heads * head_dim, kv * head_dim, heads, kv

    return [widths(c) for c in views]


def attention_widths(text) -> tuple[int, int, int, int]:
    """`layer_attention_widths` averaged over the layers: a figure times the layers is the model's."""
    rows = layer_attention_widths(text)
    return tuple(round(sum(col) / len(col)) for col in zip(*rows))


# ---- attention --------------------------------------------------------------------------------------------
def _gqa(c, qkv_bias: bool, o_bias: bool, qk_norm: str = "", sinks: bool = False) -> _Tally:
    """q/k/v/o projections of grouped-query attention; `qk_norm` "head" (a gain of head_dim each: Qwen3) or "all"
    (a gain over all heads: OLMoE); attention sinks (one per head: gpt-oss)."""
    d, hd, H, KV = c.hidden_size, _head_dim(c), c.num_attention_heads, _kv_heads(c)
    q, kv = H * hd, KV * hd
    t = _Tally(d * q + 2 * d * kv + q * d)
    t.vector += (q + 2 * kv) * qkv_bias + d * o_bias + H * sinks
    t.vector += {"": 0, "head": 2 * hd, "all": q + kv}[qk_norm]
    return t


def _mla(c) -> _Tally:
    """DeepSeek's multi-head latent attention (q through a low-rank bottleneck when q_lora_rank is set)."""
    d, H, bias = c.hidden_size, c.num_attention_heads, bool(_get(c, "attention_bias", False))
    nope, rope, v, kv_rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    qk = nope + rope
    t = _Tally()
    if _get(c, "q_lora_rank"):
        r = c.q_lora_rank
        t.matrix += d * r + r * H * qk
        t.vector += r * bias + r  # q_a_proj's bias, q_a_layernorm
    else:
        t.matrix += d * H * qk
    t.matrix += d * (kv_rank + rope) + kv_rank * H * (nope + v) + H * v * d
    t.vector += (kv_rank + rope) * bias + kv_rank + d * bias  # kv_a_proj's bias, kv_a_layernorm, o_proj's bias
    return t


# ---- feed-forward ----------------------------------------------------------------------------------------
def _mlp(d: int, width: int, bias: bool = False) -> _Tally:
    """A SwiGLU MLP: gate, up [width, d] and down [d, width]."""
    return _Tally(3 * d * width, (2 * width + d) * bias)


def _experts(c, E: int, width: int, bias: bool = False, router_bias: bool = False) -> _Tally:
    """E fused SwiGLU experts ([E, 2I, d] and [E, d, I]; their biases [E, 2I] and [E, d] are matrices too) and the
    router [E, d] (its bias a vector)."""
    d = c.hidden_size
    return _Tally(E * 3 * d * width + E * d + E * (2 * width + d) * bias, E * router_bias)


@dataclass(frozen=True)
class Family:
    """What differs between families: the attention, which layers are MoE, the MoE block and the dense MLP."""

    attention: Callable[[object], _Tally]
    is_moe: Callable[[object, int], bool]
    moe: Callable[[object], _Tally] | None
    mlp: Callable[[object], _Tally] | None
    expert_width: Callable[[object], int] = lambda c: 0
    shared_width: Callable[[object], int] = lambda c: 0
    norms: int = 2  # per layer, of width hidden


def _dense_mlp(c) -> _Tally:
    return _mlp(c.hidden_size, c.intermediate_size, bool(_get(c, "mlp_bias", False)))


def _never(c, i: int) -> bool:
    return False


def _always(c, i: int) -> bool:
    return True


def _qwen_sparse(c, i: int) -> bool:
    """Qwen2/3-MoE: a layer is MoE unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    step = int(_get(c, "decoder_sparse_step", 1))
    return i not in (_get(c, "mlp_only_layers", []) or []) and c.num_experts > 0 and (i + 1) % step == 0


def _deepseek_sparse(c, i: int) -> bool:
    return i >= int(_get(c, "first_k_dense_replace", 0))


def _qwen2_moe_block(c) -> _Tally:
    t = _experts(c, c.num_experts, c.moe_intermediate_size)
    if _get(c, "shared_expert_intermediate_size", 0):
        t = t.add(_mlp(c.hidden_size, c.shared_expert_intermediate_size)).add(_Tally(c.hidden_size))
    return t


def _deepseek_block(c) -> _Tally:
    """Routed experts and the shared ones (one MLP of width n_shared x I); V3's correction bias is a buffer."""
    t = _experts(c, c.n_routed_experts, c.moe_intermediate_size)
    shared = int(_get(c, "n_shared_experts", 0) or 0)
    return t.add(_mlp(c.hidden_size, shared * c.moe_intermediate_size)) if shared else t


def _qwen3_attention(c) -> _Tally:
    bias = bool(_get(c, "attention_bias", False))
    return _gqa(c, bias, bias, qk_norm="head")


def _olmoe_attention(c) -> _Tally:
    bias = bool(_get(c, "attention_bias", False))
    return _gqa(c, bias, bias, qk_norm="all")


def _glm4_moe_attention(c) -> _Tally:
    """GLM-4.5's: biases on q, k and v (attention_bias), none on o; a per-head q/k norm where use_qk_norm."""
    return _gqa(
        c, bool(_get(c, "attention_bias", False)), False, qk_norm="head" if _get(c, "use_qk_norm", False) else ""
    )


def _deepseek_shared(c) -> int:
    return int(_get(c, "n_shared_experts", 0) or 0) * c.moe_intermediate_size


def _every_layer_moe(attention: Callable[[object], _Tally], experts: str, biases: bool = False) -> Family:
    """A family whose every layer is MoE with experts of width intermediate_size (Mixtral, OLMoE, gpt-oss); the number
    of experts under the config key `experts`; `biases`: the experts' and the router's (gpt-oss)."""
    return Family(
        attention,
        _always,
        moe=lambda c: _experts(c, getattr(c, experts), c.intermediate_size, bias=biases, router_bias=biases),
        mlp=None,
        expert_width=lambda c: c.intermediate_size,
    )


def _deepseek_moe(attention: Callable[[object], _Tally]) -> Family:
    """DeepSeek's MoE layers (dense before first_k_dense_replace; routed experts, the shared ones, the correction bias
    a buffer) under `attention`: MLA in DeepSeek-V2/V3, grouped-query attention in GLM-4.5."""
    return Family(
        attention,
        _deepseek_sparse,
        moe=_deepseek_block,
        mlp=_dense_mlp,
        expert_width=lambda c: c.moe_intermediate_size,
        shared_width=_deepseek_shared,
    )


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        _qwen3_attention,
        _qwen_sparse,
        moe=lambda c: _experts(c, c.num_experts, c.moe_intermediate_size),
        mlp=_dense_mlp,
        expert_width=lambda c: c.moe_intermediate_size,
    ),
    "qwen3": Family(_qwen3_attention, _never, moe=None, mlp=_dense_mlp),
    "qwen2_moe": Family(
        lambda c: _gqa(c, bool(_get(c, "qkv_bias", True)), False),
        _qwen_sparse,
        moe=_qwen2_moe_block,
        mlp=_dense_mlp,
        expert_width=lambda c: c.moe_intermediate_size,
        shared_width=lambda c: int(_get(c, "shared_expert_intermediate_size", 0)),
    ),
    "qwen2": Family(lambda c: _gqa(c, True, False), _never, moe=None, mlp=_dense_mlp),
    "mixtral": _every_layer_moe(lambda c: _gqa(c, False, False), "num_local_experts"),
    "mistral": Family(lambda c: _gqa(c, False, False), _never, moe=None, mlp=_dense_mlp),
    "olmoe": _every_layer_moe(_olmoe_attention, "num_experts"),
    **{name: _deepseek_moe(_mla) for name in ("deepseek_v2", "deepseek_v3")},
    "gpt_oss": _every_layer_moe(lambda c: _gqa(c, True, True, sinks=True), "num_local_experts", biases=True),
    "glm4_moe": _deepseek_moe(_glm4_moe_attention),
}


def counts(config) -> Counts | None:
    """The config's parameter counts by arithmetic, or None for a model type this module does not know."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    if c is not config:  # a vision-language model: its towers are counted on the meta device, with the rest
        return None
    family = FAMILIES.get(getattr(c, "model_type", None))
    if family is None:
        return None
    d, V, n = c.hidden_size, c.vocab_size, c.num_hidden_layers
    attention = family.attention(c)
    layers, vector, moe = [], 0, []
    for i in range(n):
        sparse = family.is_moe(c, i)
        ffn = family.moe(c) if sparse else family.mlp(c)
        t = attention.add(ffn).add(_Tally(0, family.norms * d))
        layers.append(t.total)
        vector += t.vector
        moe += [i] if sparse else []
    tied = bool(_get(c, "tie_word_embeddings", False))
    outer = V * d * (1 if tied else 2) + d  # embeddings, head unless tied, final norm
    dense = int(_get(c, "intermediate_size", 0)) if len(moe) < n and family.mlp is not None else 0
    widths = (family.expert_width(c), family.shared_width(c), dense) if moe else (0, 0, dense)
    return Counts(sum(layers) + outer, tuple(layers), vector + d, tuple(moe), tied, *widths)
