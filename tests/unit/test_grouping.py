"""Groupings: clustering recovers planted clusters, anchor-based and round-robin by definition, exactly k
non-empty groups for every method, the blocked cosine distance against its definition."""

from __future__ import annotations

import pytest
import torch

from m2d_ray.arch.base import ExpertWeights, rel_error
from m2d_ray.catalog.methods import GROUPINGS
from m2d_ray.errors import M2DError
from m2d_ray.grouping.methods import GroupingInputs, group


# ---- grouping ------------------------------------------------------------------------
def clustered_inputs(k=3, per=4, d=16, seed=0) -> tuple[GroupingInputs, list[set[int]]]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, d, generator=g, dtype=torch.float64)
    outs = torch.cat([centers[i] + 0.05 * torch.randn(per, d, generator=g, dtype=torch.float64) for i in range(k)])
    perm = torch.randperm(k * per, generator=g)
    outs = outs[perm]  # shuffle so clusters are not contiguous ids
    truth = [set(torch.nonzero(perm // per == i).flatten().tolist()) for i in range(k)]
    E = k * per
    w = ExpertWeights(
        gate=outs[:, None, :].repeat(1, 2, 1),
        up=outs[:, None, :].repeat(1, 2, 1),
        down=outs[:, :, None].repeat(1, 1, 2),
    )
    inp = GroupingInputs(
        selected=list(range(E)),
        scores=torch.rand(E, generator=g, dtype=torch.float64),
        gram=outs @ outs.T,
        router=lambda: outs,
        experts=lambda: w,
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


def test_unknown_grouping_suggests():
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
