"""What a transformers MoE layer says about itself: the experts' layout and activation, the routing the block really
applies, its shared expert and its dense MLPs, read from the modules rather than written down per family.

transformers 5 decorates almost every experts module with `@use_experts_implementation`, which sets on each instance
`has_gate`, `is_transposed`, `is_concatenated` and `has_bias` and gives the class an `_apply_gate` (the activation,
clamps and soft-caps included); every such module is called as `experts(hidden [T, d], top_k_index [T, k],
top_k_weights [T, k])` and multiplies each chosen expert's output by its weight. So:

* the expert tensors are read in their stored layout and brought to the canonical one (`ExpertWeights`);
* the activation is the module's own `_apply_gate` (or `act_fn(gate) * up`, or `act_fn(up)` without a gate), so
  merging and concatenating stay exact whatever the family clamps;
* the routing is what the block hands its experts: the block's own forward runs up to the experts call, whose
  arguments are captured (and the call skipped), so every router (sigmoid or softmax, groups, correction biases,
  scaling factors, renormalisation) is reproduced by the model's own code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2d_ray.arch.base import DenseFFN, ExpertWeights

# Imported inside functions: transformers' experts integration (it loads the kernels hub and torch._dynamo, seconds
# that `m2d plan` and every process that only reads a config do not need).

#: where a decoder layer keeps its feed-forward module, in the order to look (transformers' own names); a `mixer`
#: (Nemotron-H: one mixer a layer, Mamba, attention, MLP or MoE) is the layer's FFN only when it is an MLP or MoE
FFN_NAMES = ("mlp", "block_sparse_moe", "feed_forward")
MIXER_NAMES = ("mixer",)
#: a block's router and its shared expert(s), and the shared expert's sigmoid gate
ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
SHARED_GATE_NAMES = ("shared_expert_gate",)


def is_experts(module: nn.Module) -> bool:
    """An experts module decorated with transformers' `use_experts_implementation` (its layout flags are set)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "has_bias"))


def child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    return next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), nn.Module)), None)


# ---- activations: elementwise in the hidden unit (so concatenation stays exact) ----------------------------------
@dataclass(frozen=True)
class Gated:
    """act_fn(gate) * up: transformers' default `_apply_gate` and every gated dense MLP."""

    act_fn: Callable[[Tensor], Tensor]

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.act_fn(gate) * up


@dataclass(frozen=True)
class Ungated:
    """act_fn(up) of experts and MLPs without a gate projection (relu^2): their `gate` is `up` itself."""

    act_fn: Callable[[Tensor], Tensor]

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.act_fn(up)


@dataclass(frozen=True)
class OwnGate:
    """The experts module's own `_apply_gate` (clamped, offset, soft-capped or float32 SwiGLU), fed the gate and up
    halves in the layout it reads: concatenated [gate; up] or interleaved (g0, u0, g1, u1 ...)."""

    experts: nn.Module
    concatenated: bool

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        both = torch.cat([gate, up], dim=-1) if self.concatenated else torch.stack([gate, up], dim=-1).flatten(-2)
        return self.experts._apply_gate(both).to(gate.dtype)


def activation(experts: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    from transformers.integrations.moe import _default_apply_gate

    if not experts.has_gate:
        return Ungated(experts.act_fn)
    if type(experts)._apply_gate is _default_apply_gate and experts.is_concatenated:
        return Gated(experts.act_fn)
    return OwnGate(experts, bool(experts.is_concatenated))


# ---- expert tensors ---------------------------------------------------------------------------------------------
def _split(t: Tensor, concatenated: bool) -> tuple[Tensor, Tensor]:
    """Gate and up halves along dim 1 of a fused [E, 2I, ...] tensor."""
    return t.chunk(2, dim=1) if concatenated else (t[:, ::2], t[:, 1::2])


def expert_weights(experts: nn.Module) -> ExpertWeights:
    """The module's E experts in the canonical layout (views, no copies)."""
    t = experts.is_transposed

    def canon(w: Tensor) -> Tensor:  # [E, out, in]
        w = w.detach()
        return w.transpose(1, 2) if t else w

    if experts.has_gate:
        gate, up = _split(canon(experts.gate_up_proj), experts.is_concatenated)
    else:
        gate = up = canon(experts.up_proj)
    gate_bias = up_bias = down_bias = None
    if experts.has_bias:
        if experts.has_gate:
            gate_bias, up_bias = _split(experts.gate_up_proj_bias.detach(), experts.is_concatenated)
        else:
            gate_bias = up_bias = experts.up_proj_bias.detach()
        down_bias = experts.down_proj_bias.detach()
    return ExpertWeights(
        gate=gate,
        up=up,
        down=canon(experts.down_proj),
        act=activation(experts),
        gate_bias=gate_bias,
        up_bias=up_bias,
        down_bias=down_bias,
    )


def experts_state(experts: nn.Module, prefix: str, ffns: list[DenseFFN]) -> dict[str, Tensor]:
    """State-dict entries of an experts module holding `ffns` as its experts (the inverse of `expert_weights`)."""

    def stored(w: Tensor) -> Tensor:  # [E, out, in] -> the module's layout
        return (w.transpose(1, 2) if experts.is_transposed else w).contiguous()

    def fuse(g: Tensor, u: Tensor) -> Tensor:  # along dim 1 of [E, I, ...]
        return torch.cat([g, u], dim=1) if experts.is_concatenated else torch.stack([g, u], dim=2).flatten(1, 2)

    gate = torch.stack([f.gate for f in ffns])
    up = torch.stack([f.up for f in ffns])
    out = {prefix + "down_proj": stored(torch.stack([f.down for f in ffns]))}
    if experts.has_gate:
        out[prefix + "gate_up_proj"] = stored(fuse(gate, up))
    else:
        out[prefix + "up_proj"] = stored(up)
    if experts.has_bias:
        W, d = gate.shape[1], ffns[0].down.shape[0]

        def bias(t: Tensor | None, n: int) -> Tensor:
            return t if t is not None else torch.zeros(n, dtype=gate.dtype)

        gb = torch.stack([bias(f.gate_bias, W) for f in ffns])
        ub = torch.stack([bias(f.up_bias, W) for f in ffns])
        out[prefix + ("gate_up_proj_bias" if experts.has_gate else "up_proj_bias")] = (
            fuse(gb, ub) if experts.has_gate else ub
        ).contiguous()
        out[prefix + "down_proj_bias"] = torch.stack([bias(f.down_bias, d) for f in ffns])
    return out


# ---- dense MLPs (a family's dense layers and shared experts) ----------------------------------------------------
#: (gate, up, down) names of a dense MLP's projections: Llama's, Mistral's original ones, gate-less ones, and one
#: Linear holding [gate; up] (its up name None)
_DENSE_NAMES = (
    ("gate_proj", "up_proj", "down_proj"),
    ("w1", "w3", "w2"),
    ("gate_up_proj", None, "down_proj"),
    (None, "up_proj", "down_proj"),
)


def _linear(mlp: nn.Module, name: str | None) -> nn.Linear | None:
    m = getattr(mlp, name, None) if name else None
    return m if isinstance(m, nn.Linear) else None


def dense_names(mlp: nn.Module) -> tuple[str | None, str, str] | None:
    """The (gate, up, down) projection names of a dense MLP, None for a module that is not one."""
    for names in _DENSE_NAMES:
        gate, up, down = (_linear(mlp, n) for n in names)
        if down is not None and all(m is not None or n is None for m, n in zip((gate, up), names[:2])):
            return names
    return None


def dense_act(mlp: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None) or F.silu
    return Gated(act) if dense_names(mlp)[0] else Ungated(act)


def dense_ffn(mlp: nn.Module) -> DenseFFN:
    """A dense MLP's projections as a DenseFFN (a gate-less MLP's gate is its up projection)."""
    g, u, d = dense_names(mlp)

    def wb(name: str) -> tuple[Tensor, Tensor | None]:
        m = getattr(mlp, name)
        return m.weight.detach(), None if m.bias is None else m.bias.detach()

    down, down_bias = wb(d)
    if u is None:  # one [gate; up] Linear
        both, both_bias = wb(g)
        (gate, up), (gate_bias, up_bias) = both.chunk(2), (None, None) if both_bias is None else both_bias.chunk(2)
    else:
        up, up_bias = wb(u)
        gate, gate_bias = wb(g) if g else (up, up_bias)
    return DenseFFN(
        gate=gate, up=up, down=down, act=dense_act(mlp), gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias
    )


def dense_state(mlp: nn.Module, prefix: str, ffn: DenseFFN) -> dict[str, Tensor]:
    """State-dict entries of a dense MLP module holding `ffn` (the inverse of `dense_ffn`)."""
    g, u, d = dense_names(mlp)
    out = {}
    parts = ((g, ffn.gate, ffn.gate_bias), (u, ffn.up, ffn.up_bias), (d, ffn.down, ffn.down_bias))
    if u is None:  # one [gate; up] Linear
        both_bias = None if ffn.gate_bias is None else torch.cat([ffn.gate_bias, ffn.up_bias])
        parts = ((g, torch.cat([ffn.gate, ffn.up]), both_bias), parts[2])
    for name, w, bias in parts:
        if name is None:
            continue
        out[f"{prefix}{name}.weight"] = w
        if getattr(mlp, name).bias is not None:
            out[f"{prefix}{name}.bias"] = bias if bias is not None else torch.zeros(w.shape[0], dtype=w.dtype)
    return out


# ---- routing as the block applies it ------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised by the experts' pre-hook: the routing is known, the experts need not run."""


def _experts_call(experts: nn.Module, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
    bound = inspect.signature(type(experts).forward).bind(experts, *args, **kwargs)
    values = list(bound.arguments.values())[1:]
    return values[1], values[2]  # hidden, top_k_index, top_k_weights


@dataclass(frozen=True)
class Captured:
    logits: Tensor | None  # [T, E]: the router's first output
    index: Tensor  # [T, k]
    weight: Tensor  # [T, k]: what the experts module multiplies each chosen expert's output by


def token_inputs(block: nn.Module, ids: Tensor | None, shape: tuple[int, ...]) -> dict[str, Tensor]:
    """The token ids a block's forward reads beside its hidden states (DeepSeek-V4's hash-routed layers choose their
    experts by token id), shaped as its hidden states' tokens; none for a block that reads none."""
    if ids is None or "input_ids" not in inspect.signature(type(block).forward).parameters:
        return {}
    return {"input_ids": ids.reshape(shape)}


def capture_routing(block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Captured:
    """Run `block`'s own forward on tokens h [T, d] (and their ids [T], where it reads them) up to its experts call:
    the index and weights it passes them and its router's logits. The block's own hooks do not fire (its forward
    is called, not the module)."""
    got: dict[str, Tensor] = {}
    experts, router = block.experts, child(block, ROUTER_NAMES)

    def pre(module, args, kwargs):
        got["index"], got["weight"] = _experts_call(module, args, kwargs)
        raise _Stop

    def post(module, args, out):
        got["logits"] = out[0] if isinstance(out, tuple) else out

    handles = [experts.register_forward_pre_hook(pre, with_kwargs=True)]
    if router is not None:
        handles.append(router.register_forward_hook(post))
    try:
        type(block).forward(block, h.unsqueeze(0), **token_inputs(block, ids, (1, h.shape[0])))
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if "index" not in got:
        raise RuntimeError(f"{type(block).__name__} never called its experts")
    return Captured(got.get("logits"), got["index"].reshape(h.shape[0], -1), got["weight"].reshape(h.shape[0], -1))


def name_of(model: nn.Module, module: nn.Module) -> str:
    """A submodule's qualified name in `model`."""
    return next(n for n, m in model.named_modules() if m is module)
