"""Per-layer calibration statistics: additive float64 sums, so partial results merge by addition.

For every calibration token t of a MoE layer we record the router softmax p(t) over all E experts,
the top-k set S(t), the weights the model applies, and the raw output f_e(t) of *every* expert; the
outputs only enter through the E x E Gram matrix sum_t <f_i(t), f_j(t)>, computed as one GEMM of the
stacked outputs per token chunk (no Python loop over experts).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from m2d_ray.arch.base import ExpertWeights, MoEAdapter, Routing, expert_outputs

#: fewest tokens per chunk of all-expert outputs
_MIN_CHUNK = 64
#: a chunk's outputs are converted to the Gram's precision in this many column blocks
_GRAM_PARTS = 4


@dataclass
class LayerStats:
    """Sums over N calibration tokens of one MoE layer (all float64)."""

    tokens: Tensor  # [] N
    count: Tensor  # [E] times selected
    psum: Tensor  # [E] sum of router probability over all tokens
    psel: Tensor  # [E] sum of router probability over tokens where selected
    wsel: Tensor  # [E] sum of the applied routing weight over tokens where selected
    gram: Tensor  # [E, E] sum_t <f_i(t), f_j(t)>
    shared_gate: Tensor  # [] sum of the shared-expert gate (0 when the layer has none / ungated)

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device | str = "cpu") -> LayerStats:
        def z(*s):
            return torch.zeros(*s, dtype=torch.float64, device=device)

        E = num_experts
        return cls(tokens=z(()), count=z(E), psum=z(E), psel=z(E), wsel=z(E), gram=z(E, E), shared_gate=z(()))

    @property
    def num_experts(self) -> int:
        return self.count.shape[0]

    @property
    def n(self) -> float:
        return float(self.tokens)

    def add_(self, other: LayerStats) -> LayerStats:
        for f in fields(self):
            getattr(self, f.name).add_(getattr(other, f.name).to(getattr(self, f.name).device))
        return self

    def to_tensors(self, prefix: str) -> dict[str, Tensor]:
        return {f"{prefix}{f.name}": getattr(self, f.name).detach().cpu().contiguous() for f in fields(self)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], prefix: str) -> LayerStats:
        return cls(**{f.name: tensors[f"{prefix}{f.name}"].to(torch.float64) for f in fields(cls)})

    # ---- derived quantities (method.md) ---------------------------------------------
    @property
    def gram_mean(self) -> Tensor:
        """G_ij = (1/N) sum_t <f_i(t), f_j(t)>."""
        return self.gram / max(self.n, 1.0)

    @property
    def sqnorm(self) -> Tensor:
        return torch.diagonal(self.gram_mean).clone()

    @property
    def cp(self) -> Tensor:
        """Conditional probability: mean router probability over the tokens where e was selected."""
        return torch.where(self.count > 0, self.psel / self.count.clamp(min=1), torch.zeros_like(self.psel))

    @property
    def cw(self) -> Tensor:
        """Mean applied routing weight over the tokens where e was selected."""
        return torch.where(self.count > 0, self.wsel / self.count.clamp(min=1), torch.zeros_like(self.wsel))

    @property
    def shared_gate_mean(self) -> float:
        return float(self.shared_gate) / max(self.n, 1.0)


def gram_dtype(device: torch.device) -> torch.dtype:
    """float64 on CPU (cheap next to the expert GEMMs); float32 products on accelerators, summed in float64."""
    return torch.float64 if device.type == "cpu" else torch.float32


def routing_stats(r: Routing, num_experts: int) -> LayerStats:
    """Counts and probability sums of one batch of router decisions (Gram left at zero)."""
    T = r.probs.shape[0]
    st = LayerStats.zeros(num_experts, device=r.probs.device)
    sel = torch.zeros(T, num_experts, dtype=torch.float64, device=r.probs.device).scatter_(1, r.index, 1.0)
    applied = torch.zeros_like(sel).scatter_(1, r.index, r.weight.double())
    p = r.probs.double()
    st.tokens += T
    st.count += sel.sum(0)
    st.psum += p.sum(0)
    st.psel += (p * sel).sum(0)
    st.wsel += applied.sum(0)
    return st


@torch.no_grad()
def layer_stats(
    adapter: MoEAdapter,
    block: torch.nn.Module,
    h: Tensor,
    weights: ExpertWeights | None = None,
    ids: Tensor | None = None,
) -> LayerStats:
    """Statistics of one MoE block on tokens h [T, d] (padding already removed; `ids` [T]: their token ids, which a
    block routing by token id reads)."""
    weights = weights if weights is not None else adapter.experts(block)
    if h.shape[0] == 0:
        return LayerStats.zeros(weights.num_experts, device=h.device)
    st = routing_stats(adapter.route(block, h, ids), weights.num_experts)
    shared = adapter.shared(block)
    if shared is not None and shared.gate is not None:
        st.shared_gate += shared.scale(h.double()).sum()  # float64: a sum of T gates
    st.gram += output_gram(weights, adapter.expert_input(block, h))
    return st


def gram_chunk(weights: ExpertWeights, act: torch.dtype, gdt: torch.dtype, device: torch.device) -> int:
    """Tokens per chunk of all-expert outputs. The chunk's working set (gate/up products 2I, the activation
    and its temporary and contiguous copy 3I, outputs d, a quarter of them in Gram precision) stays within the
    bytes of the experts themselves on an accelerator, and within a quarter of them on the CPU, where the
    weights, the host's hidden states and this working set share one memory and GEMMs are already efficient
    at a few dozen rows (at least `_MIN_CHUNK` tokens either way)."""
    E, I, d = weights.num_experts, weights.width, weights.down.shape[1]

    def size(dt):
        return torch.empty((), dtype=dt).element_size()

    per_token = E * ((5 * I + d) * size(act) + d * size(gdt) // _GRAM_PARTS)
    budget = 3 * E * I * d * weights.gate.element_size() // (4 if device.type == "cpu" else 1)
    return max(_MIN_CHUNK, budget // per_token)


def output_gram(weights: ExpertWeights, h: Tensor) -> Tensor:
    """sum_t <f_i(t), f_j(t)> over tokens h [T, d]: expert outputs in chunks of tokens, the Gram of each chunk
    in `_GRAM_PARTS` GEMMs (no Python loop over experts)."""
    E = weights.num_experts
    gdt = gram_dtype(h.device)
    chunk = gram_chunk(weights, h.dtype, gdt, h.device)
    gram = torch.zeros(E, E, dtype=torch.float64, device=h.device)
    w = weights.to(h.dtype) if weights.gate.dtype != h.dtype else weights
    for start in range(0, h.shape[0], chunk):
        y = expert_outputs(w, h[start : start + chunk]).reshape(E, -1)
        for part in y.tensor_split(_GRAM_PARTS, dim=1):  # a quarter at a time in Gram precision
            part = part.to(gdt)
            gram += (part @ part.T).double()
        del y, part  # not alive beside the next chunk's working set
    return gram
