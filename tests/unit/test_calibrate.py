"""Calibration statistics against a brute-force float64 oracle; padding; the stats artifact."""

from __future__ import annotations

import json

import pytest
import torch

from m2d_ray.calibrate import calibrate
from m2d_ray.calibrate.artifact import STATS_FILE, load_stats
from m2d_ray.calibrate.collect import collect_stats
from m2d_ray.data.text import TokenSet, calibration_set, load_text
from m2d_ray.errors import M2DError


def oracle_stats(teacher, ids: torch.Tensor, mask: torch.Tensor, batch_size: int) -> dict[int, dict[str, torch.Tensor]]:
    """Per-token, per-expert loops in float64 on hidden states captured from the model, run in the same
    batches as the code under test (float32 hidden states depend on the batch shape in the last bits, and
    this random teacher's large expert outputs turn that into more than the tolerance)."""
    adapter, model = teacher.adapter, teacher.model
    blocks = adapter.moe_blocks(model)
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in blocks}
    hooks = [
        b.register_forward_pre_hook(lambda m, a, i=i: captured[i].append(a[0].detach())) for i, b in blocks.items()
    ]
    with torch.no_grad():
        for s in range(0, ids.shape[0], batch_size):
            model(input_ids=ids[s : s + batch_size], attention_mask=mask[s : s + batch_size])
    for h in hooks:
        h.remove()
    out = {}
    for i, block in blocks.items():
        states = torch.cat([c.reshape(-1, c.shape[-1]) for c in captured[i]])
        h = states[mask.reshape(-1).bool()]
        w = adapter.experts(block).to(torch.float64)
        E = w.num_experts
        logits = h.double() @ block.gate.weight.double().T
        p = torch.softmax(logits, -1)
        top = p.topk(adapter.top_k(teacher.config), dim=-1).indices
        count, psel = torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64)
        for t in range(h.shape[0]):
            for e in top[t].tolist():
                count[e] += 1
                psel[e] += p[t, e]
        f = []
        for e in range(E):
            a = torch.nn.functional.silu(h.double() @ w.gate[e].T) * (h.double() @ w.up[e].T)
            f.append(a @ w.down[e].T)
        G = torch.zeros(E, E, dtype=torch.float64)
        for a_ in range(E):
            for b_ in range(E):
                G[a_, b_] = (f[a_] * f[b_]).sum()
        out[i] = {"tokens": torch.tensor(float(h.shape[0])), "count": count, "psum": p.sum(0), "psel": psel, "gram": G}
    return out


def test_stats_match_bruteforce_oracle_and_padding_is_masked(tiny_teacher):
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # padding on the right
    mask[2, 5:] = 0
    ids = torch.where(mask.bool(), ids, torch.zeros_like(ids))
    got = collect_stats(tiny_teacher.model, tiny_teacher.adapter, ids, mask, batch_size=2, progress=False)
    ref = oracle_stats(tiny_teacher, ids, mask, batch_size=2)
    for i in ref:
        assert float(got[i].tokens) == int(mask.sum())
        for key in ("count", "psum", "psel"):
            assert torch.allclose(getattr(got[i], key), ref[i][key], rtol=1e-6, atol=1e-9), key
        # expert outputs are float32 (accumulated in float64): an entry that cancels to near zero carries the
        # round-off of the large ones, so the error is measured against the Gram's scale, not entrywise
        scale = ref[i]["gram"].abs().max()
        assert (got[i].gram - ref[i]["gram"]).abs().max() <= 1e-6 * scale
        assert got[i].count.sum() == 2 * int(mask.sum())  # top-2
        assert got[i].gram.dtype == torch.float64
    # changing what sits in padded positions changes nothing
    ids2 = torch.where(mask.bool(), ids, torch.full_like(ids, 7))
    got2 = collect_stats(tiny_teacher.model, tiny_teacher.adapter, ids2, mask, batch_size=2, progress=False)
    for i in got:
        scale = got[i].gram.abs().max()
        assert torch.allclose(got[i].gram, got2[i].gram, rtol=0, atol=1e-6 * scale)
        assert torch.equal(got[i].count, got2[i].count)


def test_stats_are_additive_over_batches(tiny_teacher):
    torch.manual_seed(2)
    ids = torch.randint(1, 100, (4, 16))
    mask = torch.ones_like(ids)
    whole = collect_stats(tiny_teacher.model, tiny_teacher.adapter, ids, mask, batch_size=4, progress=False)
    a = collect_stats(tiny_teacher.model, tiny_teacher.adapter, ids[:1], mask[:1], progress=False)
    b = collect_stats(tiny_teacher.model, tiny_teacher.adapter, ids[1:], mask[1:], progress=False)
    for i in whole:
        summed = a[i].add_(b[i])
        assert torch.allclose(summed.gram, whole[i].gram, rtol=0, atol=1e-6 * whole[i].gram.abs().max())
        assert torch.allclose(summed.psum, whole[i].psum, rtol=1e-6)
        assert torch.equal(summed.count, whole[i].count)


def tokens_for(teacher, n_chars: int = 4000) -> TokenSet:
    return calibration_set(teacher.tokenizer, load_text("synthetic:valid")[:n_chars], seq_len=64, max_tokens=None)


def test_artifact_roundtrip_reuse_and_corruption(tiny_teacher, tmp_path):
    toks = tokens_for(tiny_teacher)
    out = tmp_path / "stats"
    art, reused = calibrate(tiny_teacher, toks, "synthetic:valid", out=out, progress=False)
    assert not reused and (out / STATS_FILE).exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["n_tokens"] == toks.n_tokens and manifest["model"]["model_type"] == "qwen3_moe"
    assert manifest["data"]["tokens_sha256"] == toks.sha256() and manifest["sha256"] == art.checksum
    again, reused = calibrate(tiny_teacher, toks, "synthetic:valid", out=out, progress=False)
    assert reused and again.checksum == art.checksum
    loaded = load_stats(out)
    for i in art.layers:
        assert torch.equal(loaded.layers[i].gram, art.layers[i].gram)
    # other tokens -> recomputed, not reused; replacing the old artifact needs overwrite
    other = tokens_for(tiny_teacher, 3000)
    with pytest.raises(M2DError, match="pass --overwrite"):
        calibrate(tiny_teacher, other, "synthetic:valid", out=out, progress=False)
    assert load_stats(out).checksum == art.checksum  # untouched
    _, reused = calibrate(tiny_teacher, other, "synthetic:valid", out=out, progress=False, overwrite=True)
    assert not reused and load_stats(out).checksum != art.checksum
    # a flipped byte is caught by the checksum
    raw = bytearray((out / STATS_FILE).read_bytes())
    raw[-1] ^= 0xFF
    (out / STATS_FILE).write_bytes(bytes(raw))
    with pytest.raises(M2DError, match="checksum"):
        load_stats(out)


def test_too_short_and_empty_calibration_text(tiny_teacher):
    with pytest.raises(M2DError, match="empty"):
        calibration_set(tiny_teacher.tokenizer, "   \n", seq_len=64, max_tokens=None)
    with pytest.raises(M2DError, match="at least"):
        calibration_set(tiny_teacher.tokenizer, "the law", seq_len=64, max_tokens=None)
