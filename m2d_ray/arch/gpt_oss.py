"""GPT-OSS: router `mlp.router` (Linear with bias) whose applied weights are a softmax over the top-k
logits (so they sum to 1); experts with biases and a clamped SwiGLU.

Layout (transformers 5), transposed and interleaved unlike the other families:
`experts.gate_up_proj` [E, d, 2I] with gate = [..., ::2], up = [..., 1::2]; `experts.gate_up_proj_bias`
[E, 2I] interleaved the same way; `experts.down_proj` [E, I, d]; `experts.down_proj_bias` [E, d].
Checkpoints store these fused tensors as they are (no per-expert keys).
Activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = clamp(gate, max=limit), with
alpha = `swiglu_alpha`, limit = `swiglu_limit`. The block returns (hidden, router_scores).

`Routing.probs` = softmax over all E router logits (bias included).

Student: a one-expert GPT-OSS (`num_local_experts = num_experts_per_tok = 1`, `intermediate_size = W`),
router weight and bias zero: softmax over the single top-1 logit is exactly 1. Attention (with
`sinks`), sliding-window `layer_types` and rope are copied unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import GptOssConfig

from m2d_ray.arch import register
from m2d_ray.arch.base import (
    DenseFFN,
    ExpertWeights,
    MoEAdapter,
    clamped_swiglu,
    copy_config,
)


@register
class GptOssAdapter(MoEAdapter):
    model_types = ("gpt_oss",)
    student_model_type = "gpt_oss"
    per_expert_keys = {}  # fused in checkpoints too

    def num_experts(self, config) -> int:
        return int(config.num_local_experts)

    def renormalizes(self, config) -> bool:
        return True

    def router(self, block: nn.Module) -> nn.Module:
        return block.router

    def activation(self, block: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
        return clamped_swiglu(float(block.experts.alpha), float(block.experts.limit))

    def experts(self, block: nn.Module) -> ExpertWeights:
        ex = block.experts
        gate_up = ex.gate_up_proj.detach()  # [E, d, 2I]
        bias = ex.gate_up_proj_bias.detach()  # [E, 2I]
        return ExpertWeights(
            gate=gate_up[..., ::2].transpose(1, 2),
            up=gate_up[..., 1::2].transpose(1, 2),
            down=ex.down_proj.detach().transpose(1, 2),
            act=self.activation(block),
            gate_bias=bias[:, ::2],
            up_bias=bias[:, 1::2],
            down_bias=ex.down_proj_bias.detach(),
        )

    def student_config(self, config, width: int):
        return copy_config(
            GptOssConfig,
            config,
            num_local_experts=1,
            num_experts_per_tok=1,
            intermediate_size=width,
            architectures=["GptOssForCausalLM"],
        )

    def student_ffn_state(self, student: nn.Module, layer: int, ffn: DenseFFN) -> dict[str, Tensor]:
        prefix = self.ffn_prefix(layer)
        W, d = ffn.gate.shape

        def zeros(*shape):
            return torch.zeros(*shape, dtype=ffn.gate.dtype)

        gate_bias = ffn.gate_bias if ffn.gate_bias is not None else zeros(W)
        up_bias = ffn.up_bias if ffn.up_bias is not None else zeros(W)
        down_bias = ffn.down_bias if ffn.down_bias is not None else zeros(d)
        gate_up = torch.stack([ffn.gate, ffn.up], dim=1).reshape(2 * W, d)  # rows g0, u0, g1, u1, ...
        return {
            prefix + "experts.gate_up_proj": gate_up.T.unsqueeze(0).contiguous(),  # [1, d, 2W]
            prefix + "experts.gate_up_proj_bias": torch.stack([gate_bias, up_bias], dim=1).reshape(1, 2 * W),
            prefix + "experts.down_proj": ffn.down.T.unsqueeze(0).contiguous(),  # [1, W, d]
            prefix + "experts.down_proj_bias": down_bias.reshape(1, d).contiguous(),
            prefix + "router.weight": zeros(1, d),
            prefix + "router.bias": zeros(1),
        }

    def student_ffn(self, mlp: nn.Module) -> Callable[[Tensor], Tensor]:
        return lambda x: mlp(x.unsqueeze(0))[0].squeeze(0)  # the block wants [B, S, d], returns a tuple
