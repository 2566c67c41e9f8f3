"""What every architecture adapter provides, plus the family-independent expert math.

An adapter hides one model family's names and tensor layouts. Everything downstream (calibration,
scoring, grouping, merging, export) only sees the plain tensors defined here:

* `ExpertWeights`: E experts as gate [E, I, d], up [E, I, d], down [E, d, I] (+ optional biases) and
  the activation that combines gate and up.
* `Routing`: for T tokens, the router softmax over all E experts, the top-k indices and the weights
  the model really applies to them.
* `DenseFFN`: one SwiGLU-style FFN of width W, what a student layer holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2d_ray.errors import M2DError


# --------------------------------------------------------------------------------------------
# Activations: elementwise in the hidden unit, so block concatenation of experts stays exact.
# --------------------------------------------------------------------------------------------
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def clamped_swiglu(alpha: float, limit: float) -> Callable[[Tensor, Tensor], Tensor]:
    """GPT-OSS's SwiGLU: clamped gate and up, sigmoid(alpha * gate) gating, (up + 1)."""

    def act(gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act


@dataclass(frozen=True)
class ExpertWeights:
    """E experts in one canonical layout (views into the model's tensors where possible)."""

    gate: Tensor  # [E, I, d]
    up: Tensor  # [E, I, d]
    down: Tensor  # [E, d, I]
    act: Callable[[Tensor, Tensor], Tensor] = swiglu
    gate_bias: Tensor | None = None  # [E, I]
    up_bias: Tensor | None = None  # [E, I]
    down_bias: Tensor | None = None  # [E, d]

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def width(self) -> int:
        return self.gate.shape[1]

    def to(self, dtype: torch.dtype) -> ExpertWeights:
        def cast(t):
            return None if t is None else t.to(dtype)

        return replace(
            self,
            gate=cast(self.gate),
            up=cast(self.up),
            down=cast(self.down),
            gate_bias=cast(self.gate_bias),
            up_bias=cast(self.up_bias),
            down_bias=cast(self.down_bias),
        )

    def select(self, idx: list[int]) -> ExpertWeights:
        def pick(t):
            return None if t is None else t[idx]

        return replace(
            self,
            gate=pick(self.gate),
            up=pick(self.up),
            down=pick(self.down),
            gate_bias=pick(self.gate_bias),
            up_bias=pick(self.up_bias),
            down_bias=pick(self.down_bias),
        )


def expert_hidden(w: ExpertWeights, h: Tensor) -> Tensor:
    """Activations of every expert on every token, [E, T, I], with one GEMM for gate and up.

    Stacking gate and up of all experts into one [E*2I, d] matrix turns E small products into a
    single large one, which is what makes all-expert calibration fast.
    """
    E, I, d = w.gate.shape
    x = F.linear(h, stacked_gate_up(w)).view(h.shape[0], E, 2, I)
    g, u = x[:, :, 0], x[:, :, 1]
    if w.gate_bias is not None:
        g = g + w.gate_bias
    if w.up_bias is not None:
        u = u + w.up_bias
    return w.act(g, u).transpose(0, 1)


def stacked_gate_up(w: ExpertWeights) -> Tensor:
    """[E*2I, d]: each expert's gate rows, then its up rows. A view, not a copy, when gate and up are the two
    halves of one fused [E, 2I, d] tensor (the transformers layout of most families)."""
    E, I, d = w.gate.shape
    g, u = w.gate, w.up
    fused = g.stride() == u.stride() == (2 * I * d, d, 1) and u.data_ptr() == g.data_ptr() + I * d * g.element_size()
    return (
        g.as_strided((E * 2 * I, d), (d, 1))
        if fused and g.dtype == u.dtype
        else torch.cat([g, u], dim=1).reshape(E * 2 * I, d)
    )


def expert_outputs(w: ExpertWeights, h: Tensor) -> Tensor:
    """Raw outputs f_e(h_t) of every expert on every token, [E, T, d] (no routing weight)."""
    a = expert_hidden(w, h)
    y = torch.bmm(a, w.down.transpose(1, 2))
    if w.down_bias is not None:
        y = y + w.down_bias[:, None, :]
    return y


@dataclass(frozen=True)
class Routing:
    """Router decisions for T tokens."""

    probs: Tensor  # [T, E] float32: softmax over all E (before any top-k renormalisation)
    index: Tensor  # [T, k] long: the selected experts
    weight: Tensor  # [T, k]: the weights the model applies to the selected experts' outputs


@dataclass(frozen=True)
class SharedExpert:
    """Always-on experts of a layer, concatenated into one FFN.

    `gate` is None when the shared output is added with weight 1 (DeepSeek); otherwise the shared
    output is multiplied by sigmoid(gate @ h) (Qwen2-MoE) and the student uses its calibrated mean.
    """

    weights: ExpertWeights  # E == 1
    gate: Tensor | None = None  # [1, d]

    def scale(self, h: Tensor) -> Tensor:
        """Per-token multiplier [T] applied to the shared output."""
        if self.gate is None:
            return torch.ones(h.shape[0], dtype=h.dtype, device=h.device)
        return torch.sigmoid(F.linear(h, self.gate.to(h.dtype)))[:, 0]


@dataclass(frozen=True)
class DenseFFN:
    """One dense FFN of width W: what each student layer holds."""

    gate: Tensor  # [W, d]
    up: Tensor  # [W, d]
    down: Tensor  # [d, W]
    act: Callable[[Tensor, Tensor], Tensor] = swiglu
    gate_bias: Tensor | None = None
    up_bias: Tensor | None = None
    down_bias: Tensor | None = None

    @property
    def width(self) -> int:
        return self.gate.shape[0]

    def pad_to(self, width: int) -> DenseFFN:
        """Append zero hidden units; zero down-columns make the padding exact for any activation."""
        extra = width - self.width
        if extra < 0:
            raise ValueError(f"cannot pad width {self.width} down to {width}")
        if extra == 0:
            return self

        def rows(t: Tensor | None) -> Tensor | None:
            return None if t is None else F.pad(t, (0, 0, 0, extra) if t.dim() == 2 else (0, extra))

        return replace(
            self,
            gate=rows(self.gate),
            up=rows(self.up),
            down=F.pad(self.down, (0, extra)),
            gate_bias=rows(self.gate_bias),
            up_bias=rows(self.up_bias),
        )

    def part(self, rows: slice) -> DenseFFN:
        """The hidden units `rows` alone (the down projection's bias kept by the part that starts at unit 0): the
        parts' outputs sum to the whole's, for any activation, since units do not mix."""
        return replace(
            self,
            gate=self.gate[rows],
            up=self.up[rows],
            down=self.down[:, rows],
            gate_bias=None if self.gate_bias is None else self.gate_bias[rows],
            up_bias=None if self.up_bias is None else self.up_bias[rows],
            down_bias=self.down_bias if not rows.start else None,
        )

    def __call__(self, h: Tensor) -> Tensor:
        g = F.linear(h, self.gate, self.gate_bias)
        u = F.linear(h, self.up, self.up_bias)
        return F.linear(self.act(g, u), self.down, self.down_bias)


def dense_from_mlp(mlp: nn.Module) -> DenseFFN:
    """A teacher's dense (non-MoE) layer with gate_proj/up_proj/down_proj Linear modules."""
    return DenseFFN(
        gate=mlp.gate_proj.weight.detach(),
        up=mlp.up_proj.weight.detach(),
        down=mlp.down_proj.weight.detach(),
    )


def mlp_as_expert(mlp: nn.Module) -> ExpertWeights:
    """A gate_proj/up_proj/down_proj SwiGLU MLP as one expert (E == 1)."""
    if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
        raise M2DError("shared experts with biases (mlp_bias=True) are not supported")
    d = dense_from_mlp(mlp)
    return ExpertWeights(gate=d.gate.unsqueeze(0), up=d.up.unsqueeze(0), down=d.down.unsqueeze(0))


def softmax_routing(logits: Tensor, weight: Tensor, index: Tensor) -> Routing:
    """Routing for routers whose probabilities are a softmax over all E router logits."""
    return Routing(probs=torch.softmax(logits.float(), dim=-1), index=index, weight=weight)


class MoEAdapter:
    """One model family. Subclasses set `model_types` and implement the abstract methods."""

    model_types: ClassVar[tuple[str, ...]] = ()
    #: transformers model_type of the dense student (may equal the teacher's)
    student_model_type: ClassVar[str] = ""
    #: the dtype a student's FFN is checked in against the method's float64 reference, and the relative error it
    #: must stay under: float64 round-off, unless the family's own code computes its experts in float32
    exact_dtype: ClassVar[torch.dtype] = torch.float64
    exact_tol: ClassVar[float] = 1e-10
    #: what the dense student cannot reproduce of the teacher's MoE block, where the family's layer makes the
    #: method's FFN an approximation of it ("" where the method's FFN is the block's own function)
    approximation: ClassVar[str] = ""

    # ---- teacher structure -------------------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def ffn(self, layer: nn.Module) -> nn.Module:
        """A decoder layer's feed-forward module: its MoE block, or its dense MLP."""
        return layer.mlp

    def dense_ffn(self, mlp: nn.Module) -> DenseFFN:
        """A dense (non-MoE) FFN module's projections."""
        return dense_from_mlp(mlp)

    def final_norm(self, model: nn.Module) -> nn.Module:
        """The norm after the last decoder layer (what the output projection reads)."""
        return model.model.norm

    def moe_blocks(self, model: nn.Module) -> dict[int, nn.Module]:
        """Layer index -> MoE block (the module whose input is the post-attention hidden state)."""
        return {i: self.ffn(layer) for i, layer in enumerate(self.layers(model)) if self.is_moe(self.ffn(layer))}

    def is_moe(self, mlp: nn.Module) -> bool:
        return hasattr(mlp, "experts")

    def input_module(self, block: nn.Module) -> nn.Module:
        """The module whose forward's first argument is the block's input, where calibration observes it (the block
        itself, but where the block is a decoder layer whose MoE branch reads the residual: Gemma-4's router)."""
        return block

    def expert_input(self, block: nn.Module, h: Tensor) -> Tensor:
        """What the experts compute on, from the block's input h (h itself, but where the layer normalises the
        experts' input apart from the router's: Gemma-4)."""
        return h

    def num_experts(self, config) -> int:
        raise NotImplementedError

    def top_k(self, config) -> int:
        return int(config.num_experts_per_tok)

    def renormalizes(self, config) -> bool:
        """Whether the applied top-k weights sum to one (else avg-cp scaling is the natural one)."""
        return bool(getattr(config, "norm_topk_prob", True))

    def routed_scale(self, config) -> float:
        """Factor the router multiplies the applied top-k weights by (DeepSeek's routed_scaling_factor):
        uniform and proportional scales are multiplied by it so the student keeps the output magnitude."""
        return 1.0

    def router(self, block: nn.Module) -> nn.Module:
        """The block's router module (returns logits, applied top-k weights, top-k indices)."""
        return block.gate

    def route(self, block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Routing:
        """Router decisions for tokens h [T, d] (their token ids [T], for a block that routes by them), computed by
        the model's own router module."""
        logits, weight, index = self.router(block)(h)
        return softmax_routing(logits, weight, index)

    def check_top_k(self, config, k: int) -> None:
        """Expanded routing uses at least the model's own k and at most all E experts."""
        own, E = self.top_k(config), self.num_experts(config)
        if not own <= k <= E:
            raise M2DError(
                f"teacher top-k {k} outside [k, E] = [{own}, {E}]: expanded routing uses at least the teacher's own k"
            )

    def set_top_k(self, model: nn.Module, k: int) -> None:
        """Expanded routing: every MoE block uses its top-`k` experts, weighted by the router's own rule
        (renormalised top-k probabilities where the model renormalises). The router's `top_k`, and the block's
        where it keeps one too (several families read the block's)."""
        self.check_top_k(model.config, k)
        for block in self.moe_blocks(model).values():
            self.router(block).top_k = k
            if hasattr(block, "top_k"):
                block.top_k = k

    def expert_module(self, block: nn.Module) -> nn.Module:
        """The submodule holding the block's fused expert tensors (every one has leading dimension E)."""
        return block.experts

    def experts(self, block: nn.Module) -> ExpertWeights:
        """Fused transformers-5 layout: gate_up_proj [E, 2I, d] (gate first), down_proj [E, d, I]."""
        ex = self.expert_module(block)
        gate, up = ex.gate_up_proj.detach().chunk(2, dim=1)
        return ExpertWeights(gate=gate, up=up, down=ex.down_proj.detach(), act=self.activation(block))

    def activation(self, block: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
        return swiglu

    def router_weight(self, block: nn.Module) -> Tensor:
        """Router rows [E, d] (for router-based grouping)."""
        return self.router(block).weight.detach()

    def shared(self, block: nn.Module) -> SharedExpert | None:
        return None

    def block_output(self, block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Tensor:
        """The model's own MoE block output for hidden states [B, S, d] (parity tests)."""
        out = block(h)
        return out[0] if isinstance(out, tuple) else out

    # ---- checkpoint layout (read lazily by m2d_ray/weights.py) ----------------------------
    #: per-expert checkpoint keys of each fused expert tensor, relative to the experts module (`{e}` =
    #: expert id): stacked over experts, then concatenated along dim 1, as transformers fuses them on
    #: load. transformers-5 `save_pretrained` and the hub store experts this way for most families.
    per_expert_keys: ClassVar[dict[str, tuple[str, ...]]] = {
        "gate_up_proj": ("{e}.gate_proj.weight", "{e}.up_proj.weight"),
        "down_proj": ("{e}.down_proj.weight",),
    }

    def checkpoint_names(self, name: str) -> tuple[str, ...]:
        """Names the in-memory tensor `name` may have in a checkpoint (the first one present is read)."""
        return (name,)

    # ---- student -----------------------------------------------------------------------
    def student_config(self, config, width: int):
        """Config of the dense student whose every FFN has width `width`."""
        raise NotImplementedError

    def unstreamable(self, config) -> str | None:
        """Why the teacher's layers cannot run one at a time with the hidden states carried between them (a layer
        that reads another layer's state), None where they can (calibrate/stream.py)."""
        return None

    def dense_config(self, config, width: int):
        """`student_config`, unquantised whatever the teacher was published in (the student is written in the
        teacher's compute dtype: `m2d_ray.quant`): what conversion and the plan build."""
        return unquantised(self.student_config(config, width))

    def student_width_multiple(self, config) -> int:
        """The student's FFN width is padded to a multiple of this (a student whose FFN is split over experts)."""
        return 1

    def student_ffn_state(self, student: nn.Module, layer: int, ffn: DenseFFN) -> dict[str, Tensor]:
        """State-dict entries of the FFN of `student`'s layer `layer` holding `ffn` (`student` may be on meta)."""
        prefix = self.ffn_prefix(layer)
        out = {
            prefix + "gate_proj.weight": ffn.gate,
            prefix + "up_proj.weight": ffn.up,
            prefix + "down_proj.weight": ffn.down,
        }
        return out

    def student_ffn(self, mlp: nn.Module) -> Callable[[Tensor], Tensor]:
        """Callable evaluating a student's FFN module on tokens [T, d] (for the export check)."""
        return mlp

    def ffn_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.mlp."


def unquantised(config):
    """`config` without the teacher's `quantization_config` (a student is never stored quantised)."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def copy_config(target_cls, config, **overrides):
    """Build `target_cls` from the fields of `config` it knows, then apply overrides. A field the teacher's config
    leaves out but its modelling code derives is derived the same way, not left to the target's default: a config
    without `head_dim` means hidden_size // num_attention_heads to every transformers attention (Qwen3's default
    of 128 would build another attention)."""
    known = set(target_cls().to_dict())
    src = config.to_dict()
    kwargs = {
        k: v for k, v in src.items() if k in known and k not in ("model_type", "architectures", "transformers_version")
    }
    if "head_dim" in known and kwargs.get("head_dim") is None and getattr(config, "num_attention_heads", None):
        kwargs["head_dim"] = config.hidden_size // config.num_attention_heads
    kwargs.update(overrides)
    return target_cls(**kwargs)


def rel_error(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both vanish)."""
    num = torch.linalg.vector_norm((a - b).double()).item()
    den = torch.linalg.vector_norm(b.double()).item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)
