"""Minitron activation-based importance (Muralidharan et al. 2024, "Compact Language Models via Pruning and
Knowledge Distillation"), from one forward pass of the dense teacher over calibration tokens.

Width, per the paper's definitions (Section 2.2), each a non-negative score per unit:
* FFN neuron j of layer l: |a_j|, a = act(gate(x)) * up(x) the activation fed to down_proj (for SwiGLU
  the "output of the first linear layer" of the paper is this product);
* attention head i of layer l: the L2 norm over head_dim of the head's attention output (the input of
  o_proj); heads are pruned a key/value group at a time, a group scoring the sum of its heads;
* embedding (hidden) channel c: |LN(x)_c| at every norm over the hidden channels (both norms of every
  layer and the final one), summed over those norms.
Aggregation over tokens: the paper's best for width (its Table 11), **mean over the sequence, then L2 over
the batch** (over calibration sequences); padding is excluded and statistics are accumulated in float64.

Depth: the Block Importance of the paper (Section 2.2, from ShortGPT), BI_l = 1 - mean over tokens of
cos(x_l, x_{l+1}), the cosine between a layer's input and output hidden states; the layers with the
lowest BI are dropped. (The paper also ranks by the perplexity without the layer; BI needs no extra
passes.) Importance is computed once, on the whole teacher ("one-shot"; the paper finds iterative
estimation no better), and serves every candidate of the architecture search.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from m2d_ray import console
from m2d_ray.arch.dense import DenseAdapter
from m2d_ray.data.text import TokenSet

CHOICES = {
    "ffn": "mean over the sequence, L2 over the batch, of |act(gate) * up| (the down_proj input)",
    "heads": "mean over the sequence, L2 over the batch, of each head's attention-output L2 norm (the o_proj input); "
    "a key/value group scores the sum of its heads",
    "hidden": "sum over every hidden-size norm (both per layer, and the final one) of mean over the sequence, L2 over "
    "the batch, of |norm output|",
    "layers": "block importance 1 - mean over tokens of cos(layer input, layer output)",
}


@dataclass(frozen=True)
class Importance:
    """Per-unit importance of a dense teacher (float64, CPU); small, so it travels with a candidate."""

    hidden: Tensor  # [d]
    ffn: Tensor  # [L, I]
    heads: Tensor  # [L, H]
    layers: Tensor  # [L]
    n_tokens: int

    def groups(self, group_size: int) -> Tensor:
        """[L, kv_heads]: each key/value group's importance, the sum over its heads (head h is in group h // g)."""
        L, H = self.heads.shape
        return self.heads.view(L, H // group_size, group_size).sum(-1)

    def tensors(self) -> dict[str, Tensor]:
        return {"hidden": self.hidden, "ffn": self.ffn, "heads": self.heads, "layers": self.layers}

    def save(self, path: str | Path) -> None:

        save_file(
            {k: v.contiguous() for k, v in self.tensors().items()}, str(path), metadata={"n_tokens": str(self.n_tokens)}
        )

    @classmethod
    def load(cls, path: str | Path) -> Importance:

        with safe_open(str(path), framework="pt") as f:
            return cls(
                **{k: f.get_tensor(k) for k in ("hidden", "ffn", "heads", "layers")},
                n_tokens=int(f.metadata()["n_tokens"]),
            )


def seq_mean_sq(x: Tensor, mask: Tensor) -> Tensor:
    """Sum over the batch of (mean over the valid positions of x)^2, [..N], float64: the running square of
    Minitron's (sequence = mean, batch = L2) aggregate. x [B, S, N] non-negative, mask [B, S] (1 = token)."""
    m = mask.to(x.dtype)[..., None]
    n = mask.sum(1).to(torch.float64)
    keep = n > 0
    mean = (x * m).sum(1, dtype=torch.float64)[keep] / n[keep, None]
    return (mean**2).sum(0)


class _Recorder:
    """Forward hooks that accumulate every statistic of one batch; `mask` is set before each forward."""

    def __init__(self, model, adapter: DenseAdapter) -> None:
        cfg = model.config
        L, self.head_dim = len(adapter.layers(model)), adapter.head_dim(cfg)

        def z(*s):
            return torch.zeros(*s, dtype=torch.float64)

        self.ffn, self.heads, self.hidden = (
            z(L, cfg.intermediate_size),
            z(L, cfg.num_attention_heads),
            z(cfg.hidden_size),
        )
        self.norms = adapter.hidden_norms(model)
        self.norm_sq = [z(cfg.hidden_size) for _ in self.norms]
        self.cos_sum, self.cos_n = z(L), 0
        self.mask: Tensor | None = None
        self.handles = []
        for i, layer in enumerate(adapter.layers(model)):
            self.handles += [
                adapter.neuron_input(layer).register_forward_pre_hook(self._ffn(i)),
                adapter.heads_input(layer).register_forward_pre_hook(self._heads(i)),
                layer.register_forward_hook(self._block(i), with_kwargs=True),
            ]
        self.handles += [n.register_forward_hook(self._norm(j)) for j, n in enumerate(self.norms)]

    def _ffn(self, i: int):
        def hook(_mod, args):
            self.ffn[i] += seq_mean_sq(args[0].detach().abs(), self.mask).cpu()

        return hook

    def _heads(self, i: int):
        def hook(_mod, args):
            a = args[0].detach()
            per_head = torch.linalg.vector_norm(a.unflatten(-1, (-1, self.head_dim)).float(), dim=-1)
            self.heads[i] += seq_mean_sq(per_head, self.mask).cpu()

        return hook

    def _norm(self, j: int):
        def hook(_mod, _args, out):
            self.norm_sq[j] += seq_mean_sq(out.detach().abs(), self.mask).cpu()

        return hook

    def _block(self, i: int):
        def hook(_mod, args, kwargs, out):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = out[0] if isinstance(out, tuple) else out
            cos = F.cosine_similarity(h_in.detach().double(), h_out.detach().double(), dim=-1)
            self.cos_sum[i] += float(cos[self.mask.bool()].sum())

        return hook

    def close(self, n_tokens: int) -> Importance:
        for h in self.handles:
            h.remove()
        hidden = sum(sq.sqrt() for sq in self.norm_sq)
        return Importance(
            hidden=hidden,
            ffn=self.ffn.sqrt(),
            heads=self.heads.sqrt(),
            layers=1.0 - self.cos_sum / max(n_tokens, 1),
            n_tokens=n_tokens,
        )


@torch.no_grad()
def collect_importance(
    model, adapter: DenseAdapter, tokens: TokenSet, batch_size: int = 8, progress: bool = False
) -> Importance:
    """Importance of every FFN neuron, head, hidden channel and layer of `model` on the calibration tokens."""
    device = next(model.parameters()).device
    rec = _Recorder(model, adapter)
    starts = range(0, tokens.ids.shape[0], batch_size)
    try:
        for s in console.progress(starts, len(starts), "importance", "batch") if progress else starts:
            ids, mask = tokens.ids[s : s + batch_size].to(device), tokens.mask[s : s + batch_size].to(device)
            rec.mask = mask
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        imp = rec.close(tokens.n_tokens)
    return imp
