"""Average-linkage agglomerative clustering to exactly k non-empty clusters (deterministic)."""

from __future__ import annotations

import torch
from torch import Tensor

#: columns converted to float64 at a time: distances of long rows (flattened experts) never need a
#: float64 copy of all of them
_COLS = 1 << 16


def cosine_distance(*parts: Tensor) -> Tensor:
    """1 - cosine similarity between the rows of the column-wise concatenation of `parts` (float64, from
    their Gram matrix summed over column blocks, so the rows are never copied); zero rows are at distance 1."""
    n = parts[0].shape[0]
    G = torch.zeros(n, n, dtype=torch.float64, device=parts[0].device)
    for part in parts:
        for block in part.reshape(n, -1).split(_COLS, dim=1):
            b = block.double()
            G += b @ b.T
    norm = G.diagonal().sqrt()
    both = (norm[:, None] > 0) & (norm[None, :] > 0)
    d = 1.0 - torch.where(both, G / (norm[:, None] * norm[None, :]).clamp(min=1e-300), torch.zeros_like(G))
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
