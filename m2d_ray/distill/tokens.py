"""The distillation token stream, tokenised once: packed [seq_len] blocks in shards, plus the validation ids.

    DIR/manifest.json          tokenizer fingerprint, source, corpus (its files' names, sizes, mtimes: data/source.py),
                               seq_len, blocks, shards [{file, first_block, blocks, sha256}], validation {file,
                               tokens, sha256}; written last
    DIR/tokens-00000.safetensors  "tokens" [blocks, seq_len] int32, global blocks first_block.. in stream order
    DIR/valid.safetensors      "ids" [n] int32: the validation text's first eval_max_tokens tokens

The order is `data.train_batches`' (global block g goes to rank g % world), so a run reads the same
blocks from shards as it would have tokenised itself; a rank reads only the shards that hold its
blocks, one shard ahead on a background thread (pinned on CUDA), and a resume seeks straight to its
block. Every shard's sha256 is checked when it is read: a truncated or damaged shard is named.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import Tensor

from m2d_ray.artifacts import (
    sha256_bytes,
    sha256_file,
    write_json_atomic,
    write_text_atomic,
)
from m2d_ray.data.text import load_text, tokenize
from m2d_ray.distill.data import global_blocks
from m2d_ray.distill.targets import ShardEntry
from m2d_ray.errors import M2DError

MANIFEST = "manifest.json"
VALID_FILE = "valid.safetensors"
SHARD_BLOCKS = 1024  # blocks per shard: 16 MiB of int32 at seq_len 4096


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary and special tokens (what decides the ids)."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = [tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id]
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()


def _save(tensors: dict[str, Tensor], path: Path) -> str:
    """Write a safetensors file atomically; returns its sha256."""
    data = save(tensors)
    write_text_atomic(path, data)
    return sha256_bytes(data)


def write_tokens(
    out: Path,
    tokenizer,
    source: str,
    seq_len: int,
    blocks: int,
    valid: str,
    valid_max_tokens: int | None,
    shard_blocks: int = SHARD_BLOCKS,
    stream: Iterable | None = None,
    corpus: dict | None = None,
) -> dict:
    """Write `blocks` global blocks of `source` and the validation text's ids into `out`; returns the manifest.
    `stream`: the blocks (a run's, tokenised by Ray Data: data/ray_tokens.py); None = tokenised here, cycled.
    `corpus`: the source's fingerprint (data.source.fingerprint), recorded in the manifest."""

    out.mkdir(parents=True, exist_ok=True)
    shards, first = [], 0
    stream = iter(stream) if stream is not None else global_blocks(tokenizer, source, seq_len)
    while first < blocks:
        n = min(shard_blocks, blocks - first)
        rows = torch.stack([torch.as_tensor(next(stream)) for _ in range(n)]).to(torch.int32)
        name = f"tokens-{len(shards):05d}.safetensors"
        shards.append(vars(ShardEntry(name, first, n, _save({"tokens": rows}, out / name))))
        first += n
    ids = tokenize(tokenizer, load_text(valid, max_tokens=valid_max_tokens), max_tokens=valid_max_tokens).to(
        torch.int32
    )
    manifest = {
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "source": source,
        "corpus": corpus,
        "valid_source": valid,
        "seq_len": seq_len,
        "blocks": blocks,
        "shards": shards,
        "valid": {"file": VALID_FILE, "tokens": int(ids.numel()), "sha256": _save({"ids": ids}, out / VALID_FILE)},
    }
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def manifest_sha256(manifest: dict) -> str:
    """The identity of a token set (for the targets made from it)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class TokenShards:
    """A token directory on this node (`storage.fetch_dir` of the run's copy)."""

    dir: Path

    @property
    def manifest(self) -> dict:
        return json.loads((self.dir / MANIFEST).read_text())

    def _read(self, entry: dict, key: str) -> Tensor:
        path = self.dir / entry["file"]
        actual = sha256_file(path) if path.exists() else "missing"
        if actual != entry["sha256"]:
            raise M2DError(
                f"token shard {path} is damaged (sha256 {actual[:16]}, expected {entry['sha256'][:16]}); "
                "delete the token directory to tokenise again"
            )
        return load_file(str(path))[key]

    def check(self, tokenizer, seq_len: int, source: str) -> None:
        """These tokens were made by this tokenizer, at this seq_len, from this source (else one line)."""
        m = self.manifest
        for what, mine, theirs in (
            ("tokenizer", tokenizer_fingerprint(tokenizer), m["tokenizer"]),
            ("seq_len", seq_len, m["seq_len"]),
            ("source", source, m["source"]),
        ):
            if mine != theirs:
                raise M2DError(
                    f"tokens in {self.dir} were made with another {what} ({str(theirs)[:60]}, not {str(mine)[:60]}); "
                    "use a new storage path or delete that directory"
                )

    def rows(self, entry: ShardEntry) -> Tensor:
        """The [blocks, seq_len] int64 token rows of one shard (checked)."""
        return self._read(vars(entry), "tokens").to(torch.int64)

    def valid_ids(self) -> Tensor:
        return self._read(self.manifest["valid"], "ids").to(torch.int64)

    def batches(
        self, batch_size: int, rank: int = 0, world: int = 1, start_block: int = 0, pin: bool = False
    ) -> Iterator[Tensor]:
        """[batch_size, seq_len] int64 batches of this rank's blocks from global block `start_block` on, in
        `train_batches`' order (see `rank_batches`)."""
        entries = [ShardEntry(**e) for e in self.manifest["shards"]]
        for b in rank_batches(entries, lambda e: {"ids": self.rows(e)}, batch_size, rank, world, start_block, pin):
            yield b["ids"]


def rank_batches(
    shards: Sequence[ShardEntry],
    read: Callable[[ShardEntry], dict[str, Tensor]],
    batch_size: int,
    rank: int = 0,
    world: int = 1,
    start_block: int = 0,
    pin: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Batches of the rows of this rank's global blocks (g % world == rank) from `start_block` on, each a dict
    of [batch_size, ...] tensors stacked from `read(shard)` (rows = blocks); only the shards holding this
    rank's blocks are read, the next one on a background thread (pinned for CUDA). Past the last stored
    block the blocks are read again from block 0. Token and target shards go through the same order."""
    total = sum(s.blocks for s in shards)
    first = start_block + (rank - start_block) % world  # this rank's first block at or after start_block

    def wanted() -> Iterator[tuple[ShardEntry, Tensor]]:
        g = first
        while True:
            s = next(e for e in shards if e.first_block <= g % total < e.first_block + e.blocks)
            pos = torch.arange(g % total - s.first_block, s.blocks, world)
            yield s, pos
            g += world * len(pos)

    def load(item: tuple[ShardEntry, Tensor]) -> dict[str, Tensor]:
        rows = {k: v[item[1]] for k, v in read(item[0]).items()}
        return {k: v.pin_memory() for k, v in rows.items()} if pin else rows

    pending: list[dict[str, Tensor]] = []
    for rows in _prefetched(map(load, wanted())):
        n = len(next(iter(rows.values())))
        pending.extend({k: v[i] for k, v in rows.items()} for i in range(n))
        while len(pending) >= batch_size:
            yield {k: torch.stack([r[k] for r in pending[:batch_size]]) for k in pending[0]}
            del pending[:batch_size]


def _prefetched(items: Iterator[Tensor], depth: int = 1) -> Iterator[Tensor]:
    """`items`, produced `depth` ahead on a daemon thread (shard reads overlap training)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for x in items:
                while not stop.is_set():
                    try:
                        q.put(x, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer
            q.put(exc)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while True:
            x = q.get()
            if isinstance(x, BaseException):
                raise x
            yield x
    finally:  # the consumer stopped: the producer ends at its next item (never left running into shutdown)
        stop.set()
        while thread.is_alive():
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
