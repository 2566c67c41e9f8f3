"""A text file's line endings do not change what a run computes (issue 43): text files are read with universal
newlines (`\\r\\n` and a lone `\\r` become `\\n`, as Python's text mode), by every reader (calibration, perplexity,
the d2d search, the token shards, the tokens pass's actors, stage 3's text:PATH suite); JSON Lines and Parquet
values stay as stored; the fingerprint of a file is what it was (its stat), so resumable runs stay resumable.

The teacher here has a byte-level tokenizer (`byte_teacher_dir`): it sees `\\r`, so every test below fails when a
reader keeps it."""

from __future__ import annotations

import gzip
import io
import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from m2d_ray.data import source
from m2d_ray.data.synthetic import corpus_text
from m2d_ray.data.text import load_text, tokenize

LF = corpus_text("valid")[:1500]  # documents separated by blank lines: ~1,500 byte tokens
ENDINGS = {"crlf": "\r\n", "cr": "\r"}


def write(path, text: str, newline: str = "\n") -> str:
    """`text` with `newline` line endings at `path`, compressed as its suffix says; returns the path as a spec."""
    raw = text.replace("\n", newline).encode()
    if path.suffix == ".zst":
        with pa.CompressedOutputStream(str(path), "zstd") as f:
            f.write(raw)
    else:
        path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return str(path)


def copies(tmp_path, text: str = LF, name: str = "corpus.txt") -> dict[str, str]:
    """Specs of an LF, a CRLF and a lone-CR copy of `text`."""
    out = {}
    for key, nl in {"lf": "\n", **ENDINGS}.items():
        (tmp_path / key).mkdir(exist_ok=True)
        out[key] = write(tmp_path / key / name, text, nl)
    return out


def test_decode_is_pythons_text_mode():
    rng = random.Random(0)
    pieces = [b"a", b" ", b"\r", b"\n", b"\r\n", b"\xe2\x82\xac", b"\xe2", b"\xff", b"\x85"]
    for _ in range(500):
        raw = b"".join(rng.choices(pieces, k=rng.randint(0, 30)))
        expected = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="replace").read()
        assert source.decode(raw) == expected, raw


@pytest.mark.parametrize("name", ["corpus.txt", "corpus.txt.gz", "corpus.txt.zst"])
def test_text_files_read_with_universal_newlines(tmp_path, name):
    specs = copies(tmp_path, name=name)
    assert list(source.documents(specs["lf"])) == [LF]
    for key in ENDINGS:
        assert list(source.documents(specs[key])) == [LF], key
        assert load_text(specs[key], max_chars=700) == LF[:700]
        assert list(source.documents(str(tmp_path / key))) == [LF]  # a directory of text files


def test_json_lines_and_parquet_values_are_left_as_stored(tmp_path):
    values = ["one\r\ntwo", "three\rfour", "five\nsix"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_bytes("".join(json.dumps({"text": v}) + "\r\n" for v in values).encode())  # CRLF between objects
    assert list(source.documents(str(jsonl))) == values
    pq.write_table(pa.table({"text": values}), tmp_path / "c.parquet")
    assert list(source.documents(str(tmp_path / "c.parquet"))) == values


def test_the_fingerprint_of_a_text_file_is_its_stat(tmp_path):
    """What a run recorded before the fix is what it computes now: names, sizes and mtimes, not the decoded text."""
    specs = copies(tmp_path)
    for key, spec in specs.items():
        st = os.stat(spec)
        assert source.fingerprint(spec) == {
            "spec": spec,
            "column": "text",
            "files": [[spec, st.st_size, st.st_mtime_ns]],
        }, key
    assert os.stat(specs["crlf"]).st_size == os.stat(specs["lf"]).st_size + LF.count("\n")


@pytest.fixture(scope="module")
def byte_teacher(byte_teacher_dir):
    from m2d_ray.models import load_teacher

    return load_teacher(str(byte_teacher_dir))


def test_line_endings_change_no_tokens_statistics_or_perplexity(byte_teacher, tmp_path):
    from m2d_ray.calibrate import calibrate
    from m2d_ray.calibrate.tokens import calibration_tokens
    from m2d_ray.commands.convert import evaluate_ppl
    from m2d_ray.prune.data import load_tokens

    tok, name = byte_teacher.tokenizer, byte_teacher.name
    assert not torch.equal(tokenize(tok, LF), tokenize(tok, LF.replace("\n", "\r\n")))  # the tokenizer sees \r
    specs = copies(tmp_path)

    def results(spec: str) -> tuple:
        _, calib = calibration_tokens(tok, spec, name, seq_len=64, max_tokens=512)
        stats, _ = calibrate(byte_teacher, calib, spec, progress=False)
        ppl = evaluate_ppl(byte_teacher.model, tok, spec, seq_len=64)
        _, prune_calib, prune_eval = load_tokens(
            name, tok, spec, spec, 64, 512, max_chars=1000
        )  # the d2d search's data
        return calib, stats.layers, ppl, prune_calib, prune_eval

    ref = results(specs["lf"])
    for key in ENDINGS:
        calib, layers, ppl, prune_calib, prune_eval = results(specs[key])
        assert calib.sha256() == ref[0].sha256() and calib.n_tokens == ref[0].n_tokens == 512, key
        for i, st in layers.items():
            for k, t in st.to_tensors("").items():
                assert torch.equal(t, ref[1][i].to_tensors("")[k]), (key, i, k)
        assert (ppl.ppl, ppl.tokens) == (ref[2].ppl, ref[2].tokens), key
        assert prune_calib.sha256() == ref[3].sha256() and torch.equal(prune_eval, ref[4]), key


def test_line_endings_change_no_token_shards(byte_teacher, tmp_path):
    from m2d_ray.data import ray_tokens
    from m2d_ray.distill.tokens import write_tokens

    specs = copies(tmp_path, name="corpus.txt.gz")

    def shards(key: str) -> list[str]:
        m = write_tokens(
            tmp_path / f"tokens-{key}",
            byte_teacher.tokenizer,
            specs[key],
            seq_len=64,
            blocks=8,
            valid=specs[key],
            valid_max_tokens=256,
        )
        return [s["sha256"] for s in m["shards"]] + [m["valid"]["sha256"]]

    def actors(key: str) -> np.ndarray:
        """What the tokens pass's Ray tasks and actors compute (ray_tokens._read, _Tokenize), in this process."""
        f = source.files(source.parse(specs[key]))[0]
        row = {
            "spec": np.array([specs[key]]),
            "url": np.array([f.url]),
            "size": np.array([f.size]),
            "mtime_ns": np.array([f.mtime_ns]),
        }
        out = [ray_tokens._Tokenize(byte_teacher.name)(b) for b in ray_tokens._read(row)]
        return np.concatenate([t.column("ids").to_numpy(zero_copy_only=False)[0] for t in out])

    ref, ref_ids = shards("lf"), actors("lf")
    for key in ENDINGS:
        assert shards(key) == ref, key
        assert np.array_equal(actors(key), ref_ids), key


def test_the_text_suite_does_not_depend_on_line_endings(tmp_path):
    from m2d_ray.evaluate.local_tasks import text_rows

    specs = copies(tmp_path, text=corpus_text("test"))
    ref = text_rows(specs["lf"], n_test=40, n_fewshot=5)
    assert len(ref["test"]) == 40
    for key in ENDINGS:
        assert text_rows(specs[key], n_test=40, n_fewshot=5) == ref, key
