"""One calibration pass over a teacher: forward pre-hooks on every MoE block feed `layer_stats`.

The teacher runs its normal forward, so every layer sees the hidden states the real model produces;
the hooks only observe. Padding positions (attention_mask == 0) are removed before any statistic.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from m2d_ray import console
from m2d_ray.arch.base import MoEAdapter
from m2d_ray.calibrate.stats import LayerStats, layer_stats


def token_batches(ids: Tensor, mask: Tensor, batch_size: int) -> Iterable[tuple[Tensor, Tensor]]:
    for start in range(0, ids.shape[0], batch_size):
        yield ids[start : start + batch_size], mask[start : start + batch_size]


def observe(adapter: MoEAdapter, block: nn.Module, stats: LayerStats, current: dict[str, Tensor]) -> RemovableHandle:
    """Forward pre-hook on a MoE block adding its statistics on the current batch's non-padding tokens
    (`current["mask"]`, set by the caller before each forward) to `stats`."""
    weights = adapter.experts(block)

    def fn(module: nn.Module, args: tuple, kwargs: dict) -> None:
        h = args[0] if args else kwargs["hidden_states"]
        keep = current["mask"].reshape(-1).bool()
        ids = kwargs.get("input_ids")  # a block routing by token id is handed them (DeepSeek-V4's hash layers)
        ids = None if ids is None else ids.reshape(-1)[keep]
        stats.add_(layer_stats(adapter, block, h.reshape(-1, h.shape[-1])[keep], weights, ids))

    return adapter.input_module(block).register_forward_pre_hook(fn, with_kwargs=True)


@torch.no_grad()
def collect_stats(
    model: nn.Module,
    adapter: MoEAdapter,
    ids: Tensor,
    mask: Tensor,
    batch_size: int = 8,
    progress: bool = True,
) -> dict[int, LayerStats]:
    """Statistics of every MoE layer over sequences ids/mask [n, L] (one forward per batch)."""
    blocks = adapter.moe_blocks(model)
    device = next(model.parameters()).device
    stats = {i: LayerStats.zeros(adapter.num_experts(model.config), device=device) for i in blocks}
    current: dict[str, Tensor] = {}
    handles = [observe(adapter, b, stats[i], current) for i, b in blocks.items()]
    try:
        n_batches = -(-ids.shape[0] // batch_size)
        batches = token_batches(ids, mask, batch_size)
        for b_ids, b_mask in console.progress(batches, n_batches, "calibrate", "batch") if progress else batches:
            current["mask"] = b_mask.to(device)
            model(input_ids=b_ids.to(device), attention_mask=b_mask.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return stats
