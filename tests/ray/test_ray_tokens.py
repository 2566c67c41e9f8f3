"""The distillation stream tokenised by Ray Data (data/ray_tokens.py via runtime/shards.tokens): 1 and 2
actors (and the driver, for a small corpus) write identical token shards, equal to the single-process stream; a corpus
on S3 (moto on
127.0.0.1) is read where it is, never copied, and a resume against a changed S3 corpus is refused; a CRLF text corpus
gives the LF shards."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest
import torch
from corpora import write_corpus
from multinode import BUCKET, free_port, serve_s3

from m2d_ray.config import DistillConfig
from m2d_ray.errors import M2DError

# Ray's workers take S3 credentials from the environment they start with: set before any test starts Ray
for _k, _v in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}.items():
    os.environ.setdefault(_k, _v)

CFG = DistillConfig(train_data="", steps=6, batch_size=4, seq_len=64, eval_max_tokens=512, deepspeed=False)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; yields a client and the URL query that reaches it."""
    pytest.importorskip("moto.server")
    import boto3

    port = free_port()
    proc = serve_s3(port, subprocess.DEVNULL)
    yield (
        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1"),
        f"endpoint_override=127.0.0.1:{port}&scheme=http",
    )
    proc.terminate()
    proc.wait(10)


def _shards(url: str) -> list:
    from m2d_ray import storage
    from m2d_ray.distill.tokens import TokenShards

    shards = TokenShards(storage.fetch_dir(url))
    return [e["sha256"] for e in shards.manifest["shards"]] + [shards.manifest["valid"]["sha256"]]


def test_one_and_two_actors_write_identical_shards_and_s3_is_read_in_place(ray_address, tmp_path, s3):
    from m2d_ray.data.source import documents
    from m2d_ray.distill.data import packed_blocks
    from m2d_ray.models import default_teacher, load_tokenizer
    from m2d_ray.runtime.run_storage import RunStorage
    from m2d_ray.runtime.shards import tokens

    teacher = default_teacher()
    tok = load_tokenizer(teacher)
    pdir, _, order = write_corpus(tmp_path / "corpus", column="content")
    spec = f"{pdir}#column=content"
    cfg = dataclasses.replace(CFG, train_data=spec)
    ref = torch.stack([b for _, b in zip(range(cfg.blocks), packed_blocks(tok, documents(spec), cfg.seq_len))])
    assert ref.shape[0] == cfg.blocks

    urls = [
        tokens(RunStorage(str(tmp_path / f"store{n}")), teacher, tok, cfg, "synthetic:valid", actors=n)
        for n in (1, 2, 0)
    ]
    assert _shards(urls[0]) == _shards(urls[1]) == _shards(urls[2])  # 0: a small corpus, tokenised by the driver
    from m2d_ray import storage
    from m2d_ray.distill.tokens import TokenShards

    got = next(TokenShards(storage.fetch_dir(urls[0])).batches(cfg.blocks))
    assert torch.equal(got, ref)  # = the single-process stream, in document order

    client, query = s3
    for p in sorted(pdir.glob("*.parquet")):
        client.upload_file(str(p), BUCKET, f"shards/{p.name}")
    remote = dataclasses.replace(cfg, train_data=f"s3://{BUCKET}/shards/?{query}#column=content")
    store = RunStorage(str(tmp_path / "store-s3"))
    assert store.put_data(remote.train_data) == remote.train_data  # never copied
    url = tokens(store, teacher, tok, remote, "synthetic:valid", actors=2)
    assert _shards(url)[:-1] == _shards(urls[0])[:-1]
    assert not (tmp_path / "store-s3" / "data").exists()

    client.put_object(Bucket=BUCKET, Key="shards/part-001.parquet", Body=(pdir / "part-000.parquet").read_bytes())
    with pytest.raises(M2DError, match=r"changed since its tokens .*part-001.parquet (size|modified)"):
        tokens(store, teacher, tok, remote, "synthetic:valid", actors=2)


def test_a_corpus_shorter_than_the_budget_is_refused(ray_address, tmp_path):
    from m2d_ray.models import default_teacher, load_tokenizer
    from m2d_ray.runtime.run_storage import RunStorage
    from m2d_ray.runtime.shards import tokens

    teacher = default_teacher()
    pdir, _, _ = write_corpus(tmp_path / "corpus")
    cfg = dataclasses.replace(CFG, train_data=str(pdir), steps=10_000)
    with pytest.raises(M2DError, match=r"makes \d+ blocks of 64 tokens but the budget needs 40,000"):
        tokens(RunStorage(str(tmp_path / "store")), teacher, load_tokenizer(teacher), cfg, "synthetic:valid", actors=1)
    assert not any((tmp_path / "store").rglob("manifest.json"))


def test_a_crlf_text_corpus_on_s3_tokenised_by_an_actor_gives_the_lf_shards(
    ray_address, tmp_path, s3, byte_teacher_dir
):
    """Universal newlines in the tokens pass's Ray tasks too (issue 43): a byte-level tokenizer sees every \\r."""
    import gzip

    from m2d_ray.data.synthetic import corpus_text
    from m2d_ray.models import load_tokenizer
    from m2d_ray.runtime.run_storage import RunStorage
    from m2d_ray.runtime.shards import tokens

    teacher, text = str(byte_teacher_dir), corpus_text("train")[:8000]
    tok = load_tokenizer(teacher)
    (tmp_path / "lf.txt").write_bytes(text.encode())
    client, query = s3
    client.put_object(Bucket=BUCKET, Key="crlf/corpus.txt.gz", Body=gzip.compress(text.replace("\n", "\r\n").encode()))
    cfg = dataclasses.replace(CFG, train_data=str(tmp_path / "lf.txt"))
    lf = tokens(RunStorage(str(tmp_path / "store-lf")), teacher, tok, cfg, "synthetic:valid", actors=0)
    crlf = tokens(
        RunStorage(str(tmp_path / "store-crlf")),
        teacher,
        tok,
        dataclasses.replace(cfg, train_data=f"s3://{BUCKET}/crlf/corpus.txt.gz?{query}"),
        "synthetic:valid",
        actors=1,
    )
    assert _shards(crlf) == _shards(lf)
