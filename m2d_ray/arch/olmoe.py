"""OLMoE: softmax router (top-k renormalised iff `norm_topk_prob`, default False), fused SwiGLU experts of
width `intermediate_size` (`experts.gate_up_proj` [E, 2I, d], gate first; `experts.down_proj` [E, d, I]).

transformers has no dense OLMo variant with OLMoE's attention (q/k RMSNorm over the full projection,
optional `clip_qkv`), so the student is a one-expert OLMoE: `num_experts = num_experts_per_tok = 1`,
`intermediate_size = W`, router weight zeros. Softmax over one logit is exactly 1 (and renormalising
a single weight divides by 1), so the block computes the dense FFN exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import OlmoeConfig

from m2d_ray.arch import register
from m2d_ray.arch.base import DenseFFN, MoEAdapter, copy_config


@register
class OlmoeAdapter(MoEAdapter):
    model_types = ("olmoe",)
    student_model_type = "olmoe"

    def num_experts(self, config) -> int:
        return int(config.num_experts)

    def renormalizes(self, config) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))

    def student_config(self, config, width: int):
        return copy_config(
            OlmoeConfig,
            config,
            num_experts=1,
            num_experts_per_tok=1,
            intermediate_size=width,
            architectures=["OlmoeForCausalLM"],
        )

    def student_ffn_state(self, student: nn.Module, layer: int, ffn: DenseFFN) -> dict[str, Tensor]:
        prefix = self.ffn_prefix(layer)
        return {
            prefix + "experts.gate_up_proj": torch.cat([ffn.gate, ffn.up], dim=0).unsqueeze(0).contiguous(),
            prefix + "experts.down_proj": ffn.down.unsqueeze(0).contiguous(),
            prefix + "gate.weight": torch.zeros(1, ffn.gate.shape[1], dtype=ffn.gate.dtype),
        }

    def student_ffn(self, mlp: nn.Module) -> Callable[[Tensor], Tensor]:
        return lambda x: mlp(x.unsqueeze(0)).squeeze(0)  # the block wants [B, S, d]
