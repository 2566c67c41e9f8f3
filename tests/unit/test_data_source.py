"""The one data-spec grammar and reader (data/source.py): Parquet directories, JSON Lines (.gz / .zst) and
globs read in a fixed order, checks that name the bad file, fingerprints that name what changed, and a
driver-side corpus put in the run's storage once."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from corpora import DOCS, write_corpus

from m2d_ray.data import source
from m2d_ray.data.synthetic import build_tokenizer
from m2d_ray.data.text import load_text
from m2d_ray.errors import M2DError


def test_parquet_dir_jsonl_gz_and_glob_give_the_same_documents_in_order(tmp_path):
    pdir, jgz, order = write_corpus(tmp_path, column="content")
    by_dir = list(source.documents(f"{pdir}#column=content"))
    assert by_dir == order  # files sorted, rows in order, null / empty rows skipped, _SUCCESS ignored
    assert list(source.documents(f"{jgz}#column=content")) == order
    assert list(source.documents(f"{tmp_path}/parquet/part-00[12].parquet#column=content")) == order[len(DOCS[0::3]) :]
    assert load_text(f"{jgz}#column=content") == "\n\n".join(order)
    assert load_text(f"{jgz}#column=content", max_chars=1000) == "\n\n".join(order)[:1000]


def test_zstd_json_lines(tmp_path):
    path = tmp_path / "c.jsonl.zst"
    with pa.CompressedOutputStream(str(path), "zstd") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:5]).encode())
    assert list(source.documents(str(path))) == DOCS[:5]


def test_grammar():
    assert source.parse("wikitext103:train") == source.Source(
        "wikitext103:train", "wikitext", "wikitext", "wikitext-103-raw-v1", "train"
    )
    assert source.parse("wikitext2").config == "wikitext-2-raw-v1"
    assert source.parse("fineweb-edu").location == "HuggingFaceFW/fineweb-edu"
    hf = source.parse("hf:org/name:cfg#column=body")
    assert (hf.kind, hf.location, hf.config, hf.split, hf.column) == ("hf", "org/name", "cfg", "train", "body")
    s3 = source.parse("s3://bucket/corpus/*.parquet?endpoint_override=127.0.0.1:9000#column=content")
    assert (s3.kind, s3.location, s3.column) == (
        "files",
        "s3://bucket/corpus/*.parquet?endpoint_override=127.0.0.1:9000",
        "content",
    )
    for bad, msg in (
        ("wikitext103:dev", "unknown split"),
        ("hf:", "hf:NAME"),
        ("x.parquet#col=a", "column=NAME"),
        ("synthetic#column=a", "no columns"),
    ):
        with pytest.raises(M2DError, match=msg):
            source.parse(bad)


def test_bad_corpora_are_named_before_any_work(tmp_path):
    pdir, jgz, _ = write_corpus(tmp_path)
    with pytest.raises(M2DError, match=r"no file matches .*nothing/\*\.parquet"):
        source.check(str(tmp_path / "nothing" / "*.parquet"))
    with pytest.raises(M2DError, match=r"part-000.parquet has no column 'body' \(columns: text, n\)"):
        source.check(f"{pdir}#column=body")
    with pytest.raises(M2DError, match=r"corpus.jsonl.gz has no field 'body' \(fields: text, id\)"):
        source.check(f"{jgz}#column=body")
    data = (pdir / "part-001.parquet").read_bytes()
    (pdir / "part-001.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(M2DError, match="part-001.parquet is corrupt or unreadable"):
        source.check(str(pdir))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all" * 10)
    with pytest.raises(M2DError, match="bad.jsonl.gz is corrupt or unreadable"):
        source.check(str(tmp_path / "bad.jsonl.gz"))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "y"}\n')
    with pytest.raises(M2DError, match="mixes jsonl and text files"):
        source.check(str(tmp_path / "mixed"))


def test_size_bound_is_an_upper_bound_on_tokens(tmp_path):
    pdir, jgz, order = write_corpus(tmp_path)
    tok = build_tokenizer()
    tokens = sum(len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in order)
    bound = source.max_tokens(source.parse(str(pdir)))
    assert tokens <= bound < 20 * tokens
    assert source.max_tokens(source.parse(str(jgz))) is None  # compressed: unknown


def test_fingerprint_names_what_changed(tmp_path):
    pdir, _, _ = write_corpus(tmp_path)
    before = source.fingerprint(str(pdir))
    assert source.changes(before, source.fingerprint(str(pdir))) is None
    pq.write_table(pa.table({"text": ["another text"]}), pdir / "part-001.parquet")
    (pdir / "part-002.parquet").unlink()
    said = source.changes(before, source.fingerprint(str(pdir)))
    assert "part-002.parquet removed" in said and "part-001.parquet size" in said
    os.utime(pdir / "part-000.parquet", ns=(1, 1))
    assert "part-000.parquet modified" in source.changes(before, source.fingerprint(str(pdir)))


def test_a_driver_side_corpus_goes_to_storage_once_by_content(tmp_path):
    from m2d_ray.runtime.run_storage import RunStorage

    pdir, _, order = write_corpus(tmp_path, column="content")
    store = RunStorage(str(tmp_path / "storage"))
    url = store.put_data(f"{pdir}#column=content")
    assert url.startswith(str(tmp_path / "storage" / "data")) and url.endswith("#column=content")
    assert list(source.documents(url)) == order
    assert store.put_data(f"{tmp_path}/parquet/*.parquet#column=content") == url  # the same files: the same copy
    assert store.put_data("s3://bucket/corpus/") == "s3://bucket/corpus/"  # read in place
