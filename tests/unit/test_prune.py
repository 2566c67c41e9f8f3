"""Dense-to-dense (Minitron) pruning: importance against brute force and planted units, pruning nothing is
exact, every pruned shape reloads natively at its size, the search at the MoE student's parameter count,
and `m2d prune-dense` end to end."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from conftest import SMALL_CALIB
from families import FAMILIES, reinit_
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from m2d_ray.arch.dense import DenseSizes, get_dense_adapter
from m2d_ray.artifacts import output_kind
from m2d_ray.data.text import TokenSet
from m2d_ray.errors import M2DError
from m2d_ray.prune import (
    PrunedSpec,
    candidates,
    check_sizes,
    collect_importance,
    count_params,
    moe_student_params,
    prune,
    search,
)
from m2d_ray.prune.export import INFO_FILE, export_pruned
from m2d_ray.prune.importance import seq_mean_sq
from m2d_ray.prune.prune import keep_sets
from m2d_ray.prune.search import MIN_CANDIDATES, sizes_params

COMMON = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=64,
)
DENSE = {
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=8),
    "qwen3-tied": lambda: Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**COMMON),  # q/k/v biases
    "llama": lambda: LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(**COMMON, head_dim=8),
}


def dense_model(make, seed: int = 0, dtype=torch.float32):
    model = AutoModelForCausalLM.from_config(make(), dtype=dtype)
    reinit_(model, seed)
    return model.eval()


def token_set(vocab: int, n: int = 6, seq: int = 12, seed: int = 0) -> TokenSet:
    """Random token sequences; the last one half padding (padding must not count)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, seq // 2 :] = 0
    ids[-1, seq // 2 :] = 0
    return TokenSet(ids=ids, mask=mask)


def logits(model, ids=None):
    ids = torch.arange(1, 17).view(1, 16) % model.config.vocab_size if ids is None else ids
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module", params=list(DENSE), ids=list(DENSE))
def family(request):
    model = dense_model(DENSE[request.param])
    imp = collect_importance(model, get_dense_adapter(model.config), token_set(model.config.vocab_size), batch_size=4)
    return request.param, model, imp


def test_pruning_nothing_reproduces_the_teacher_bit_for_bit(family):
    _, model, imp = family
    full = get_dense_adapter(model.config).sizes(model.config)
    student = prune(model, full, imp)
    assert type(student) is type(model)
    assert student.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(a, model.state_dict()[k]) for k, a in student.state_dict().items())
    assert torch.equal(logits(student), logits(model))


def test_a_pruned_shape_reloads_natively_at_its_size(family, tmp_path):
    name, model, imp = family
    sizes = DenseSizes(hidden=24, ffn=20, heads=2, layers=3)
    student = prune(model, sizes, imp)
    export_pruned(student, None, tmp_path / "p", sizes, imp, {"family": name})  # reloads and compares before it appears
    assert output_kind(tmp_path / "p") == "pruned"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "p")
    cfg = reloaded.config
    assert type(reloaded) is type(model)
    assert (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.num_hidden_layers,
    ) == (24, 20, 2, 1, 3)
    assert get_dense_adapter(cfg).head_dim(cfg) == 8
    assert sum(p.numel() for p in reloaded.parameters()) == sizes_params(
        model.config, get_dense_adapter(model.config), sizes
    )
    assert torch.isfinite(logits(reloaded)).all()
    assert torch.equal(logits(reloaded), logits(student))
    assert json.loads((tmp_path / "p" / INFO_FILE).read_text())["family"] == name


def test_aggregation_is_sequence_mean_then_batch_l2():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4, 5, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    want = torch.zeros(3, dtype=torch.float64)
    for b in range(4):
        valid = [s for s in range(5) if mask[b, s]]
        if valid:
            want += torch.stack([x[b, s] for s in valid]).mean(0) ** 2
    assert torch.allclose(seq_mean_sq(x, mask), want, rtol=1e-14, atol=0)


def test_importance_of_a_padded_batch_equals_one_unpadded_sequence_at_a_time():
    """Batching and padding change nothing: the batched pass against each sequence alone, cut to its tokens."""
    model = dense_model(DENSE["qwen3"], dtype=torch.float64)
    adapter = get_dense_adapter(model.config)
    toks = token_set(model.config.vocab_size)
    batched = collect_importance(model, adapter, toks, batch_size=4)
    parts = []
    for ids, mask in zip(toks.ids, toks.mask):
        n = int(mask.sum())
        parts.append(collect_importance(model, adapter, TokenSet(ids[None, :n], mask[None, :n]), batch_size=1))
    # alone, a sequence's score is its sequence mean, so the batch L2 is the root of the sum of their squares
    # (hidden channels sum that over norms: covered by the planted test below)
    for field in ("ffn", "heads"):
        want = sum(getattr(p, field) ** 2 for p in parts).sqrt()
        assert torch.allclose(getattr(batched, field), want, rtol=1e-10, atol=0), field
    n = [p.n_tokens for p in parts]
    want_bi = sum((1 - p.layers) * k for p, k in zip(parts, n)) / sum(n)
    assert torch.allclose(1 - batched.layers, want_bi, rtol=1e-12, atol=1e-14)
    assert batched.n_tokens == sum(n) == toks.n_tokens
    # block importance is 1 - cos(input, output) of each layer: against the model's own hidden states
    with torch.no_grad():
        hs = model(input_ids=toks.ids[:1], output_hidden_states=True).hidden_states
    one = collect_importance(model, adapter, TokenSet(toks.ids[:1], toks.mask[:1]))
    for i in range(model.config.num_hidden_layers - 1):  # the last hidden state is after the final norm
        cos = torch.nn.functional.cosine_similarity(hs[i][0], hs[i + 1][0], dim=-1).mean()
        assert math.isclose(float(one.layers[i]), 1 - float(cos), rel_tol=1e-10)


def planted_teacher():
    """A float64 Qwen3 with units that do nothing: hidden channels never written, a key/value group with zero
    values and FFN neurons with zero up-projections in layers 0, 2 and 3, and layer 1 the identity."""
    model = dense_model(lambda: Qwen3Config(**COMMON, head_dim=8, rms_norm_eps=1e-12), dtype=torch.float64)
    dead = {
        "hidden": [3, 17, 30],
        "group": {0: 1, 2: 0, 3: 1},
        "ffn": {0: [0, 5, 9, 40], 2: [1, 2, 47, 30], 3: [7, 8, 9, 10]},
        "layer": 1,
    }
    sd = model.state_dict()
    with torch.no_grad():
        sd["model.embed_tokens.weight"][:, dead["hidden"]] = 0
        for i in range(4):
            p = f"model.layers.{i}."
            sd[p + "self_attn.o_proj.weight"][dead["hidden"]] = 0
            sd[p + "mlp.down_proj.weight"][dead["hidden"]] = 0
        sd["model.layers.1.self_attn.o_proj.weight"].zero_()
        sd["model.layers.1.mlp.down_proj.weight"].zero_()
        for i, g in dead["group"].items():
            sd[f"model.layers.{i}.self_attn.v_proj.weight"][g * 8 : (g + 1) * 8] = 0
        for i, rows in dead["ffn"].items():
            sd[f"model.layers.{i}.mlp.up_proj.weight"][rows] = 0
    return model, dead


def test_importance_finds_the_planted_units_and_pruning_them_is_exact():
    model, dead = planted_teacher()
    adapter = get_dense_adapter(model.config)
    imp = collect_importance(model, adapter, token_set(64, n=8, seq=16), batch_size=3)
    sizes = DenseSizes(hidden=29, ffn=44, heads=2, layers=3)
    keep = keep_sets(model.config, adapter, sizes, imp)
    assert keep.layers == [0, 2, 3]
    assert sorted(set(range(32)) - set(keep.hidden.tolist())) == dead["hidden"]
    for i in keep.layers:
        assert sorted(set(range(48)) - set(keep.ffn[i].tolist())) == sorted(dead["ffn"][i])
        kept_group = 1 - dead["group"][i]
        assert keep.kv[i].tolist() == list(range(kept_group * 8, kept_group * 8 + 8))
        assert keep.q[i].tolist() == list(range(kept_group * 16, kept_group * 16 + 16))
    assert abs(float(imp.layers[1])) < 1e-12 < float(imp.layers[[0, 2, 3]].min())
    student = prune(model, sizes, imp)
    ids = token_set(64, n=2, seq=16, seed=5).ids
    want = logits(model, ids)

    def err():
        return float((logits(student, ids) - want).norm() / want.norm())

    assert err() > 1e-2  # the pruned channels were always 0: only the RMS over 29 instead of 32 channels differs ...
    with torch.no_grad():  # ... so undoing that makes the pruned model the teacher (Qwen3RMSNorm computes in float32)
        for norm in adapter.hidden_norms(student):
            norm.weight.mul_(math.sqrt(32 / 29))
    assert err() < 1e-6


def test_sizes_must_make_a_valid_config():
    config = DENSE["qwen3"]()
    check_sizes(config, DenseSizes(32, 48, 4, 4))
    with pytest.raises(M2DError, match="not a multiple of 2"):
        check_sizes(config, DenseSizes(32, 48, 3, 4))
    with pytest.raises(M2DError, match=r"--ffn 49 is outside \[1, 48\]"):
        check_sizes(config, DenseSizes(32, 49, 4, 4))
    with pytest.raises(M2DError, match="Mixture-of-Experts"):
        get_dense_adapter(FAMILIES[0].make_config())


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """A saved pair: a Qwen3-MoE (E = 8 experts of width 16, top-2) and its dense twin (FFN width 8 x 16, the
    same attention, embeddings and tokenizer), both random; returns (moe dir, dense dir, dense model)."""
    from m2d_ray.arch.qwen3_moe import moe_config
    from m2d_ray.data.synthetic import build_tokenizer
    from workshop.random_models import tokenizer_fields

    tok = build_tokenizer()
    root = tmp_path_factory.mktemp("twin")
    f = tokenizer_fields(tok)
    shape = dict(hidden=32, layers=4, heads=4, kv_heads=2, head_dim=8, **f)  # max_positions 256, untied
    moe = dense_model(lambda: moe_config(**shape, experts=8, top_k=2, expert_width=16, ffn=48, norm_topk_prob=False))
    dense = dense_model(
        lambda: Qwen3Config(
            vocab_size=f["vocab"],
            hidden_size=32,
            intermediate_size=8 * 16,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            pad_token_id=f["pad_token_id"],
            eos_token_id=f["eos_token_id"],
        )
    )
    for name, model in (("moe", moe), ("dense", dense)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root / "moe", root / "dense", dense


def test_matched_budget_is_the_parameter_count_of_the_converted_student(tiny_teacher):
    from m2d_ray.convert.baselines import random_ffn_student

    student = random_ffn_student(tiny_teacher)  # the K = k student's architecture, built by the conversion code
    assert moe_student_params(tiny_teacher.name) == sum(p.numel() for p in student.parameters())


def test_every_candidate_has_the_budget_and_reloads_natively(twin, tmp_path):
    moe, _, model = twin
    target = moe_student_params(str(moe))
    shapes = candidates(model.config, target)
    assert len(shapes) >= MIN_CANDIDATES == 4
    kinds = [k for k, _ in shapes]
    assert sum(k.startswith("width") for k in kinds) >= 2 and any(k.startswith("depth") for k in kinds)
    assert len({(s.hidden, s.heads) for k, s in shapes if k.startswith("width")}) >= 2  # two different width mixes
    imp = collect_importance(model, get_dense_adapter(model.config), token_set(model.config.vocab_size))
    per_neuron = 3 * model.config.hidden_size * model.config.num_hidden_layers
    for kind, sizes in shapes:
        student = prune(model, sizes, imp)
        export_pruned(student, None, tmp_path / sizes.label(), sizes, imp, {})
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / sizes.label())
        assert type(reloaded) is type(model)
        assert get_dense_adapter(reloaded.config).sizes(reloaded.config) == sizes, kind
        assert abs(sum(p.numel() for p in reloaded.parameters()) - target) <= per_neuron / 2, kind
    with pytest.raises(M2DError, match="not below the teacher's"):
        candidates(model.config, count_params(model.config))
    with pytest.raises(M2DError, match="candidate shape"):
        candidates(model.config, 1000)


def test_search_promotes_the_lowest_perplexity_and_its_spec_rebuilds_it(twin):
    moe, path, model = twin
    target = moe_student_params(str(moe))
    toks = token_set(model.config.vocab_size, n=4, seq=32)
    eval_ids = token_set(model.config.vocab_size, n=1, seq=200, seed=3).ids.view(-1)
    res = search(str(path), toks, target, eval_ids, seq_len=64)
    assert len(res.rows) >= MIN_CANDIDATES
    best = min(res.rows, key=lambda r: r["ppl"])
    assert [r["best"] for r in res.rows].count(True) == 1 and best["best"]
    assert res.best.sizes == DenseSizes(best["hidden"], best["ffn"], best["heads"], best["layers"])
    spec = pickle.loads(pickle.dumps(res.best))  # what a Ray worker receives
    assert isinstance(spec, PrunedSpec)
    rebuilt = spec.build()
    assert all(torch.equal(a, res.model.state_dict()[k]) for k, a in rebuilt.state_dict().items())


def test_m2d_prune_dense_end_to_end(twin, tmp_path, capsys):
    from m2d_ray.cli import main

    moe, path, model = twin
    out = tmp_path / "d2d"
    argv = [
        "prune-dense",
        "--model",
        str(path),
        "--match",
        str(moe),
        *SMALL_CALIB,
        "--eval-data",
        "synthetic:valid",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["target_params"] == moe_student_params(str(moe))
    assert result["candidates"] >= 4 and result["dense_class"] == "Qwen3ForCausalLM"
    assert (out / "candidates.csv").read_text().count("\n") == result["candidates"] + 1
    assert "| candidate |" in (out / "candidates.md").read_text()
    info = json.loads((out / INFO_FILE).read_text())
    assert info["importance"]["ffn"].startswith("mean over the sequence, L2 over the batch")
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert get_dense_adapter(reloaded.config).sizes(reloaded.config) == DenseSizes(**result["sizes"])
    # one shape, pruning nothing: the teacher again, and --overwrite replaces the search
    assert (
        main(
            [
                "prune-dense",
                "--model",
                str(path),
                "--layers",
                "4",
                "--calib-data",
                "synthetic:valid",
                "--max-tokens",
                "512",
                "--out",
                str(out),
                "--overwrite",
            ]
        )
        == 0
    )
    again = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(again), logits(model))
    assert not (out / "candidates.csv").exists()


def test_the_embedded_dense_twin_matches_the_embedded_moe_teacher():
    from transformers import AutoConfig

    from m2d_ray.assets import TINY_DENSE_TEACHER_DIR, TINY_TEACHER_DIR

    moe, dense = AutoConfig.from_pretrained(TINY_TEACHER_DIR), AutoConfig.from_pretrained(TINY_DENSE_TEACHER_DIR)
    assert dense.model_type == "qwen3" and dense.intermediate_size == moe.num_experts * moe.moe_intermediate_size
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
    ):
        assert getattr(dense, key) == getattr(moe, key), key
    assert abs(count_params(dense) / count_params(moe) - 1) < 0.05
    info = json.loads((TINY_DENSE_TEACHER_DIR / "train_info.json").read_text())
    moe_info = json.loads((TINY_TEACHER_DIR / "train_info.json").read_text())
    for key in ("seed", "steps", "batch_size", "seq_len", "tokens_seen", "optimizer"):
        assert info[key] == moe_info[key], key
    assert info["eval"] == moe_info["eval"] and info["heldout_perplexity"] < 10
