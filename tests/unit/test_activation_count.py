"""The plan's activation count (plan/memory.py) is what a real decoder layer keeps: counted by a saved-tensors hook
on a Qwen3 layer on the CPU (each storage once, the weights not), at two shapes, in float32 and bfloat16, under each
checkpointing; under `selective` SAC's own storage (the outputs its policy keeps) is counted beside the hook's."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy
from transformers import Qwen3Config, Qwen3ForCausalLM

from m2d_ray.distill import checkpointing
from m2d_ray.plan import memory
from m2d_ray.plan.shapes import shape_of

B, T = 2, 32
#: (hidden, heads, key/value heads, head_dim, ffn): two shapes that differ in every width
SHAPES = [(64, 4, 2, 16, 128), (96, 6, 3, 32, 160)]


def _config(shape: tuple, layers: int) -> Qwen3Config:
    h, heads, kv, hd, f = shape
    return Qwen3Config(
        vocab_size=64,
        hidden_size=h,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
    )


def _kept(shape: tuple, layers: int, dtype: torch.dtype, policy: str, monkeypatch) -> int:
    """Bytes the model's forward leaves for its backward: every storage a saved-tensors hook is handed (not the
    weights), and the outputs SAC's policy keeps."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_config(shape, layers)).to(dtype).train()
    model.set_attn_implementation("sdpa")
    weights = {w.untyped_storage()._cdata for w in model.parameters()}
    seen: dict = {}

    def pack(t):
        if t.untyped_storage()._cdata not in weights:
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    policy_fn = checkpointing.sac_policy

    def recorded(ctx, op, *args, **kwargs):
        decision = policy_fn(ctx, op, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE:
            outs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]
            for t in outs:
                if isinstance(t, torch.Tensor):
                    seen[("sac", t.untyped_storage()._cdata)] = t.untyped_storage().nbytes()
        return decision

    monkeypatch.setattr(checkpointing, "sac_policy", recorded)
    checkpointing.apply(model, policy)
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_the_plan_counts_what_a_real_layer_keeps(policy, dtype, monkeypatch):
    """One layer's bytes (a 2-layer model's less a 1-layer model's) per token equal the plan's, at both shapes."""
    torch.set_num_threads(1)
    b = torch.empty((), dtype=dtype).element_size()
    for shape in SHAPES:
        per_token = (_kept(shape, 2, dtype, policy, monkeypatch) - _kept(shape, 1, dtype, policy, monkeypatch)) / (
            B * T
        )
        s = shape_of(_config(shape, 2))
        planned = {
            "none": memory.layer_activation(s, b),
            "selective": memory.selective_activation(s, b),
            "full": b * s.hidden,
        }[policy]
        assert per_token == planned, (shape, per_token, planned)


def test_selective_keeps_no_bmm_nor_the_down_projection_and_sees_flash_attn_once_imported(monkeypatch):
    """SAC's saved set is the ops whose outputs the backward needs: no aten.bmm (no Linear's backward reads a
    product), not the FFN's down projection (only the residual add reads it); and it is looked up again once
    flash-attn is imported (its ops exist only then), not cached from before."""
    import sys

    ops = {str(op) for op in checkpointing.saved_ops()}
    assert "aten.bmm.default" not in ops and "aten.mm.default" in ops
    model = Qwen3ForCausalLM(_config(SHAPES[0], 1))
    down = checkpointing.down_projection(model)
    w = model.model.layers[0].mlp.down_proj.weight
    assert down == tuple(w.T.shape)
    mm = torch.ops.aten.mm.default
    x = torch.empty(4, SHAPES[0][4])
    assert checkpointing.sac_policy(None, mm, x, w.T, down=down) == CheckpointPolicy.PREFER_RECOMPUTE
    o = model.model.layers[0].self_attn.o_proj.weight
    x = torch.empty(4, o.shape[1])
    assert checkpointing.sac_policy(None, mm, x, o.T, down=down) == CheckpointPolicy.MUST_SAVE
    monkeypatch.setitem(sys.modules, "flash_attn", object())  # as if imported after a first lookup
    checkpointing.saved_ops()
    assert checkpointing._saved_ops.cache_info().currsize == 2  # looked up again under the new state
