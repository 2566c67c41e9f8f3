"""Packed training data: EOS between documents, disjoint rank shards, exact skip on resume, file formats."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from m2d_ray.data.synthetic import build_tokenizer
from m2d_ray.distill.data import documents, packed_blocks, train_batches
from m2d_ray.errors import M2DError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _take(it, n):
    return list(itertools.islice(it, n))


def test_blocks_are_the_documents_joined_by_eos(tok):
    docs = ["the cat sat on the mat", "a dog ran", "birds fly south in the winter"]
    flat = []
    for d in docs:
        flat += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    blocks = list(packed_blocks(tok, docs, 4))
    assert torch.cat(blocks).tolist() == flat[: 4 * len(blocks)]
    assert len(blocks) == len(flat) // 4


def test_rank_shards_are_disjoint_and_cover_the_stream(tok):
    single = torch.cat(_take(train_batches(tok, "synthetic:train", 32, 1), 12))
    r0 = torch.cat(_take(train_batches(tok, "synthetic:train", 32, 1, rank=0, world=2), 6))
    r1 = torch.cat(_take(train_batches(tok, "synthetic:train", 32, 1, rank=1, world=2), 6))
    assert torch.equal(torch.stack([r0, r1], 1).reshape(-1, 32), single)


def test_resume_skips_exactly_the_consumed_blocks(tok):
    run = train_batches(tok, "synthetic:train", 32, 4, rank=1, world=2)
    first = _take(run, 5)
    rest = _take(run, 3)
    resumed = _take(train_batches(tok, "synthetic:train", 32, 4, rank=1, world=2, start_block=5 * 4 * 2), 3)
    assert all(torch.equal(a, b) for a, b in zip(rest, resumed))
    assert not torch.equal(first[0], rest[0])


def test_small_sources_are_cycled(tok, tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_text("one two three four five six seven eight nine ten " * 3)
    batches = _take(train_batches(tok, str(f), 8, 2), 20)  # far more blocks than the file holds
    assert len(batches) == 20


def test_jsonl_and_parquet_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": "first doc"}, {"text": "second doc", "id": 2}]
    j = tmp_path / "d.jsonl"
    j.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["first doc", "second doc"], "n": [1, 2]}), p)
    assert list(documents(str(j))) == list(documents(str(p))) == ["first doc", "second doc"]


def test_bad_inputs_fail_with_one_line(tmp_path, tok, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": 1}\n')
    with pytest.raises(M2DError, match="bad.jsonl:1 is not a JSON object with a 'text' field"):
        list(documents(str(bad)))
    short = tmp_path / "short.txt"
    short.write_text("hi")
    with pytest.raises(M2DError, match="fewer than seq_len"):
        next(train_batches(tok, str(short), 512, 1))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(M2DError, match="offline\\); run once online .* or pass local Parquet"):
        next(documents("fineweb-edu"))
