"""A model spread over several devices as a pipeline of its layers (evaluate/split.py's split): a stage-1 trial whose
student no GPU of the cluster holds whole runs on N whole GPUs of one node, the input embeddings on the first, the
decoder layers in order, the final norm and the head on the last. Each placed module moves what it is called with to
its own device first (a forward pre-hook), so the model's own forward runs unchanged across them and the logits are
those of the model on one device.

Generic over decoders: the layers are the base model's one ModuleList, the embeddings and the head are found by
transformers' own accessors; modules without weights (a rotary embedding) stay on the first device.
"""

from __future__ import annotations

import torch
from torch import nn

from m2d_ray.errors import M2DError
from m2d_ray.evaluate.split import in_order


def modules_in_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that hold a decoder's weights, in the order a token goes through them: the input embeddings, each
    decoder layer, the base model's other weighted modules (the final norm), the head unless it is the embeddings."""
    base = model.base_model
    stacks = [(n, m) for n, m in base.named_children() if isinstance(m, nn.ModuleList)]
    if len(stacks) != 1:
        raise M2DError(f"{type(model).__name__}: no single stack of decoder layers to spread over devices")
    name, layers = stacks[0]
    embed = model.get_input_embeddings()
    rest = [
        (n, m)
        for n, m in base.named_children()
        if m is not embed and m is not layers and any(True for _ in m.parameters())
    ]
    out = [("embed", embed), *((f"{name}.{i}", layer) for i, layer in enumerate(layers)), *rest]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not embed.weight:
        out.append(("head", head))
    return out


def module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def spread(model: nn.Module, devices: list[str]) -> dict[str, str]:
    """Place `model`'s modules over `devices` in order (evaluate/split.in_order: the largest device's bytes the least a
    split in order gives) and hook each to move its inputs to its device; {module: device}. The model's forward is
    then the same computation, handed from device to device."""
    mods = modules_in_order(model)
    where = in_order([module_bytes(m) for _, m in mods], len(devices))
    placed = {}
    first = torch.device(devices[0])
    model.to(first)  # weightless modules (a rotary embedding) and buffers on the first device
    for (name, module), d in zip(mods, where):
        device = torch.device(devices[d])
        module.to(device)
        module.register_forward_pre_hook(_mover(device), with_kwargs=True)
        placed[name] = devices[d]
    return placed


def _mover(device: torch.device):
    def hook(module, args, kwargs):
        return _to(args, device), _to(kwargs, device)

    return hook


def _to(x, device: torch.device):
    """Every tensor in `x` (nested tuples, lists, dicts) on `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x
