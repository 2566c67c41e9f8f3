"""Perplexity protocol against a direct computation; divergence is reported, not raised."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from m2d_ray.errors import M2DError
from m2d_ray.evaluate.perplexity import perplexity, perplexity_batches, windows


def test_matches_transformers_own_loss(tiny_teacher):
    model = tiny_teacher.model
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (3 * 16 + 5,))  # 3 full windows + a 5-token tail
    got = perplexity(model, ids, seq_len=16, batch_size=2)
    total, n = 0.0, 0
    for start in range(0, ids.numel(), 16):
        w = ids[start : start + 16][None]
        with torch.no_grad():
            loss = model(input_ids=w, labels=w).loss  # mean over the window's w-1 predictions
        total += float(loss) * (w.shape[1] - 1)
        n += w.shape[1] - 1
    assert got.tokens == n == 3 * 15 + 4 and got.windows == 4
    assert got.ppl == pytest.approx(math.exp(total / n), rel=1e-5)
    # running values after each batch end at the final one
    last = list(perplexity_batches(model, ids, seq_len=16, batch_size=2))[-1]
    assert last.ppl == pytest.approx(got.ppl, rel=1e-12)


def test_nan_weights_are_reported_as_diverged(tiny_teacher):
    broken = copy.deepcopy(tiny_teacher.model)
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = float("nan")
    res = perplexity(broken, torch.randint(1, 100, (64,)), seq_len=16)
    assert res.diverged and res.to_json()["ppl"] is None


def test_windows_and_too_short():
    w, m = windows(torch.arange(10), 4)
    assert w.shape == (3, 4) and int(m.sum()) == 10
    w, m = windows(torch.arange(9), 4)  # a 1-token tail predicts nothing: dropped
    assert w.shape == (2, 4)
    with pytest.raises(M2DError):
        windows(torch.arange(1), 4)
