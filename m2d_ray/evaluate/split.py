"""A model whose weights one GPU cannot hold, spread over several as a pipeline of its layers: the input embeddings
on the first, the decoder layers in order, the final norm and the head on the last. Pure arithmetic on module
sizes (no torch): the plan counts a spread trial's GPU with it and the trial places its student with the same split
(evaluate/spread.py), so the plan's bytes and the run's placement are one decision.

The split keeps the modules' order (a hidden state crosses each GPU boundary once, forward) and makes the largest
GPU's load as small as any split in order can (a binary search on that load, each step a greedy fill).
"""

from __future__ import annotations

from m2d_ray.errors import M2DError


def in_order(sizes: list[int], devices: int) -> list[int]:
    """The device (0 .. devices - 1) of each module of `sizes` (bytes, in the model's order): indices never decrease,
    and the largest device's sum is the least any split in order reaches."""
    if devices < 1:
        raise M2DError(f"a model is spread over at least 1 device, not {devices}")
    if not sizes:
        return []
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # the least load under which a greedy fill uses no more than `devices`
        mid = (lo + hi) // 2
        if _greedy(sizes, mid)[-1] < devices:
            hi = mid
        else:
            lo = mid + 1
    return _greedy(sizes, lo)


def _greedy(sizes: list[int], load: int) -> list[int]:
    """Each module on the current device while its sum stays within `load`, else on the next."""
    out, device, held = [], 0, 0
    for s in sizes:
        if held and held + s > load:
            device, held = device + 1, 0
        out.append(device)
        held += s
    return out


def loads(sizes: list[int], placement: list[int]) -> list[int]:
    """Bytes each device holds under `placement` (every device up to the last used)."""
    out = [0] * (max(placement) + 1 if placement else 0)
    for s, d in zip(sizes, placement):
        out[d] += s
    return out


def largest(sizes: list[int], devices: int) -> int:
    """The most bytes one device holds when `sizes` are spread over `devices` in order."""
    return max(loads(sizes, in_order(sizes, devices)), default=0)


def decoder_sizes(params: int, layers: int, layer_params: int, vocab: int, hidden: int, tied: bool, b: int) -> list:
    """A decoder's modules in order, in bytes at `b` a parameter: the input embeddings, each layer (all at the
    largest's size: an upper bound for a model whose first layers are smaller), and the final norm with the head
    (the head shares the embeddings' weights when `tied`: it costs nothing more on its own)."""
    embed = vocab * hidden
    tail = max(0, params - layers * layer_params - embed)  # the norm, and the head unless tied
    return [embed * b, *([layer_params * b] * layers), tail * b]


def spread_over(gpus: float) -> int:
    """The GPUs a unit's model is spread over: its whole GPUs when more than one (a share of one GPU, or one, holds
    the model whole)."""
    return int(gpus) if gpus > 1 else 1
