"""The sizes a memory plan needs, from a model's config alone: its parameters counted by arithmetic (arch/counts.py),
or on the meta device for a family that module does not know (no weights are read either way). A config read as plain
JSON (arch/json_config.py) is answered for by its plain adapter: no torch is imported for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from m2d_ray.arch import get_adapter, mtp_left_out
from m2d_ray.arch.counts import Counts, attention_widths
from m2d_ray.arch.json_config import adapter_of
from m2d_ray.arch.meta import param_counts
from m2d_ray.quant import MXFP4, scheme_of, stored_bytes

if TYPE_CHECKING:
    from m2d_ray.arch.base import MoEAdapter

GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    """One model's sizes. `ffn` is the widest FFN activation of a token: a dense width, or k x d_expert
    (+ shared experts) for an MoE; `experts`/`expert_width` are 0 for a dense model."""

    params: int
    layer_params: int  # the largest decoder layer (what a layer-streamed pass holds)
    dtype_bytes: int  # of the checkpoint
    vocab: int
    hidden: int
    layers: int
    q_width: int  # heads x head_dim
    kv_width: int  # key/value heads x head_dim
    ffn: int
    experts: int = 0
    top_k: int = 0
    expert_width: int = 0
    moe_layers: int = 0  # layers whose FFN is the E experts
    tied: bool = False  # the output head is the input embedding
    vector_params: int = 0  # norm gains and biases: elementwise, no products
    heads: int = 0  # attention heads (query; key/value): the float32 scalars a layer keeps per head (plan/memory.py)
    kv_heads: int = 0
    stored_bytes: int = 0  # the checkpoint as published (quantised: m2d_ray.quant); 0 = `weights`
    quantisation: str = ""  # how it is published quantised, in words ("" = as it is held)

    @property
    def matmul_params(self) -> int:
        """Weights a token is multiplied with when every expert runs (distill/flops.matmul_params: all but the
        input embedding, a lookup, unless it is the head too)."""
        return self.params - self.vector_params - (0 if self.tied else self.vocab * self.hidden)

    @property
    def inactive_expert_params(self) -> int:
        """Expert weights a token skips at its top-k (distill/flops.inactive_expert_params)."""
        return self.moe_layers * (self.experts - self.top_k) * 3 * self.hidden * self.expert_width

    @property
    def weights(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def checkpoint_bytes(self) -> int:
        """What is downloaded, stored and copied to every node that reads the model: its published bytes (a
        quantised teacher is held dequantised, in `dtype_bytes`, and counted so in memory)."""
        return self.stored_bytes or self.weights

    @property
    def outer_params(self) -> int:
        """Embeddings, final norm and head: what a streamed pass holds besides one layer."""
        return max(0, self.params - self.layers * self.layer_params)


def _dtype_bytes(config) -> int:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return 4 if str(dt).endswith("float32") else 2


def shape_of(config, c: Counts | None = None, adapter: MoEAdapter | None = None) -> Shape:
    """A model's Shape from its transformers config: its parameters counted by arithmetic where its family is known
    (arch/counts.py), else on the meta device (arch/meta.py); an MoE's E and k through its arch adapter.
    `c` and `adapter`: the counts and the adapter a caller already has (each read once a plan)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scheme = scheme_of(config)
    c = c or param_counts(config)
    adapter = (adapter or adapter_of(config) or get_adapter(config)) if c.moe_layers else None
    E, k = (adapter.num_experts(config), adapter.top_k(config)) if adapter else (0, 0)
    q_width, kv_width, heads, kv = attention_widths(text)
    if scheme is None:
        quantised = 0
    elif scheme.method == MXFP4:  # the experts alone (gpt-oss's gate_up_proj and down_proj)
        quantised = len(c.moe_layers) * E * 3 * text.hidden_size * c.expert_width
    else:  # the layers' matrices but the routers (published FP8 and compressed-tensors checkpoints keep them)
        quantised = max(0, sum(c.layers) - c.vector_params - len(c.moe_layers) * E * text.hidden_size)
    return Shape(
        c.params,
        max(c.layers),
        _dtype_bytes(config),
        text.vocab_size,
        text.hidden_size,
        len(c.layers),
        q_width,
        kv_width,
        max(getattr(text, "intermediate_size", 0) or 0, k * c.expert_width + c.shared_width),
        E,
        k,
        c.expert_width if adapter else 0,
        len(c.moe_layers),
        c.tied,
        c.vector_params,
        heads=heads,
        kv_heads=kv,
        stored_bytes=stored_bytes(scheme, _dtype_bytes(config), c.params, quantised) if scheme else 0,
        quantisation=scheme.label if scheme else "",
    )


@dataclass(frozen=True)
class Models:
    """The shapes a run plans for: its MoE teacher and the dense student every stage-1 config builds
    (K only chooses which experts are merged: every student has width k x d_expert + shared)."""

    teacher: Shape
    student: Shape
    teacher_config: object
    student_config: object
    notes: tuple[str, ...] = ()  # what the plan says of the family (a student that approximates its MoE blocks)


def models_of(config) -> Models:
    """Teacher and student shapes from the teacher's config (the student's config as convert/ makes it: one width,
    convert/student.student_width's widest of k x d_expert + shared and the dense layers')."""
    c = param_counts(config)
    adapter = adapter_of(config) or get_adapter(config)
    multiple = adapter.student_width_multiple(config)
    width = -(-max(c.dense_width, adapter.top_k(config) * c.expert_width + c.shared_width) // multiple) * multiple
    student = adapter.dense_config(config, width)
    student.dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    why = adapter.approximation
    notes = (f"{config.model_type}: the student approximates its MoE blocks: {why}",) if why else ()
    notes += (mtp,) if (mtp := mtp_left_out(config)) else ()
    return Models(shape_of(config, c, adapter), shape_of(student), config, student, notes)
