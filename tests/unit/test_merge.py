"""Merging and concatenation against their definitions: the exactness of the dense block, the score-weighted
merge and proportional scaling (float64)."""

from __future__ import annotations

import pytest
import torch

from m2d_ray.arch.base import ExpertWeights, clamped_swiglu, expert_outputs, swiglu
from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.catalog.methods import SCALINGS
from m2d_ray.convert.merge import concat_groups, merge_group, merge_weights


def rand_experts(E=6, I=5, d=7, seed=0, biased=False, act=swiglu) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    return ExpertWeights(
        gate=r(E, I, d),
        up=r(E, I, d),
        down=r(E, d, I),
        act=act,
        gate_bias=r(E, I) if biased else None,
        up_bias=r(E, I) if biased else None,
        down_bias=r(E, d) if biased else None,
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
