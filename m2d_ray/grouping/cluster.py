"""Average-linkage agglomerative clustering to exactly k non-empty clusters (deterministic)."""

from __future__ import annotations

import torch
from torch import Tensor


def cosine_distance(x: Tensor) -> Tensor:
    """1 - cosine similarity between the rows of x (float64); zero rows are at distance 1."""
    x = x.double().reshape(x.shape[0], -1)
    n = x.norm(dim=1, keepdim=True)
    u = torch.where(n > 0, x / n.clamp(min=1e-300), torch.zeros_like(x))
    d = 1.0 - u @ u.T
    d.fill_diagonal_(0.0)
    return d.clamp(min=0.0)


def average_linkage(dist: Tensor, k: int) -> list[list[int]]:
    """Merge the closest pair of clusters (mean pairwise distance) until k remain.

    Ties break towards the lowest cluster indices, so results are reproducible. O(n^3) for n <= a
    few hundred experts, which is negligible next to calibration.
    """
    n = dist.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"cannot make {k} clusters of {n} items")
    clusters: list[list[int]] = [[i] for i in range(n)]
    D = dist.double().clone()
    D.fill_diagonal_(torch.inf)
    sizes = torch.ones(n, dtype=torch.float64)
    alive = list(range(n))
    while len(alive) > k:
        sub = D[alive][:, alive]
        flat = int(sub.argmin())
        a, b = alive[flat // len(alive)], alive[flat % len(alive)]
        a, b = min(a, b), max(a, b)
        # Lance-Williams update for average linkage
        D[a] = (sizes[a] * D[a] + sizes[b] * D[b]) / (sizes[a] + sizes[b])
        D[:, a] = D[a]
        D[a, a] = torch.inf
        sizes[a] += sizes[b]
        clusters[a].extend(clusters[b])
        alive.remove(b)
    return [sorted(clusters[i]) for i in alive]
