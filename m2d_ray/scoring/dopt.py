"""D-optimal expert selection: greedy maximisation of log det(K_S + lambda I).

K_ij = sqrt(I_i I_j) G_ij couples base importance I with output similarity (the Gram G), and
lambda = trace(K) / (K_budget * E). The greedy gain of adding e is log(sigma_e) with
sigma_e = K_ee + lambda - K_eS (K_S + lambda I)^-1 K_Se, the Schur complement.

`greedy_logdet` keeps a Cholesky factor of K_S + lambda I implicitly: each step appends one row
c_j of L^-1 K_{S,:} and updates every sigma_e by one subtraction, O(E) per step and O(K^2 E)
overall (the fast greedy MAP of Chen et al. 2018). `greedy_logdet_naive` is the paper's
recompute-the-inverse version, O(K^3 E), kept as the oracle for tests and the P4 benchmark.
"""

from __future__ import annotations

import torch
from torch import Tensor


def kernel(importance: Tensor, gram: Tensor) -> Tensor:
    """K_ij = sqrt(I_i I_j) G_ij (float64)."""
    r = importance.double().clamp(min=0).sqrt()
    return r[:, None] * gram.double() * r[None, :]


def ridge(K: Tensor, budget: int) -> float:
    """lambda = trace(K) / (budget * E), floored so the log-det stays finite for a zero kernel."""
    lam = float(torch.diagonal(K).sum()) / (budget * K.shape[0])
    return lam if lam > 0 else 1e-12


def greedy_logdet(K: Tensor, budget: int, lam: float) -> list[int]:
    """Greedy argmax of log det(K_S + lam I), |S| = budget, incremental Cholesky; returns pick order."""
    K = K.double()
    E = K.shape[0]
    sigma = torch.diagonal(K).clone() + lam
    rows = torch.zeros(budget, E, dtype=torch.float64, device=K.device)  # rows of L^-1 K_{S,:}
    chosen = torch.zeros(E, dtype=torch.bool, device=K.device)
    order: list[int] = []
    for step in range(budget):
        j = int(torch.where(chosen, torch.full_like(sigma, -torch.inf), sigma).argmax())
        order.append(j)
        chosen[j] = True
        if step + 1 == budget:
            break
        # new row of L^-1 [K_S + lam I | K_{S,:}]: (K_j,: - c_{:,j}^T C) / sqrt(sigma_j), lam on the diagonal
        kj = K[j].clone()
        kj[j] += lam
        e = (kj - rows[:step, j] @ rows[:step]) / sigma[j].clamp(min=1e-300).sqrt()
        rows[step] = e
        sigma = sigma - e * e
    return order


def greedy_logdet_naive(K: Tensor, budget: int, lam: float) -> list[int]:
    """Same greedy, recomputing (K_S + lam I)^-1 every step (the paper's O(K^3 E) form)."""
    K = K.double()
    order: list[int] = []
    for _ in range(budget):
        if order:
            S = torch.tensor(order)
            inv = torch.linalg.inv(K[S][:, S] + lam * torch.eye(len(order), dtype=torch.float64))
            KSe = K[S]  # [|S|, E]
            sigma = torch.diagonal(K) + lam - (KSe * (inv @ KSe)).sum(0)
        else:
            sigma = torch.diagonal(K) + lam
        sigma[order] = -torch.inf
        order.append(int(sigma.argmax()))
    return order


def logdet_gain(K: Tensor, S: list[int], lam: float) -> float:
    """F~(S) = log det(I + K_S / lam), the normalised objective (monotone submodular, F~(empty) = 0)."""
    if not S:
        return 0.0
    idx = torch.tensor(S)
    sub = K.double()[idx][:, idx] / lam
    return float(torch.linalg.slogdet(torch.eye(len(S), dtype=torch.float64) + sub)[1])
