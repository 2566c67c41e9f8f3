"""Scorings against hand computations and brute force: the routing scores on a hand-built table, greedy
log-det against exhaustive search, Theorem 1's redundancy counterexample, effective rank."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from m2d_ray.arch.base import Routing
from m2d_ray.calibrate.stats import LayerStats, routing_stats
from m2d_ray.catalog.methods import SCORINGS
from m2d_ray.errors import M2DError
from m2d_ray.scoring.base import effective_rank
from m2d_ray.scoring.dopt import greedy_logdet, greedy_logdet_naive, kernel, logdet_gain, ridge
from m2d_ray.scoring.methods import select


# ---- scores on a hand-built routing table --------------------------------------------
def hand_table() -> LayerStats:
    """4 tokens, 3 experts, top-1. Router probabilities (rows) and selections:
    t0: [.6 .3 .1] -> e0   t1: [.5 .4 .1] -> e0   t2: [.2 .7 .1] -> e1   t3: [.3 .3 .4] -> e2
    Outputs: e0 = 1 on every token, e1 = 2, e2 = 3 (scalar, d = 1) -> G = outer([1,2,3]) * 4."""
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.7, 0.1], [0.3, 0.3, 0.4]])
    index = torch.tensor([[0], [0], [1], [2]])
    st = routing_stats(Routing(probs=probs, index=index, weight=torch.ones(4, 1)), 3)
    y = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)[:, None, None].expand(3, 4, 1).reshape(3, -1)
    st.gram += y @ y.T
    return st


def test_scores_on_hand_built_table():
    st = hand_table()
    sf = SCORINGS["sf"](st, 3).scores
    pp = SCORINGS["pp"](st, 3).scores
    ps = SCORINGS["ps"](st, 3).scores
    cp = SCORINGS["cp"](st, 3).scores
    acp = SCORINGS["acp"](st, 3).scores
    # by hand: counts 2,1,1 of 4; psum (1.6, 1.7, 0.7); psel (1.1, 0.7, 0.4)
    assert sf.tolist() == pytest.approx([0.5, 0.25, 0.25])
    assert pp.tolist() == pytest.approx([0.4, 0.425, 0.175])
    assert ps.tolist() == pytest.approx([0.275, 0.175, 0.1])
    assert cp.tolist() == pytest.approx([0.55, 0.7, 0.4])
    # ACP = CP * sqrt(E * ||f||^2), ||f||^2 = 1, 4, 9
    assert acp.tolist() == pytest.approx([0.55 * math.sqrt(3), 0.7 * math.sqrt(12), 0.4 * math.sqrt(27)])
    assert torch.allclose(ps, sf * cp)
    assert select("sf", st, 1).experts == [0]
    assert select("pp", st, 1).experts == [1]
    assert select("acp", st, 2).experts == [1, 2]  # 0.7*sqrt(12)=2.42 > 0.4*sqrt(27)=2.08 > 0.95


def test_cp_is_zero_for_never_selected_expert():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2]])
    st = routing_stats(Routing(probs=probs, index=torch.tensor([[0], [0]]), weight=torch.ones(2, 1)), 2)
    assert st.cp.tolist() == [pytest.approx(0.85), 0.0]


# ---- greedy log-det ------------------------------------------------------------------
def random_kernel(E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(E, max(2, E // 2), generator=g, dtype=torch.float64)  # low rank: greedy is non-trivial
    return kernel(torch.rand(E, generator=g, dtype=torch.float64), A @ A.T)


@pytest.mark.parametrize("E,K,seed", [(E, K, s) for E in (5, 8, 10) for K in (2, 3, 4) for s in range(3)])
def test_greedy_logdet_vs_brute_force(E, K, seed):
    Km = random_kernel(E, seed)
    lam = ridge(Km, K)
    fast, naive = greedy_logdet(Km, K, lam), greedy_logdet_naive(Km, K, lam)
    assert fast == naive
    best = max(logdet_gain(Km, list(S), lam) for S in itertools.combinations(range(E), K))
    assert logdet_gain(Km, fast, lam) >= (1 - 1 / math.e) * best - 1e-12


def test_greedy_first_pick_is_largest_diagonal():
    Km = random_kernel(12, 7)
    assert greedy_logdet(Km, 3, ridge(Km, 3))[0] == int(torch.diagonal(Km).argmax())


def test_theorem1_redundancy_counterexample():
    """K identical experts + K-1 orthogonal specialists, scalar outputs, deterministic top-1 router.

    ACP ranks the (louder) duplicates first and keeps all K of them; log-det keeps one duplicate and
    every specialist, because a second copy of a direction adds almost no volume.
    """
    K = 4
    E = 2 * K - 1
    dup, spec = list(range(K)), list(range(K, E))
    n_tok = 2 * E  # two tokens routed to each expert, each with probability 1
    probs = torch.zeros(n_tok, E)
    index = torch.arange(E).repeat_interleave(2)[:, None]
    probs[torch.arange(n_tok), index[:, 0]] = 1.0
    st = routing_stats(Routing(probs=probs, index=index, weight=torch.ones(n_tok, 1)), E)
    # scalar outputs: the duplicates are one function (1 on every duplicate-routed token); specialist s
    # outputs sqrt(2) on its own two tokens only, so it is orthogonal to everything else. ACP prefers
    # the duplicates (larger output norm at equal CP).
    y = torch.zeros(E, n_tok, dtype=torch.float64)
    y[dup, : 2 * K] = 1.0
    for s in spec:
        y[s, 2 * s : 2 * s + 2] = math.sqrt(2.0)
    st.gram += y @ y.T
    acp = select("acp", st, K)
    assert sorted(acp.experts) == dup
    assert min(acp.scores[dup]) > max(acp.scores[spec])
    do = select("do-acp", st, K).experts
    assert len(set(do) & set(dup)) == 1 and set(spec) <= set(do)
    assert do[0] in dup  # the loudest direction first, then the specialists


def test_effective_rank_bounds():
    assert effective_rank(torch.ones(5)) == pytest.approx(5.0)
    assert effective_rank(torch.tensor([1.0, 0, 0])) == pytest.approx(1.0)


def test_unknown_scoring_suggests():
    with pytest.raises(M2DError, match="did you mean 'do-acp'"):
        SCORINGS["do_acp"]
