"""The MoE families read from their layer's structure (`structure.py`), each declared by what the code cannot read.

`StructuredAdapter` reads the experts, their activation, the routing the block applies, the shared expert and the
dense MLPs from the modules themselves. A `Family` says only:

* `scores`: how the router's logits become the distribution over all E experts that the method's statistics use
  (a softmax, or sigmoid scores normalised to sum 1); the *applied* weights are always the block's own;
* `renormalized`: whether the applied top-k weights sum to one (a bool, or the config key that says it);
* `student`: "dense" (the family's own config knob makes every layer a plain MLP of the class: `mlp_layer_types`,
  `first_k_dense_replace`, `mlp_only_layers`, `num_dense_layers`, `moe_layer_start_index`, whichever the config
  has) or "one-expert" (the same class with one expert, chosen every time by a zeroed router: the routing weight
  a zeroed router gives is read by running the student's block, and divided out of the down projection). Experts
  with an activation of their own (clamps, soft-caps) always get the one-expert student, which keeps it; a router
  that limits groups gets two experts holding the halves of the FFN (its group top-2 needs two);
* `note`: what the student cannot reproduce, said where a family's dense FFN is an approximation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor, nn

from m2d_ray.arch.base import DenseFFN, ExpertWeights, MoEAdapter, Routing, SharedExpert
from m2d_ray.arch.structure import (
    FFN_NAMES,
    MIXER_NAMES,
    ROUTER_NAMES,
    SHARED_GATE_NAMES,
    SHARED_NAMES,
    OwnGate,
    capture_routing,
    child,
    dense_ffn,
    dense_names,
    dense_state,
    expert_weights,
    experts_state,
    is_experts,
    name_of,
    token_inputs,
)
from m2d_ray.errors import M2DError

#: config keys, in the order to read them: the number of routed experts, the experts a token uses, a routed
#: expert's width, the dense layers' widths, the routed scaling factor, the group count of a group-limited router
EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts")
EXPERT_WIDTH_KEYS = ("moe_intermediate_size",)
DENSE_WIDTH_KEYS = (
    "intermediate_size",
    "prefix_dense_intermediate_size",
    "first_dense_intermediate_size",
    "dense_intermediate_size",
    "mlp_only_intermediate_size",
    "intermediate_size_mlp",
)
SCALE_KEYS = ("routed_scaling_factor", "route_scale", "router_scaling_factor", "moe_routed_scaling_factor")
GROUP_KEYS = ("n_group", "num_expert_group")
TOP_GROUP_KEYS = ("topk_group",)


def _first(config, keys: tuple[str, ...], default=None):
    return next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), default)


def _dense_knob(config, knob: tuple[tuple[str, object], ...] = ()) -> dict:
    """The config fields that make every layer of the family's class a dense MLP: the family's own where it
    declares one, else the first the config has."""
    if knob:  # declared as tuples (the family is frozen); configs want lists
        return {k: list(v) if isinstance(v, tuple) else v for k, v in knob}
    n = int(config.num_hidden_layers)
    if getattr(config, "mlp_layer_types", None) is not None:
        return {"mlp_layer_types": ["dense"] * n}
    if getattr(config, "layers_block_type", None) is not None:  # one mixer a layer: its MoE ones become MLPs
        return {"layers_block_type": ["mlp" if t == "moe" else t for t in config.layers_block_type]}
    if hasattr(config, "first_k_dense_replace"):
        return {"first_k_dense_replace": n}
    if hasattr(config, "mlp_only_layers"):
        return {"mlp_only_layers": list(range(n))}
    if hasattr(config, "num_dense_layers"):
        return {"num_dense_layers": n}
    if hasattr(config, "moe_layer_start_index"):
        return {"moe_layer_start_index": n}
    raise M2DError(f"{config.model_type} has no config field that makes its layers dense")


@dataclass(frozen=True)
class Family:
    model_type: str
    scores: str = "softmax"  # or "sigmoid"
    renormalized: bool | str = "norm_topk_prob"
    student: str = "dense"  # or "one-expert"
    note: str = ""
    #: the config fields that make every layer dense, where none of the usual ones does it
    knob: tuple[tuple[str, object], ...] = ()
    #: why a layer-streamed pass cannot carry the model's state from layer to layer ("" where it can)
    unstreamed: str = ""
    #: the family's own code computes its experts in float32 (their output is exact to float32 round-off)
    float32: bool = False


class StructuredAdapter(MoEAdapter):
    """One family read from its layer's structure; see the module docstring."""

    family: Family
    _applied_cache: ClassVar[dict] = {}

    def __init__(self, family: Family) -> None:
        self.family = family
        self.model_types = (family.model_type,)
        self.student_model_type = family.model_type
        if family.float32:
            self.exact_dtype, self.exact_tol = torch.float32, 1e-5
        self.approximation = family.note

    # ---- config -------------------------------------------------------------------------------------------
    def num_experts(self, config) -> int:
        return int(_first(config, EXPERTS_KEYS))

    def top_k(self, config) -> int:
        return int(_first(config, TOP_K_KEYS))

    def renormalizes(self, config) -> bool:
        r = self.family.renormalized
        return bool(getattr(config, r, True)) if isinstance(r, str) else r

    def routed_scale(self, config) -> float:
        return float(_first(config, SCALE_KEYS, 1.0))

    def unstreamable(self, config) -> str | None:
        return self.family.unstreamed or None

    # ---- teacher structure ----------------------------------------------------------------------------------
    def ffn(self, layer: nn.Module) -> nn.Module | None:
        """The layer's MoE block or dense MLP; None for a layer without one (a Mamba or attention mixer)."""
        found = child(layer, FFN_NAMES)
        if found is not None:
            return found
        mixer = child(layer, MIXER_NAMES)
        return mixer if mixer is not None and (self.is_moe(mixer) or dense_names(mixer) is not None) else None

    def moe_blocks(self, model: nn.Module) -> dict[int, nn.Module]:
        return {i: f for i, layer in enumerate(self.layers(model)) if self.is_moe(f := self.ffn(layer))}

    def is_moe(self, mlp: nn.Module | None) -> bool:
        return mlp is not None and is_experts(getattr(mlp, "experts", None) or nn.Module())

    def router(self, block: nn.Module) -> nn.Module:
        return child(block, ROUTER_NAMES)

    def route(self, block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Routing:
        cap = capture_routing(block, h, ids)
        logits = cap.logits.reshape(h.shape[0], -1).float()
        if self.family.scores == "sigmoid":
            s = torch.sigmoid(logits)
            probs = s / s.sum(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(logits, dim=-1)
        return Routing(probs=probs, index=cap.index.long(), weight=cap.weight * _block_scale(block))

    def experts(self, block: nn.Module):
        w = expert_weights(block.experts)
        d = block.experts.config.hidden_size
        if w.gate.shape[2] != d:
            raise M2DError(
                f"{type(block).__name__}'s experts work in a latent space of {w.gate.shape[2]}, not the hidden size "
                f"{d} (moe_latent_size): the method would need the latent projections folded into each expert"
            )
        return w

    def activation(self, block: nn.Module):
        return self.experts(block).act

    def router_weight(self, block: nn.Module) -> Tensor:
        E = block.experts.num_experts if hasattr(block.experts, "num_experts") else None
        rows = [p for p in self.router(block).parameters() if p.ndim == 2 and (E is None or p.shape[0] == E)]
        return rows[0].detach()

    def shared(self, block: nn.Module) -> SharedExpert | None:
        mlp = child(block, SHARED_NAMES)
        if mlp is None or dense_names(mlp) is None:
            return None
        f = dense_ffn(mlp)
        weights = ExpertWeights(
            gate=f.gate.unsqueeze(0), up=f.up.unsqueeze(0), down=f.down.unsqueeze(0), act=self._shared_act(block, f)
        )
        gate = child(block, SHARED_GATE_NAMES)
        return SharedExpert(weights=weights, gate=None if gate is None else gate.weight.detach())

    def _shared_act(self, block: nn.Module, f: DenseFFN):
        """The shared expert computes with the routed experts' own activation where they have one (the families
        that clamp both), else its MLP's."""
        act = self.experts(block).act
        return act if isinstance(act, OwnGate) else f.act

    def dense_ffn(self, mlp: nn.Module) -> DenseFFN:
        return dense_ffn(mlp)

    def block_output(self, block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Tensor:
        """The block's output before any norm of its own (axk1 normalises the sum of routed and shared experts:
        the method's FFN is what goes into that norm, which the student keeps)."""
        with _norms_bypassed(block):
            out = block(h, **token_inputs(block, ids, h.shape[:-1]))
        return out[0] if isinstance(out, tuple) else out

    # ---- student ------------------------------------------------------------------------------------------
    def student_kind(self, config) -> str:
        return self.family.student

    def student_experts(self, config) -> int:
        """Experts of a one-expert student: two where a group-limited router takes the top two of a group."""
        return 2 if _first(config, GROUP_KEYS) is not None else 1

    def student_config(self, config, width: int):
        d = config.to_dict()
        for key in ("transformers_version", "model_type"):
            d.pop(key, None)
        for key in DENSE_WIDTH_KEYS:
            if d.get(key) is not None or (key == "intermediate_size" and key in d):
                d[key] = width
        if self.student_kind(config) == "dense":
            d.update(_dense_knob(config, self.family.knob))
        else:
            n = self.student_experts(config)
            if width % n:
                raise M2DError(f"a {n}-expert student needs a width divisible by {n}, not {width}")
            d.update({k: n for k in EXPERTS_KEYS + TOP_K_KEYS if d.get(k) is not None})
            d.update({k: 1 for k in GROUP_KEYS + TOP_GROUP_KEYS if d.get(k) is not None})
            # no routed scale: the weight a zeroed router gives is then 1 or 1/2, and dividing by it is exact
            d.update({k: 1.0 for k in SCALE_KEYS if d.get(k) is not None})
            for key in EXPERT_WIDTH_KEYS:
                if d.get(key) is not None:
                    d[key] = width // n
        return type(config)(**d)

    def student_width_multiple(self, config) -> int:
        return self.student_experts(config) if self.student_kind(config) != "dense" else 1

    def student_ffn_state(self, student: nn.Module, layer: int, ffn: DenseFFN) -> dict[str, Tensor]:
        module = self.ffn(self.layers(student)[layer])
        prefix = name_of(student, module) + "."
        if not self.is_moe(module):
            if dense_names(module) is None:
                raise M2DError(f"the student's layer {layer} FFN ({type(module).__name__}) is not a dense MLP")
            return dense_state(module, prefix, ffn)
        return self._one_expert_state(module, prefix, ffn)

    def _one_expert_state(self, block: nn.Module, prefix: str, ffn: DenseFFN) -> dict[str, Tensor]:
        """A one-expert block computing `ffn`: its n experts hold the FFN's hidden units in n equal parts, each
        down projection divided by the weight its zeroed router gives it; the router and the shared expert zero."""
        n = block.experts.gate_up_proj.shape[0] if block.experts.has_gate else block.experts.up_proj.shape[0]
        applied = self._applied_weights(block)
        step = ffn.width // n
        parts = [ffn.part(slice(e * step, (e + 1) * step)) for e in range(n)]
        parts = [
            replace(p, down=p.down / a, down_bias=None if p.down_bias is None else p.down_bias / a)
            for p, a in zip(parts, applied)
        ]
        out = experts_state(block.experts, prefix + "experts.", parts)
        for name, t in _tensors(block):
            if not name.startswith("experts.") and not _is_norm(block, name):
                out[prefix + name] = torch.zeros(t.shape, dtype=t.dtype)
        return out

    def _applied_weights(self, block: nn.Module) -> list[float]:
        """The weight each expert of a one-expert student's block gets from its zeroed router (times the block's
        own scale), read by running a copy of the block on the CPU, in the dtype the family computes in, up to its
        experts call: its experts stay on the meta device (they never run), so the copy costs a router's bytes."""
        key = (type(block).__name__, block.experts.config.to_json_string())
        if key not in self._applied_cache:
            real = copy.deepcopy(block)
            experts, real.experts = real.experts, nn.Identity()
            real = real.to_empty(device="cpu").to(self.exact_dtype)
            real.experts = experts
            with torch.no_grad():
                for _, t in _tensors(real):
                    if not t.is_meta:
                        t.zero_()
            d = block.experts.config.hidden_size
            cap = capture_routing(real, torch.randn(3, d, dtype=self.exact_dtype), torch.zeros(3, dtype=torch.long))
            n = cap.index.shape[1]
            w = torch.zeros(n, dtype=torch.float64).scatter_(0, cap.index[0].long(), cap.weight[0].double())
            if not torch.allclose(cap.weight, cap.weight[:1].expand_as(cap.weight)) or (w == 0).any():
                raise M2DError(f"{type(block).__name__}: a zeroed router does not give every expert a fixed weight")
            self._applied_cache[key] = (w * _block_scale(block)).tolist()
        return self._applied_cache[key]

    def student_ffn(self, mlp: nn.Module) -> Callable[[Tensor], Tensor]:
        """A student block on tokens [T, d]; any token id, where it reads them (its zeroed table routes all to 0)."""
        return lambda x: self.block_output(mlp, x.unsqueeze(0), torch.zeros(x.shape[0], dtype=torch.long)).squeeze(0)


def _block_scale(block: nn.Module) -> float:
    """A factor the block applies to the experts' sum after the experts (beam, laguna, minimax-m3), not in the
    router: the routing weight the token really gets includes it."""
    return float(getattr(block, "routed_scaling_factor", 1.0))


@contextmanager
def _norms_bypassed(block: nn.Module):
    """Every norm module directly inside `block` returns its input while the context is open."""
    norms = [m for n, m in block.named_children() if "norm" in type(m).__name__.lower()]
    handles = [m.register_forward_hook(lambda mod, args, out: args[0]) for m in norms]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [(n, t) for n, t in module.state_dict(keep_vars=True).items()]


def _is_norm(block: nn.Module, name: str) -> bool:
    owner = name.rpartition(".")[0]
    return bool(owner) and "norm" in type(block.get_submodule(owner)).__name__.lower()


BLOCK_STATES = "its layers read the hidden states of every earlier block boundary (block_states)"
HYPER_CONNECTIONS = "its layers carry hyper-connection streams (copies of the hidden state), not one hidden state"

#: the families read from their structure: what each declares beyond it (families.md in the design notes)
FAMILIES: tuple[Family, ...] = (
    Family("afmoe", scores="sigmoid", renormalized=True),
    Family("aria_text", renormalized=True, student="one-expert"),
    Family("axk1", scores="sigmoid", student="one-expert"),  # its block norms routed + shared: the student keeps it
    Family("axk2", scores="sigmoid", student="one-expert"),
    Family("bailing_hybrid", scores="sigmoid", student="one-expert"),
    Family("beam", scores="sigmoid", student="one-expert", float32=True),
    Family("cohere2_moe"),
    Family("deepseek_v32", scores="sigmoid"),
    Family("dots1", scores="sigmoid"),
    Family("dots3_note_text", scores="sigmoid"),
    Family("ernie4_5_moe", renormalized=True),
    Family("exaone_moe", scores="sigmoid"),
    Family(
        "ergo",
        scores="sigmoid",
        renormalized=True,
        note="each expert's output RMSNorm and the shared expert's are dropped: the student's FFN is the experts' "
        "MLPs merged without them",
    ),
    Family("flex_olmo", student="one-expert"),
    Family("flint", scores="sigmoid"),
    Family("glm4_moe", scores="sigmoid"),
    Family("glm4_moe_lite", scores="sigmoid"),
    Family("glm_moe_dsa", scores="sigmoid", unstreamed="its shared indexers reuse the previous layer's top-k choice"),
    Family("granitemoe", renormalized=True, student="one-expert"),
    Family("granitemoe_swa", renormalized=True, student="one-expert"),
    Family("granitemoeshared", renormalized=True, student="one-expert"),
    Family("hunyuan_v1_moe", renormalized=True, student="one-expert"),
    Family("hy_v3", scores="sigmoid", renormalized=True, float32=True),
    Family(
        "hy_v4",
        scores="sigmoid",
        student="one-expert",
        unstreamed=HYPER_CONNECTIONS,
    ),
    Family("jamba", renormalized=False, knob=(("num_experts", 1),)),
    Family("granitemoehybrid", renormalized=True, student="one-expert"),  # its shared MLP on the layer stays
    Family("lfm2_moe", scores="sigmoid"),
    Family("kimi_linear", scores="sigmoid", renormalized="moe_renormalize"),
    Family("kolibri1", scores="sigmoid", student="one-expert"),
    Family(
        "kolibri1_1",
        scores="sigmoid",
        unstreamed="its layers read other layers' keys and values (cross-layer KV sharing)",
    ),
    Family(
        "inkling2_text",
        scores="sigmoid",
        renormalized=True,
        student="one-expert",
        float32=True,
        unstreamed=BLOCK_STATES,
    ),
    Family(
        "inkling2_loop_text",
        scores="sigmoid",
        renormalized=True,
        student="one-expert",
        float32=True,
        unstreamed=BLOCK_STATES,
    ),
    Family("laguna", scores="sigmoid", renormalized=True),
    Family("lara_mini", student="one-expert"),
    Family("mellum"),
    Family("mimo_v2_flash", scores="sigmoid"),
    Family("mistral4"),
    Family("minicpm5_moe", scores="sigmoid"),
    Family("minimax", renormalized=True, student="one-expert"),
    Family("minimax_m2", scores="sigmoid", renormalized=True, student="one-expert"),
    Family("minimax_m3_vl_text", scores="sigmoid", renormalized=True, student="one-expert"),
    Family("qwen3_5_moe_text", renormalized=True, student="one-expert"),
    Family(
        "nemotron_h", scores="sigmoid", unstreamed="its model's forward reads each layer's block type"
    ),  # relu^2 experts without a gate: the student's MLPs have none either
    Family("qwen3_next"),
    Family("qwen3_vl_moe_text", renormalized=True),
    Family(
        "qwen4_exp_text",
        renormalized=True,
        student="one-expert",
        unstreamed=HYPER_CONNECTIONS,
    ),
    Family("solar_open", scores="sigmoid", student="one-expert"),
)
