"""The paper's equations and theorems, tested directly against float64 references and oracles."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from m2d_ray.arch.base import ExpertWeights, Routing, clamped_swiglu, expert_outputs, rel_error, swiglu
from m2d_ray.calibrate.stats import LayerStats, routing_stats
from m2d_ray.convert.merge import concat_groups, merge_group, merge_weights
from m2d_ray.convert.scaling import SCALINGS
from m2d_ray.errors import M2DError
from m2d_ray.grouping import GROUPINGS, GroupingInputs, group
from m2d_ray.scoring import SCORINGS, select
from m2d_ray.scoring.base import effective_rank
from m2d_ray.scoring.dopt import greedy_logdet, greedy_logdet_naive, kernel, logdet_gain, ridge


def rand_experts(E=6, I=5, d=7, seed=0, biased=False, act=swiglu) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return ExpertWeights(
        gate=r(E, I, d), up=r(E, I, d), down=r(E, d, I), act=act,
        gate_bias=r(E, I) if biased else None, up_bias=r(E, I) if biased else None, down_bias=r(E, d) if biased else None,
    )


def naive_expert(w: ExpertWeights, e: int, h: torch.Tensor) -> torch.Tensor:
    """f_e(h) written out per expert, the textbook way."""
    g = h @ w.gate[e].T + (w.gate_bias[e] if w.gate_bias is not None else 0)
    u = h @ w.up[e].T + (w.up_bias[e] if w.up_bias is not None else 0)
    return w.act(g, u) @ w.down[e].T + (w.down_bias[e] if w.down_bias is not None else 0)


# ---- block concatenation -------------------------------------------------------------
@pytest.mark.parametrize("biased,act", [(False, swiglu), (True, clamped_swiglu(1.702, 7.0))])
def test_block_concatenation_is_exact(biased, act):
    w = rand_experts(biased=biased, act=act)
    groups = [[0, 3], [1], [2, 4, 5]]
    scores = torch.tensor([0.5, 0.1, 0.3, 0.2, 0.05, 0.7], dtype=torch.float64)
    merged = [merge_group(w, g, merge_weights(scores, g)) for g in groups]
    alphas = [0.2, 0.5, 0.3]
    dense = concat_groups(merged, alphas)
    h = torch.randn(40, 7, dtype=torch.float64) * 3  # large enough to hit GPT-OSS's clamps
    ref = sum(a * naive_expert(m, 0, h) for m, a in zip(merged, alphas))
    assert dense.width == 3 * 5
    assert torch.allclose(dense(h), ref, rtol=0, atol=1e-12 * ref.abs().max())


def test_all_expert_outputs_match_per_expert_loop():
    w = rand_experts(biased=True)
    h = torch.randn(9, 7, dtype=torch.float64)
    y = expert_outputs(w, h)
    for e in range(w.num_experts):
        assert torch.allclose(y[e], naive_expert(w, e, h), atol=1e-12)


def test_merge_is_score_weighted_average_and_single_member_is_identity():
    w = rand_experts()
    s = torch.tensor([2.0, 0, 0, 6.0, 0, 0], dtype=torch.float64)
    m = merge_group(w, [0, 3], merge_weights(s, [0, 3]))
    assert torch.allclose(m.gate[0], 0.25 * w.gate[0] + 0.75 * w.gate[3])
    assert torch.allclose(m.down[0], 0.25 * w.down[0] + 0.75 * w.down[3])
    one = merge_group(w, [4], merge_weights(s, [4]))  # zero score -> uniform -> the expert itself
    assert torch.equal(one.up[0], w.up[4])


def test_proportional_scaling_equals_global_score_weighting():
    """alpha_g * W_down^g = sum_{e in g} (s_e / sum_S s) W_down^e: one global score weighting."""
    w = rand_experts()
    s = torch.rand(6, dtype=torch.float64) + 0.1
    groups = [[5, 1], [0, 2, 3]]
    alphas = SCALINGS["proportional"](LayerStats.zeros(6), groups, s)
    total = s[[5, 1, 0, 2, 3]].sum()
    for g, a in zip(groups, alphas):
        merged = merge_group(w, g, merge_weights(s, g))
        expected = sum(s[e] / total * w.down[e] for e in g)
        assert torch.allclose(a * merged.down[0], expected, atol=1e-13)


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


# ---- grouping ------------------------------------------------------------------------
def clustered_inputs(k=3, per=4, d=16, seed=0) -> tuple[GroupingInputs, list[set[int]]]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, d, generator=g, dtype=torch.float64)
    outs = torch.cat([centers[i] + 0.05 * torch.randn(per, d, generator=g, dtype=torch.float64) for i in range(k)])
    perm = torch.randperm(k * per, generator=g)
    outs = outs[perm]  # shuffle so clusters are not contiguous ids
    truth = [set(torch.nonzero(perm // per == i).flatten().tolist()) for i in range(k)]
    E = k * per
    w = ExpertWeights(gate=outs[:, None, :].repeat(1, 2, 1), up=outs[:, None, :].repeat(1, 2, 1), down=outs[:, :, None].repeat(1, 1, 2))
    inp = GroupingInputs(
        selected=list(range(E)), scores=torch.rand(E, generator=g, dtype=torch.float64),
        gram=outs @ outs.T, router=lambda: outs, experts=lambda: w,
    )
    return inp, truth


@pytest.mark.parametrize("name", ["oc", "wc", "rc"])
def test_clustering_recovers_well_separated_clusters(name):
    inp, truth = clustered_inputs()
    groups = group(name, inp, 3)
    assert sorted(map(sorted, map(set, groups))) == sorted(map(sorted, truth))


def test_anchor_based_attaches_to_most_similar_anchor():
    inp, truth = clustered_inputs()
    groups = group("ab", inp, 3)
    ranked = inp.ranked()
    for gr in groups:
        anchor = gr[0]
        assert anchor in ranked[:3]
        cluster = next(c for c in truth if anchor in c)
        # when the 3 anchors fall into distinct clusters, every member shares its anchor's cluster
        if len({next(i for i, c in enumerate(truth) if a in c) for a in ranked[:3]}) == 3:
            assert set(gr) <= cluster


def test_round_robin_assignment():
    inp, _ = clustered_inputs()
    ranked = inp.ranked()
    groups = group("rr", inp, 3)
    assert groups == [ranked[0::3], ranked[1::3], ranked[2::3]]


@pytest.mark.parametrize("name", GROUPINGS.names())
@pytest.mark.parametrize("k", [1, 2, 5, 12])
def test_every_grouping_gives_exactly_k_nonempty_groups(name, k):
    inp, _ = clustered_inputs()
    groups = group(name, inp, k)
    assert len(groups) == k and all(groups)
    assert sorted(sum(groups, [])) == sorted(inp.selected)


def test_unknown_method_suggests():
    with pytest.raises(M2DError, match="did you mean 'do-acp'"):
        SCORINGS["do_acp"]
    with pytest.raises(M2DError, match="did you mean 'oc'"):
        GROUPINGS["ocx"]


def test_cosine_distance_of_concatenated_parts_equals_the_definition(monkeypatch):
    """1 - <x_i, x_j> / (|x_i| |x_j|) of the rows of concat(parts), zero rows at distance 1; the parts are
    summed block by block (never concatenated or copied to float64 whole), so blocks must not matter."""
    from m2d_ray.grouping import cluster

    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(6, 3, 50, generator=g), torch.randn(6, 70, generator=g)]
    parts[0][4] = 0
    parts[1][4] = 0  # an all-zero row
    x = torch.cat([p.reshape(6, -1) for p in parts], dim=1).double()
    n = x.norm(dim=1)
    want = torch.ones(6, 6, dtype=torch.float64)
    for i in range(6):
        for j in range(6):
            if n[i] > 0 and n[j] > 0:
                want[i, j] = 1 - float(x[i] @ x[j]) / float(n[i] * n[j])
    want.fill_diagonal_(0.0)
    got = cluster.cosine_distance(*parts)
    assert got.dtype == torch.float64 and rel_error(got, want.clamp(min=0)) < 1e-12
    monkeypatch.setattr(cluster, "_COLS", 7)  # many column blocks
    assert rel_error(cluster.cosine_distance(*parts), got) < 1e-12
