"""The synthetic multi-domain corpus, its tokenizer and the embedded tiny Qwen3-MoE teacher trained on it."""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter

import pytest

from m2d_ray.data import synthetic
from m2d_ray.data.synthetic import DOMAINS, Document

# ----------------------------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------------------------


def test_deterministic_and_prefix_stable():
    a = synthetic.generate_documents("train", 4, seed=0)
    b = synthetic.generate_documents("train", 4, seed=0)
    assert a == b
    assert synthetic.generate_documents("train", 7, seed=0)[: len(a)] == a
    assert synthetic.corpus_text("valid", 30_000) == synthetic.corpus_text("valid", 30_000)
    long = synthetic.corpus_text("valid", 60_000)
    short = synthetic.corpus_text("valid", 10_000)
    assert long.startswith(short) and 9_000 < len(short) <= 10_000


def test_splits_and_seeds_are_disjoint():
    texts = {
        (split, seed): {d.text for d in synthetic.generate_documents(split, 40, seed=seed)}
        for split in synthetic.SPLITS
        for seed in (0, 1)
    }
    keys = list(texts)
    for i, ka in enumerate(keys):
        assert len(texts[ka]) == 40 * len(DOMAINS)  # no duplicate documents within a stream either
        for kb in keys[i + 1 :]:
            assert not texts[ka] & texts[kb], (ka, kb)
    with pytest.raises(ValueError):
        synthetic.generate_documents("dev", 1)


def test_golden_digest():
    """The committed teacher was trained on exactly this generator: a change here means retraining it
    (experiments/train_tiny_teacher.py) and updating this digest."""
    digest = hashlib.sha256(synthetic.corpus_text("test", 5_000).encode()).hexdigest()[:16]
    assert digest == GOLDEN_TEST_DIGEST


GOLDEN_TEST_DIGEST = "f06670d755733f85"


def test_every_domain_labelled_and_in_its_own_vocabulary():
    docs = synthetic.generate_documents("test", 30)
    assert all(isinstance(d, Document) for d in docs)
    assert Counter(d.domain for d in docs) == {dom: 30 for dom in DOMAINS}
    # every round of six documents holds each domain once
    for r in range(30):
        assert sorted(d.domain for d in docs[6 * r : 6 * r + 6]) == sorted(DOMAINS)
    own = {dom: set(synthetic.domain_vocabulary(dom)) for dom in DOMAINS}
    for doc in docs:
        words = doc.text.split()
        n_sent = sum(w in (".", "?") for w in words)
        assert 3 <= n_sent <= 8 and words[-1] in (".", "?")
        for other in DOMAINS:
            hits = sum(w in own[other] for w in words)
            if other == doc.domain:
                assert hits >= 3
            else:  # only the deliberately shared unit "degrees" may cross domains
                assert hits <= sum(w == "degrees" for w in words), (doc.domain, other, doc.text)
    doms = synthetic.corpus_documents("test", 20_000)
    assert synthetic.corpus_text("test", 20_000) == "\n\n".join(d.text for d in doms)


def test_vocabulary_covers_generated_text_and_is_small():
    vocab = synthetic.vocabulary()
    assert len(vocab) == len(set(vocab)) and len(vocab) < 1000
    used = Counter(synthetic.corpus_text("train", 400_000).split())
    assert set(used) <= set(vocab)
    assert len(set(vocab) - set(used)) <= 5  # (almost) every word is reachable


def test_generation_is_fast():
    t = time.perf_counter()
    text = synthetic.corpus_text("train", 1_000_000, seed=123)
    assert len(text) > 990_000
    assert time.perf_counter() - t < 2.0


# ----------------------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic.build_tokenizer()


def test_tokenizer_round_trip(tokenizer, tmp_path):
    tok = tokenizer
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0 and tok.unk_token_id == 1
    assert len(tok) == len(synthetic.vocabulary()) + 2
    text = synthetic.corpus_text("valid", 30_000)
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert len(ids) == len(text.split())  # one token per word / punctuation mark
    for doc in synthetic.generate_documents("valid", 2):
        assert tok.decode(tok(doc.text)["input_ids"]) == doc.text
    # unknown words map to <unk>; casing and attached punctuation are normalised
    assert tok.convert_ids_to_tokens(tok("The Chef stirs, zzz.")["input_ids"]) == [
        "the",
        "chef",
        "stirs",
        ",",
        "<unk>",
        ".",
    ]

    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == ids
    assert again.eos_token_id == 0 and again.pad_token_id == 0 and again.unk_token_id == 1
    assert again.decode(again(text[:500])["input_ids"][:20]) == tok.decode(ids[:20])


# ----------------------------------------------------------------------------------------------------------------
# the embedded teacher
# ----------------------------------------------------------------------------------------------------------------
EVAL_CHARS = 20_000
SEQ = 128
# Mean over layers of I(domain; expert) / H(domain) of the top-k selections on EVAL_CHARS of the test split.
# Measured (train_info.json, 200k characters): the committed teacher 0.66 (layers 0.75 / 0.66 / 0.64 / 0.57).
# The same model trained without the router's domain warm-up (--domain-warmup-steps 0) reached the same
# perplexity (4.63) but only 0.03, routing by token identity; random weights give about 0.01. 0.3 is ten times
# what domain-blind routing gives and far below the teacher's value, so the test fails for a teacher whose
# experts do not specialise by domain, not for sampling noise on 20k characters.
NMI_THRESHOLD = 0.3


@pytest.fixture(scope="module")
def torch_one_thread():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def teacher(torch_one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from m2d_ray.assets import TINY_TEACHER_DIR

    assert (TINY_TEACHER_DIR / "model.safetensors").is_file(), "the tiny teacher is missing"
    model = AutoModelForCausalLM.from_pretrained(TINY_TEACHER_DIR).eval()
    tok = AutoTokenizer.from_pretrained(TINY_TEACHER_DIR)
    info = json.loads((TINY_TEACHER_DIR / "train_info.json").read_text())
    return model, tok, info


def _heldout(model, tok, torch):
    """(perplexity, mean NMI over layers, per-layer NMI) on EVAL_CHARS of the test split."""
    docs = synthetic.corpus_documents("test", EVAL_CHARS)
    ids, doms = [], []
    for doc in docs:
        seq = tok(doc.text)["input_ids"]
        ids += seq
        doms += [DOMAINS.index(doc.domain)] * len(seq)
    n = len(ids) // SEQ
    x = torch.tensor(ids[: n * SEQ]).view(n, SEQ)
    d = torch.tensor(doms[: n * SEQ]).view(n, SEQ)
    cfg = model.config
    E, k, D = cfg.num_experts, cfg.num_experts_per_tok, len(DOMAINS)
    with torch.no_grad():
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
    logp = torch.log_softmax(out.logits[:, :-1].double(), -1)
    nll = -logp.gather(-1, x[:, 1:, None]).mean().item()
    nmis = []
    for logits in out.router_logits:
        top = logits.topk(k, dim=-1).indices
        pairs = d.reshape(-1, 1) * E + top
        p = torch.bincount(pairs.reshape(-1), minlength=D * E).double().view(D, E)
        p /= p.sum()
        pd, pe = p.sum(1, keepdim=True), p.sum(0, keepdim=True)
        nz = p > 0
        mi = (p[nz] * (p[nz] / (pd * pe)[nz]).log()).sum().item()
        hd = -(pd * pd.log()).sum().item()
        nmis.append(mi / hd)
    return math.exp(nll), sum(nmis) / len(nmis), nmis


def test_teacher_loads_and_is_a_qwen3_moe(teacher):
    model, tok, info = teacher
    cfg = model.config
    assert cfg.model_type == "qwen3_moe" and type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok) == (4, 64, 16, 2)
    assert cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob and not cfg.tie_word_embeddings
    assert cfg.vocab_size % 8 == 0 and cfg.vocab_size >= len(tok)
    assert not cfg.output_router_logits
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (16, 64, 64)
    assert (
        tok("the chef stirs the soup .")["input_ids"]
        == synthetic.build_tokenizer()("the chef stirs the soup .")["input_ids"]
    )
    for key in (
        "steps",
        "tokens_seen",
        "train_wall_time_s",
        "heldout_perplexity",
        "uniform_perplexity",
        "unigram_perplexity",
        "routing",
    ):
        assert key in info


def test_teacher_perplexity_and_domain_routing(teacher, torch_one_thread):
    model, tok, info = teacher
    ppl, nmi, per_layer = _heldout(model, tok, torch_one_thread)
    uniform = len(tok)
    assert ppl < uniform / 4
    assert ppl < info["unigram_perplexity"] / 2
    # consistent with the figure recorded at training time on the full 200k-character test text
    assert abs(math.log(ppl / info["heldout_perplexity"])) < 0.15, (ppl, info["heldout_perplexity"])
    assert nmi > NMI_THRESHOLD, per_layer
    assert abs(nmi - info["routing"]["mean_nmi"]) < 0.1


def test_nmi_threshold_rejects_untrained_routing(teacher, torch_one_thread):
    """The routing test can fail: the same architecture with random weights stays far below the threshold."""
    from transformers import AutoModelForCausalLM

    model, tok, _ = teacher
    torch_one_thread.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(model.config).eval()
    ppl, nmi, _ = _heldout(fresh, tok, torch_one_thread)
    assert nmi < NMI_THRESHOLD / 10
    assert ppl > len(tok) / 4
