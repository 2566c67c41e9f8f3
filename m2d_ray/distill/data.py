"""Training sequences for distillation: documents read (`data/source.py`), tokenised, joined with EOS and packed.

A train-data spec is any data spec (`m2d_ray.data.source`: fineweb-edu, hf:NAME, Parquet / JSON Lines /
text files, directories and globs, local or s3://, synthetic, wikitext).

The block stream is deterministic: global block g goes to rank g % world, and a run resumed at step s
skips exactly the blocks steps 0..s-1 consumed. Here (tokenised in the training process) finite sources
are cycled; a run tokenises once on Ray instead (`data/ray_tokens.py`, `distill/tokens.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from m2d_ray.data.ray_tokens import doc_ids, pack, short_corpus
from m2d_ray.data.source import check, documents, max_tokens
from m2d_ray.errors import M2DError


def check_source(spec: str, cfg=None) -> None:
    """Fail on the driver, with the data module's one-line message, before any worker starts: a spec that
    cannot be read, holds no document, or (given its DistillConfig) is shorter than the budget by its size."""
    src = check(spec, "training data")
    if next(documents(spec), None) is None:
        raise M2DError(f"training data {spec!r} holds no documents; give a corpus with text in it")
    bound = max_tokens(src) if cfg is not None else None
    if bound is not None and bound // cfg.seq_len * cfg.epochs < cfg.blocks:
        raise M2DError(short_corpus(spec, bound // cfg.seq_len, cfg.blocks, cfg.seq_len, cfg.epochs, bound=True))


def packed_blocks(tokenizer, docs: Iterable[str], seq_len: int) -> Iterator[Tensor]:
    """Concatenate tokenised documents (EOS after each) and cut the stream into [seq_len] blocks."""
    chunks = (doc_ids(tokenizer, [doc], tokenizer.eos_token_id) for doc in docs)
    return (torch.from_numpy(b) for b in pack(chunks, seq_len))


def global_blocks(tokenizer, spec: str, seq_len: int) -> Iterator[Tensor]:
    """The global block stream of a train-data spec, forever: finite sources are cycled (epochs)."""
    while True:
        n = 0
        for block in packed_blocks(tokenizer, documents(spec), seq_len):
            n += 1
            yield block
        if n == 0:
            raise M2DError(
                f"training data {spec!r} has fewer than seq_len={seq_len} tokens; give more text or a shorter seq_len"
            )


def train_batches(
    tokenizer, spec: str, seq_len: int, batch_size: int, rank: int = 0, world: int = 1, start_block: int = 0
) -> Iterator[Tensor]:
    """[batch_size, seq_len] batches of this rank's blocks, from global block `start_block` on, forever
    (tokenised here; a run reads the same batches from its token shards, distill/tokens.py)."""
    batch: list[Tensor] = []
    for g, block in enumerate(global_blocks(tokenizer, spec, seq_len)):
        if g < start_block or g % world != rank:
            continue
        batch.append(block)
        if len(batch) == batch_size:
            yield torch.stack(batch)
            batch = []
