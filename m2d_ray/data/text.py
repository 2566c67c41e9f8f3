"""Text sources for calibration and evaluation, and their tokenisation into fixed-length sequences.

A data spec is one of:
* ``wikitext2[:split]`` – WikiText-2 raw through `datasets.load_dataset("wikitext", "wikitext-2-raw-v1")`
  (split defaults to ``test``), the paper's perplexity set; needs the hub or a datasets cache.
* ``synthetic[:split]`` – the embedded multi-domain corpus (train / valid / test), always offline.
* a path to a local text file, or a storage URL (``s3://…``) of one: what Ray workers get
  (`stages.run_storage.RunStorage.put_data`), read through the node's cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from m2d_ray.errors import M2DError

#: calibration sets shorter than this cannot support statistics over E experts
MIN_CALIB_TOKENS = 64
DATASET_SPECS = ("wikitext2", "synthetic")


WIKITEXT_SPLITS = ("train", "validation", "test")
_SNIFF = 8192  # bytes read to tell text from binary


def check_spec(spec: str, what: str = "data") -> None:
    """Validate a data spec without loading it: a known dataset split, or a readable text file."""
    from m2d_ray import storage
    from m2d_ray.data.synthetic import SPLITS

    if storage.is_remote(spec):
        return  # a file the driver checked and put in the run's storage
    name, sep, split = str(spec).partition(":")
    for dataset, splits in (("synthetic", SPLITS), ("wikitext2", WIKITEXT_SPLITS)):
        if name == dataset:
            if sep and split not in splits:
                raise M2DError(f"{what} {spec!r}: unknown split {split!r}; use {dataset}:" + f" or {dataset}:".join(splits))
            return
    path = Path(spec).expanduser()
    if not path.exists():
        raise M2DError(f"{what} {spec!r} is neither a file nor one of {', '.join(DATASET_SPECS)}; give an existing text file")
    if path.is_dir():
        raise M2DError(f"{what} {spec!r} is a directory; give a text file")
    try:
        with path.open("rb") as f:
            head = f.read(_SNIFF)
    except OSError as exc:
        raise M2DError(f"{what} {spec!r} cannot be read ({exc.strerror}); give a readable text file") from None
    if b"\0" in head or _undecodable(head):
        raise M2DError(f"{what} {spec!r} is not a UTF-8 text file (binary content); give plain text")


def _undecodable(head: bytes) -> bool:
    """More than 1% of the first bytes not UTF-8 (a cut multi-byte character at the end is fine)."""
    text = head.decode("utf-8", errors="replace")
    return text.count("\ufffd") > max(3, len(text) // 100)


def local_spec(spec: str) -> str:
    """A spec this process can open: a storage URL becomes its copy in the node's cache."""
    from m2d_ray import storage

    return str(storage.fetch_file(spec)) if storage.is_remote(spec) else spec


def load_text(spec: str) -> str:
    """Resolve a data spec to raw text (see module docstring)."""
    spec = local_spec(spec)
    check_spec(spec)
    name, _, split = str(spec).partition(":")
    if name == "synthetic":
        from m2d_ray.data.synthetic import corpus_text

        return corpus_text(split or "test")
    if name == "wikitext2":
        return _wikitext2(split or "test")
    return Path(spec).expanduser().read_text(encoding="utf-8", errors="replace")


def _wikitext2(split: str) -> str:
    try:
        import datasets

        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
    except Exception as exc:  # offline, no cache, bad split …
        raise M2DError(
            f"could not load WikiText-2 ({split}) through datasets ({type(exc).__name__}); offline? "
            "pass a local file such as ../shared/data/wikitext-2/wiki.test.raw, or synthetic"
        ) from None
    return "".join(rows["text"])


@dataclass(frozen=True)
class TokenSet:
    """Token sequences [n, L] with an attention mask (0 = padding), plus a fingerprint."""

    ids: Tensor
    mask: Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    def sha256(self) -> str:
        h = hashlib.sha256(self.ids[self.mask.bool()].to(torch.int64).numpy().tobytes())
        return h.hexdigest()


def tokenize(tokenizer, text: str, max_tokens: int | None = None, max_chars: int | None = None) -> Tensor:
    """Token ids of `text` (optionally truncated), as one flat int64 tensor."""
    if max_chars is not None:
        text = text[:max_chars]
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.int64)
    return ids[:max_tokens] if max_tokens is not None else ids


def calibration_set(tokenizer, text: str, seq_len: int, max_tokens: int | None, pad_id: int = 0) -> TokenSet:
    """Pack text into sequences of `seq_len`; the last one is right-padded and masked.

    Raises M2DError for empty or too-short text (fewer than MIN_CALIB_TOKENS tokens).
    """
    if not text.strip():
        raise M2DError("calibration text is empty; give a file with text in it")
    ids = tokenize(tokenizer, text, max_tokens=max_tokens)
    if ids.numel() < MIN_CALIB_TOKENS:
        raise M2DError(
            f"calibration text has {ids.numel()} tokens; need at least {MIN_CALIB_TOKENS} (give more text)"
        )
    n = -(-ids.numel() // seq_len)
    padded = torch.full((n * seq_len,), pad_id, dtype=torch.int64)
    padded[: ids.numel()] = ids
    mask = torch.zeros(n * seq_len, dtype=torch.int64)
    mask[: ids.numel()] = 1
    return TokenSet(ids=padded.view(n, seq_len), mask=mask.view(n, seq_len))
