"""The text of a data spec (`data/source.py`: the one grammar and reader) and its tokenisation into
fixed-length sequences, for calibration, evaluation and validation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from m2d_ray.data import source
from m2d_ray.errors import M2DError

#: calibration sets shorter than this cannot support statistics over E experts
MIN_CALIB_TOKENS = 64
#: characters read per token wanted: a prefix this long tokenises to the same first tokens as the whole text
CHARS_PER_TOKEN = 64


def check_spec(spec: str, what: str = "data") -> None:
    """Validate a data spec before any work: a known dataset split, files that match and can be read."""
    source.check(spec, what)


def load_text(spec: str, max_chars: int | None = None, max_tokens: int | None = None) -> str:
    """The text of a data spec, read only as far as `max_chars` characters or `max_tokens` tokens need."""
    limits = [n for n in (max_chars, max_tokens and max_tokens * CHARS_PER_TOKEN) if n]
    return source.read_text(spec, min(limits) if limits else None)


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
        raise M2DError(f"calibration text has {ids.numel()} tokens; need at least {MIN_CALIB_TOKENS} (give more text)")
    n = -(-ids.numel() // seq_len)
    padded = torch.full((n * seq_len,), pad_id, dtype=torch.int64)
    padded[: ids.numel()] = ids
    mask = torch.zeros(n * seq_len, dtype=torch.int64)
    mask[: ids.numel()] = 1
    return TokenSet(ids=padded.view(n, seq_len), mask=mask.view(n, seq_len))
