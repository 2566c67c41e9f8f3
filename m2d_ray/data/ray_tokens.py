"""The distillation stream tokenised by Ray Data: a spec's documents read by Ray tasks (one per file, in
batches, `source.part_documents`), tokenised in batches by an actor pool on the cluster's CPUs, and packed
in order into [seq_len] blocks by the consumer.

Ray Data keeps the documents' order (`preserve_order`), so the blocks are the same for any number of
actors or nodes, and equal to `pack(doc_ids(...))` of `source.documents` on one process. The consumer stops
reading once it has the blocks it needs (a 10 TB corpus is not read whole), and Ray Data's streaming
executor holds a bounded number of batches in flight, so memory does not grow with the corpus.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import torch

from m2d_ray import storage
from m2d_ray.data import source
from m2d_ray.errors import M2DError
from m2d_ray.models import load_tokenizer

# Imported inside functions: Ray (`m2d plan` and the checks read this module without importing it).

BYTES_PER_ACTOR = 64 << 20  # a smaller corpus does not pay for more actors
TOKENIZE_BATCH = 256  # documents per tokenizer call
BLOCK_BYTES = 8 << 20  # Ray Data block size of the pass (default 128 MiB): what a worker holds at once


def doc_ids(tokenizer, docs: Sequence[str], eos: int | None) -> np.ndarray:
    """The token ids of documents, each followed by EOS, concatenated (int64)."""
    lists = tokenizer(list(docs), add_special_tokens=False, return_attention_mask=False)["input_ids"]
    if eos is not None:
        lists = [ids + [eos] for ids in lists]
    return np.fromiter((t for ids in lists for t in ids), dtype=np.int64)


def pack(chunks: Iterable[np.ndarray], seq_len: int) -> Iterator[np.ndarray]:
    """Cut a stream of token arrays into consecutive [seq_len] blocks (the remainder at the end is dropped)."""
    buf = np.empty(0, dtype=np.int64)
    for chunk in chunks:
        buf = np.concatenate([buf, chunk]) if buf.size else np.asarray(chunk, dtype=np.int64)
        n = buf.size // seq_len
        for i in range(n):
            yield buf[i * seq_len : (i + 1) * seq_len].copy()
        buf = buf[n * seq_len :]


def _read(batch: dict) -> Iterator[dict]:
    """Ray task: the documents of one part (a file, or a dataset's one stream), in batches."""
    spec, url = str(batch["spec"][0]), str(batch["url"][0])
    src = source.parse(spec)
    part = source.CorpusFile(url, int(batch["size"][0]), int(batch["mtime_ns"][0])) if url else None
    for docs in source.part_documents(src, part):
        yield {"text": np.array(docs, dtype=object)}


class _Tokenize:
    """Ray Data actor: a batch of documents -> one row holding their ids (each followed by EOS), concatenated."""

    def __init__(self, model: str) -> None:

        torch.set_num_threads(1)
        self.tokenizer = load_tokenizer(storage.local_model(model))

    def __call__(self, batch: dict):

        ids = doc_ids(self.tokenizer, [str(t) for t in batch["text"]], self.tokenizer.eos_token_id)
        return pa.table({"ids": pa.array([ids.astype(np.int32)], type=pa.list_(pa.int32()))})


def actors_for(spec: str, cpus: int) -> int:
    """Actors worth starting: one per 64 MiB of corpus files, at most the cluster's CPUs (all for a streamed
    dataset); 0 for a corpus smaller than that (one document, or files under 64 MiB), which the caller
    tokenises itself: Ray Data's start-up (~10 s) would cost more than the work."""
    src = source.parse(spec)
    if src.one_document:
        return 0
    if src.kind != "files":
        return max(1, cpus)
    size = sum(f.size for f in source.files(src))
    return 0 if size < BYTES_PER_ACTOR else max(1, min(cpus, -(-size // BYTES_PER_ACTOR)))


def _local_chunks(spec: str, tokenizer) -> Iterator[np.ndarray]:
    """The spec's token ids (EOS after each document) in document order, tokenised in this process."""
    src = source.parse(spec)
    for part in source.parts(src):
        for docs in source.part_documents(src, part):
            yield doc_ids(tokenizer, docs, tokenizer.eos_token_id)


def _token_chunks(spec: str, model: str, actors: int) -> Iterator[np.ndarray]:
    """The spec's token ids (EOS after each document) in document order, tokenised by `actors` Ray actors."""
    import ray.data

    src = source.parse(spec)
    parts = source.parts(src)
    rows = [
        {"spec": spec, "url": p.url if p else "", "size": p.size if p else 0, "mtime_ns": p.mtime_ns if p else 0}
        for p in parts
    ]
    # blocks in document order, whatever finishes first; an actor's output leaves it in small blocks, not one per file
    with in_order(block_bytes=BLOCK_BYTES):
        ds = ray.data.from_items(rows, override_num_blocks=len(rows))
        ds = ds.map_batches(_read, batch_size=1, num_cpus=1)
        ds = ds.map_batches(
            _Tokenize,
            batch_size=TOKENIZE_BATCH,
            num_cpus=1,
            fn_constructor_kwargs={"model": model},
            compute=ray.data.ActorPoolStrategy(size=actors),
        )
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for ids in batch.column("ids").chunks:
                yield ids.values.to_numpy().astype(np.int64)


@contextlib.contextmanager
def in_order(block_bytes: int | None = None) -> Iterator[None]:
    """Ray Data passes started inside yield their blocks in their input's order, whatever finishes first (the same
    tokens, or the same float64 sums in the same order, for any number of actors or nodes); `block_bytes`: the
    largest block an operator emits."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    before = ctx.execution_options.preserve_order, ctx.target_max_block_size
    ctx.execution_options.preserve_order = True
    ctx.target_max_block_size = block_bytes or ctx.target_max_block_size
    try:
        yield
    finally:
        ctx.execution_options.preserve_order, ctx.target_max_block_size = before


def token_blocks(
    spec: str, model: str, seq_len: int, blocks: int, actors: int, epochs: int = 1, tokenizer=None
) -> Iterator[np.ndarray]:
    """The first `blocks` [seq_len] blocks of `spec` tokenised by `model`'s tokenizer on `actors` Ray Data actors
    (0: here, by `tokenizer`, the same), the corpus read again from its start at most `epochs` times; a corpus
    that holds fewer is refused, saying how many blocks it makes."""
    made = per_pass = 0
    for _ in range(epochs):
        per_pass = 0
        chunks = _token_chunks(spec, model, actors) if actors > 0 else _local_chunks(spec, tokenizer)
        for block in pack(chunks, seq_len):
            yield block
            made, per_pass = made + 1, per_pass + 1
            if made == blocks:
                return
        if per_pass == 0:
            break
    raise M2DError(short_corpus(spec, per_pass, blocks, seq_len, epochs))


def short_corpus(spec: str, per_pass: int, blocks: int, seq_len: int, epochs: int, bound: bool = False) -> str:
    """The one line of a corpus shorter than the budget (`bound`: `per_pass` is an upper bound from its size)."""
    have = f"{'at most ' if bound else ''}{per_pass:,} blocks of {seq_len} tokens" + (" per pass" if epochs > 1 else "")
    return (
        f"training data {spec!r} makes {have} but the budget needs {blocks:,} (steps x batch_size x grad_accum x "
        "workers"
        f"{f', over {epochs} passes' if epochs > 1 else ''}); give more text, fewer distill.steps or more "
        "distill.epochs"
    )
