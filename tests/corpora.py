"""Corpus files written by tests: the embedded corpus' documents as a Parquet directory and a .jsonl.gz."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq

from m2d_ray.data.synthetic import corpus_text

DOCS = [d for d in corpus_text("train").split("\n\n") if d.strip()][:300]


def write_corpus(root, docs=DOCS, files=3, column="text"):
    """`docs` as a Parquet directory (round-robin over `files` shards, several row groups each) and as one
    .jsonl.gz; returns (parquet dir, jsonl.gz path, the documents in the corpus's order)."""
    pdir = root / "parquet"
    pdir.mkdir(parents=True)
    shards = [docs[i::files] for i in range(files)]
    for i, part in enumerate(shards):
        pq.write_table(
            pa.table({column: part + [None, ""], "n": list(range(len(part) + 2))}),
            pdir / f"part-{i:03d}.parquet",
            row_group_size=40,
        )
    (pdir / "_SUCCESS").write_text("")
    order = [d for part in shards for d in part]
    jgz = root / "corpus.jsonl.gz"
    with gzip.open(jgz, "wt", encoding="utf-8") as f:
        for d in order:
            f.write(json.dumps({column: d, "id": 1}) + "\n")
    return pdir, jgz, order
