"""Training sequences for distillation: documents streamed, tokenised, joined with EOS and packed.

A train-data spec is one of
* ``fineweb-edu`` – HuggingFaceFW/fineweb-edu (sample-10BT) streamed through `datasets` (the paper's data);
* ``hf:NAME[:CONFIG[:SPLIT]]`` – any hub dataset with a `text` column, streamed;
* a local ``.jsonl`` / ``.json`` (one object with `text` per line) or ``.parquet`` file (a `text` column),
  read in batches;
* anything `m2d_ray.data.text.load_text` reads (a text file, ``synthetic[:split]``, ``wikitext2[:split]``).

The block stream is deterministic: global block g goes to rank g % world, and a run resumed at step s
skips exactly the blocks steps 0..s-1 consumed. Finite sources are cycled (epochs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor

from m2d_ray.errors import M2DError

FINEWEB = ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train")


def check_source(spec: str) -> None:
    """Fail on the driver, with the data module's one-line message, before any worker starts."""
    if next(documents(spec), None) is None:
        raise M2DError(f"training data {spec!r} holds no documents")


def documents(spec: str) -> Iterator[str]:
    """The documents of a train-data spec, in a fixed order (see the module docstring)."""
    if spec == "fineweb-edu":
        yield from _hub(*FINEWEB)
        return
    if spec.startswith("hf:"):
        name, config, split = (spec[3:].split(":") + [None, None])[:3]
        yield from _hub(name, config, split or "train")
        return
    from m2d_ray.data.text import load_text, local_spec

    path = Path(local_spec(spec)).expanduser()
    if path.suffix in (".jsonl", ".json") and path.is_file():
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError):
                        raise M2DError(f"{path}:{n} is not a JSON object with a 'text' field") from None
        return
    if path.suffix == ".parquet" and path.is_file():
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            raise M2DError(f"{path} has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
        for batch in pf.iter_batches(columns=["text"], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if t)
        return
    yield load_text(spec)


def _hub(name: str, config: str | None, split: str) -> Iterator[str]:
    first = True
    try:
        import datasets

        rows = datasets.load_dataset(name, config, split=split, streaming=True)
        for row in rows:
            first = False
            yield row["text"]
    except M2DError:
        raise
    except Exception as exc:  # offline, unknown dataset, no text column ...
        if not first:
            raise
        raise M2DError(
            f"cannot stream {name} ({type(exc).__name__}); offline? pass a local text, .jsonl or .parquet file "
            "as the training data (e.g. --train-data ../shared/data/wikitext-2/wiki.valid.tokens or synthetic:train)"
        ) from None


def packed_blocks(tokenizer, docs: Iterable[str], seq_len: int) -> Iterator[Tensor]:
    """Concatenate tokenised documents (EOS between them) and cut the stream into [seq_len] blocks."""
    eos = tokenizer.eos_token_id
    buf: list[int] = []
    for doc in docs:
        buf.extend(tokenizer(doc, add_special_tokens=False, return_attention_mask=False)["input_ids"])
        if eos is not None:
            buf.append(eos)
        while len(buf) >= seq_len:
            yield torch.tensor(buf[:seq_len], dtype=torch.int64)
            del buf[:seq_len]


def global_blocks(tokenizer, spec: str, seq_len: int) -> Iterator[Tensor]:
    """The global block stream of a train-data spec, forever: finite sources are cycled (epochs)."""
    while True:
        n = 0
        for block in packed_blocks(tokenizer, documents(spec), seq_len):
            n += 1
            yield block
        if n == 0:
            raise M2DError(f"training data {spec!r} has fewer than seq_len={seq_len} tokens; give more text or a shorter seq_len")


def train_batches(tokenizer, spec: str, seq_len: int, batch_size: int, rank: int = 0, world: int = 1,
                  start_block: int = 0) -> Iterator[Tensor]:
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
