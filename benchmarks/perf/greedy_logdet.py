"""P4: greedy D-optimal selection, incremental Cholesky (`greedy_logdet`) vs recompute-the-inverse
(`greedy_logdet_naive`, the paper's O(K^3 E) form).

Kernels are built the way the scorings build them: K = kernel(I, G) (m2d_ray.scoring.dopt) with
importance I shaped like ACP (a CP-like probability times an output norm) and a Gram G of expert
outputs that is low-rank plus noise (experts share a few output directions, each adds its own):
F = diag(s) (Z W + eps N), G = F F^T / m, with r = E / 8 shared directions, noise eps = 0.3 and
log-normal per-expert scales s. lambda = ridge(K, budget) as in `_dopt`. Both greedies must return
the same pick order (asserted); times are the best of --repeats measurements, each measurement
averaging enough calls to last >= 50 ms. A third column times a numpy port of the incremental
algorithm (`greedy_logdet_numpy` below, benchmark-only reference, same picks asserted): at these sizes
both torch versions are bound by per-op dispatch, not by FLOPs.

    python -m benchmarks.perf.greedy_logdet [--E 128 512] [--K 8 64] [--repeats 7] [--seeds 3] [--threads 2 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.common import machine_line
from m2d_ray.scoring.dopt import greedy_logdet, greedy_logdet_naive, kernel, ridge


def realistic_kernel(E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = 4 * E  # output "feature" dimension of the Gram factor
    r = max(2, E // 8)
    Z = torch.randn(E, r, generator=g, dtype=torch.float64)
    W = torch.randn(r, m, generator=g, dtype=torch.float64) / r**0.5
    noise = torch.randn(E, m, generator=g, dtype=torch.float64)
    s = torch.exp(0.5 * torch.randn(E, generator=g, dtype=torch.float64))
    F = s[:, None] * (Z @ W + 0.3 * noise)
    G = F @ F.T / m
    cp = torch.distributions.Beta(2.0, 5.0).sample((E,)).double()  # router probability on selected tokens
    importance = cp * torch.diagonal(G).sqrt()  # ACP-like
    return kernel(importance, G)


def greedy_logdet_numpy(K: torch.Tensor, budget: int, lam: float) -> list[int]:
    """Reference only (NOT the package's code): `greedy_logdet`'s exact algorithm on numpy arrays, to show how
    much of its time is torch's per-op dispatch at these sizes (numpy ops cost ~1 us, torch ops ~5-10 us)."""
    K = K.double().numpy()
    E = K.shape[0]
    sigma = K.diagonal().copy() + lam
    rows = np.zeros((budget, E))
    order: list[int] = []
    for step in range(budget):
        s = sigma.copy()
        s[order] = -np.inf
        j = int(s.argmax())
        order.append(j)
        if step + 1 == budget:
            break
        kj = K[j].copy()
        kj[j] += lam
        e = (kj - rows[:step, j] @ rows[:step]) / np.sqrt(max(sigma[j], 1e-300))
        rows[step] = e
        sigma -= e * e
    return order


def timeit(fn, repeats: int, min_s: float = 0.05) -> tuple[float, object]:
    out = fn()  # warm-up
    n, t = 1, 0.0
    while True:  # calibrate the inner loop count
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn()
        t = time.perf_counter() - t0
        if t >= min_s:
            break
        n *= 2
    best = t / n
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best, out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--E", type=int, nargs="+", default=[128, 512])
    p.add_argument("--K", type=int, nargs="+", default=[8, 64])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--seeds", type=int, default=3, help="kernels per (E, K); every pick order is checked, times are of seed 0"
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[2, 1],
        help="torch thread counts to run (each a separate table; default 2 then 1)",
    )
    args = p.parse_args(argv)
    print("# P4 greedy log-det: incremental Cholesky vs naive inverse")
    for threads in args.threads:
        torch.set_num_threads(threads)
        run(args)


def run(args) -> None:
    print()
    print(machine_line())
    rows, ratios = [], []
    for E in args.E:
        kernels = [realistic_kernel(E, seed) for seed in range(args.seeds)]
        for K in args.K:
            for seed, Km in enumerate(kernels):
                lam = ridge(Km, K)
                fast, naive = greedy_logdet(Km, K, lam), greedy_logdet_naive(Km, K, lam)
                assert fast == naive, f"pick orders differ at E={E} K={K} seed={seed}: {fast} vs {naive}"
                assert greedy_logdet_numpy(Km, K, lam) == fast, f"numpy reference differs at E={E} K={K} seed={seed}"
            Km = kernels[0]
            lam = ridge(Km, K)
            t_fast, _ = timeit(lambda: greedy_logdet(Km, K, lam), args.repeats)
            t_naive, _ = timeit(lambda: greedy_logdet_naive(Km, K, lam), args.repeats)
            t_np, _ = timeit(lambda: greedy_logdet_numpy(Km, K, lam), args.repeats)
            ratio = t_naive / t_fast
            ratios.append((E, K, ratio, t_naive / t_np))
            rows.append(
                (
                    E,
                    K,
                    f"{t_fast * 1e3:.3f}",
                    f"{t_naive * 1e3:.3f}",
                    f"{ratio:.1f}x",
                    f"{t_np * 1e3:.3f}",
                    f"{t_naive / t_np:.1f}x",
                    f"same ({args.seeds} kernels)",
                )
            )
    w = [4, 3, 16, 10, 16, 24, 20, 16]
    head = ("E", "K", "incremental ms", "naive ms", "speed-up", "numpy-port ref ms", "naive / numpy-port", "picks")
    print("| " + " | ".join(h.ljust(x) for h, x in zip(head, w)) + " |")
    print("|" + "|".join("-" * (x + 2) for x in w) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(x) for c, x in zip(r, w)) + " |")
    for E, K, r, rnp in ratios:
        print(
            f"RATIO threads={torch.get_num_threads()} E={E} K={K}: greedy_logdet vs naive {r:.1f}x (target >= 10x: "
            f"{'met' if r >= 10 else 'MISSED'}); numpy-port reference vs naive {rnp:.1f}x"
        )
    print(machine_line())


if __name__ == "__main__":
    main()
