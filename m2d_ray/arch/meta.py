"""A model's parameter counts (`param_counts`): by arithmetic where arch/counts.py knows its family (no modelling code
built, no torch imported), else read off its meta-device model through its arch adapter for an MoE (`meta_counts`),
which is also the reference `tests/unit/test_counts.py` holds the arithmetic to."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from m2d_ray.arch import auto_class, family_of, get_adapter
from m2d_ray.arch.counts import Counts, counts

if TYPE_CHECKING:
    from torch import nn

# Imported inside functions: torch and arch/base (a family counts.py knows is counted without them: `m2d plan`).

#: meta-device models by config (a plan asks for the same few configs many times over)
_META: dict[str, nn.Module] = {}


def meta_model(config) -> nn.Module:
    """The model of `config` on the meta device in bfloat16 (no weights), built once per distinct config. Read only:
    it is shared."""
    import torch

    key = f"{type(config).__name__}:{config.to_json_string(use_diff=False)}"
    if key not in _META:
        with torch.device("meta"):
            _META[key] = auto_class(config).from_config(copy.deepcopy(config), dtype=torch.bfloat16)
    return _META[key]


def meta_counts(config) -> Counts:
    from m2d_ray.arch.base import dense_from_mlp

    model = meta_model(config)
    adapter = get_adapter(config) if family_of(config) is not None else None
    layers = adapter.layers(model) if adapter is not None else model.get_decoder().layers
    blocks = adapter.moe_blocks(model) if adapter is not None else {}
    block = next(iter(blocks.values()), None)
    shared = adapter.shared(block) if block is not None else None
    ffns = {i: adapter.ffn(x) if adapter is not None else getattr(x, "mlp", None) for i, x in enumerate(layers)}
    dense = [
        (adapter.dense_ffn(f) if adapter is not None else dense_from_mlp(f)).width
        for i, f in ffns.items()
        if i not in blocks and f is not None and (adapter is not None or hasattr(f, "gate_proj"))
    ]
    return Counts(
        sum(p.numel() for p in model.parameters()),
        tuple(sum(p.numel() for p in layer.parameters()) for layer in layers),
        sum(p.numel() for p in model.parameters() if p.ndim < 2),
        tuple(blocks),
        model.get_input_embeddings().weight is model.get_output_embeddings().weight,
        adapter.experts(block).width if block is not None else 0,
        shared.weights.width if shared else 0,
        max(dense, default=0),
    )


def param_counts(config) -> Counts:
    """A model's parameter counts: by arithmetic where arch/counts.py knows its family, else on the meta device."""
    return counts(config) or meta_counts(config)
