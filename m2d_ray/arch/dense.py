"""Dense decoder families for dense-to-dense (Minitron) pruning: where every tensor's prunable axes live.

Pruning (`m2d_ray/prune/`) is family-independent. It needs, per parameter, which of its axes run over
the hidden (embedding) channels, the FFN neurons, the query-head rows or the key/value-head rows, and
the modules whose activations give importance. `DenseAdapter` provides exactly that for the Llama-style
layout that Qwen3, Qwen2, Llama and Mistral share (and that the dense students of Qwen3-MoE, Qwen2-MoE
and Mixtral are), keyed by `config.model_type` like the MoE adapters in this package.

Sizes a pruned model may take: hidden <= d, ffn <= I, layers <= L, and whole key/value groups of
attention heads (heads = kv_heads x the teacher's heads per group); head_dim is kept, so rotary
embeddings and the per-head q/k norms of Qwen3 stay as they are.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import ClassVar

from torch import nn

from m2d_ray.arch import supported_types
from m2d_ray.arch.base import MoEAdapter
from m2d_ray.errors import M2DError
from m2d_ray.registry import Registry

#: axis kinds: the residual-stream channels, FFN neurons, query-head rows (heads x head_dim) and
#: key/value-head rows (kv_heads x head_dim); None = an axis that pruning never changes
HIDDEN, FFN, Q, KV = "hidden", "ffn", "q", "kv"
_LAYER_KEY = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


@dataclass(frozen=True)
class DenseSizes:
    """The four sizes the architecture search varies (key/value heads follow from `heads`)."""

    hidden: int
    ffn: int
    heads: int
    layers: int

    def to_json(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        return f"d{self.hidden}-f{self.ffn}-h{self.heads}-l{self.layers}"


class DenseAdapter:
    """The Llama-style layout: model.embed_tokens, model.layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj,
    post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head (biases optional)."""

    model_types: ClassVar[tuple[str, ...]] = ("qwen3", "qwen2", "llama", "mistral")

    #: "module.parameter" (the last two parts of a state-dict key) -> the kind of each of its axes
    #: (weights [out, in], biases [out])
    AXES: ClassVar[dict[str, tuple[str | None, ...]]] = {
        "embed_tokens.weight": (None, HIDDEN),
        "lm_head.weight": (None, HIDDEN),
        "norm.weight": (HIDDEN,),  # model.norm
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
        "q_proj.weight": (Q, HIDDEN),
        "q_proj.bias": (Q,),
        "k_proj.weight": (KV, HIDDEN),
        "k_proj.bias": (KV,),
        "v_proj.weight": (KV, HIDDEN),
        "v_proj.bias": (KV,),
        "o_proj.weight": (HIDDEN, Q),
        "o_proj.bias": (HIDDEN,),
        "q_norm.weight": (None,),  # Qwen3: over head_dim, which is kept
        "k_norm.weight": (None,),
        "gate_proj.weight": (FFN, HIDDEN),
        "gate_proj.bias": (FFN,),
        "up_proj.weight": (FFN, HIDDEN),
        "up_proj.bias": (FFN,),
        "down_proj.weight": (HIDDEN, FFN),
        "down_proj.bias": (HIDDEN,),
    }

    # ---- sizes -------------------------------------------------------------------------------------
    def sizes(self, config) -> DenseSizes:
        return DenseSizes(
            hidden=int(config.hidden_size),
            ffn=int(config.intermediate_size),
            heads=int(config.num_attention_heads),
            layers=int(config.num_hidden_layers),
        )

    def kv_heads(self, config) -> int:
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    def group_size(self, config) -> int:
        """Query heads per key/value head: heads are pruned a whole group at a time."""
        return int(config.num_attention_heads) // self.kv_heads(config)

    def head_dim(self, config) -> int:
        return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    def pruned_config(self, config, sizes: DenseSizes, kept_layers: list[int]):
        """The teacher's config class at the new sizes; head_dim explicit (it no longer follows from hidden)."""
        d = config.to_dict()
        d.update(
            hidden_size=sizes.hidden,
            intermediate_size=sizes.ffn,
            num_attention_heads=sizes.heads,
            num_key_value_heads=sizes.heads // self.group_size(config),
            num_hidden_layers=sizes.layers,
            head_dim=self.head_dim(config),
        )
        if d.get("layer_types") is not None:
            d["layer_types"] = [d["layer_types"][i] for i in kept_layers]
        return type(config).from_dict(d)

    # ---- modules whose activations give importance --------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def neuron_input(self, layer: nn.Module) -> nn.Module:
        """The module whose input is the FFN's hidden activation act(gate) * up, [.., ffn]."""
        return layer.mlp.down_proj

    def heads_input(self, layer: nn.Module) -> nn.Module:
        """The module whose input is the attention heads' outputs, concatenated head by head, [.., heads x head_dim]."""
        return layer.self_attn.o_proj

    def hidden_norms(self, model: nn.Module) -> list[nn.Module]:
        """Every norm over the hidden channels (Minitron's LayerNorm outputs): per layer both, then the final one."""
        norms = [n for layer in self.layers(model) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        return [*norms, model.model.norm]

    # ---- parameters ---------------------------------------------------------------------------------
    def split_layer(self, name: str) -> tuple[int | None, str]:
        """(layer index, the name with '{}' where the index was) of a state-dict key; (None, name) outside layers."""
        m = _LAYER_KEY.match(name)
        return (int(m.group(2)), m.group(1) + "{}" + m.group(3)) if m else (None, name)

    def axes(self, name: str) -> tuple[str | None, ...]:
        kinds = self.AXES.get(".".join(name.split(".")[-2:]))
        if kinds is not None:
            return kinds
        raise M2DError(
            f"parameter {name!r} has no known layout for pruning; this model is not a plain "
            f"{'/'.join(self.model_types)} decoder: use one of those"
        )


DENSE_ADAPTERS: Registry[DenseAdapter] = Registry(
    "dense model", "model_type {name!r} is not a supported {kind}{hint}; use one of: {names}"
)
for _type in DenseAdapter.model_types:
    DENSE_ADAPTERS.register(_type)(DenseAdapter())


def dense_types() -> list[str]:
    return sorted(DENSE_ADAPTERS)


def get_dense_adapter(config) -> DenseAdapter:
    """The adapter of a dense teacher; an MoE or unknown model fails with one line."""

    model_type = getattr(config, "model_type", None)
    if model_type in supported_types():
        raise M2DError(
            f"model_type {model_type!r} is a Mixture-of-Experts model; dense-to-dense pruning takes a dense "
            f"teacher ({', '.join(dense_types())}): give its dense twin, e.g. m2d_ray/assets/tiny_qwen3_dense"
        )
    return DENSE_ADAPTERS[model_type]


class DenseLayout(MoEAdapter):
    """A dense decoder of the layout above as the lazy reader (`weights.open_model`) walks a teacher: its decoder
    layers and final norm where the MoE families keep theirs, no MoE block, checkpoint names as in memory. What a dense
    teacher (the d2d baseline's) needs to be read one layer at a time, as the sharded teacher reads it."""

    def moe_blocks(self, model: nn.Module) -> dict[int, nn.Module]:
        return {}


def dense_layout(config) -> DenseLayout:
    """The reading layout of a dense teacher; an MoE or unknown model fails with one line (`get_dense_adapter`)."""
    get_dense_adapter(config)
    return DenseLayout()
