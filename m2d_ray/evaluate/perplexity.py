"""Perplexity over fixed-length, non-overlapping windows.

Protocol (matches ../shared/teachers/*/eval.json): the text (optionally its first `max_chars`
characters) is tokenised once; the tokens are cut into consecutive windows of `seq_len`; each window
is scored independently (no context carried over) and the perplexity is exp of the mean token
cross-entropy over all predicted positions (seq_len - 1 per window). A trailing remainder shorter
than 2 tokens is dropped; a shorter last window is scored with its padding masked.
A non-finite loss is reported as `diverged`, never raised.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from m2d_ray import console
from m2d_ray.config import EvalConfig
from m2d_ray.errors import M2DError
from m2d_ray.numerics import logits

EVAL_MAX_CHARS = EvalConfig.max_chars  # the protocol: the first 300,000 characters of the evaluation text


@dataclass(frozen=True)
class Perplexity:
    ppl: float  # inf when diverged
    nll: float  # mean cross-entropy (nats/token)
    tokens: int  # predicted positions
    windows: int
    diverged: bool

    def to_json(self) -> dict:
        d = asdict(self)
        d["ppl"] = None if self.diverged else self.ppl
        return d


def windows(ids: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """[n, seq_len] windows and mask of a flat token tensor (the last one padded)."""
    n_full, rest = divmod(ids.numel(), seq_len)
    n = n_full + (1 if rest >= 2 else 0)
    if n == 0:
        raise M2DError(f"evaluation text has {ids.numel()} tokens; need at least 2")
    out = torch.zeros(n, seq_len, dtype=torch.int64)
    mask = torch.zeros(n, seq_len, dtype=torch.int64)
    used = min(ids.numel(), n * seq_len)
    out.view(-1)[:used] = ids[:used]
    mask.view(-1)[:used] = 1
    return out, mask


@torch.no_grad()
def window_nll(model, ids: Tensor, mask: Tensor, chunk: int = 1024) -> tuple[float, int]:
    """Summed next-token cross-entropy (float64) and number of predicted positions of a batch.

    Logits are formed from the final hidden states `chunk` positions at a time, so a [tokens x vocab]
    tensor is never held whole (a Qwen3 vocabulary is 151,936 wide).
    """
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    h = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    w = model.get_output_embeddings().weight
    if h.device != device or w.device != device:  # spread over devices (evaluate/spread.py): the head's device
        h, ids, mask = h.to(w.device), ids.to(w.device), mask.to(w.device)
    valid = mask[:, 1:].bool() & mask[:, :-1].bool()
    h, target = h[valid], ids[:, 1:][valid]
    total = 0.0
    for s in range(0, h.shape[0], chunk):
        z = logits(h[s : s + chunk], w)  # float32, not rounded to the model's dtype first
        total += float(F.cross_entropy(z, target[s : s + chunk], reduction="sum").double())
    return total, int(valid.sum())


def perplexity_batches(
    model,
    ids: Tensor,
    seq_len: int = EvalConfig.seq_len,
    batch_size: int = EvalConfig.batch_size,
    progress: bool = False,
):
    """Yield the running Perplexity after each batch of windows (for chunked early stopping)."""
    w, m = windows(ids, seq_len)
    total, count = 0.0, 0
    starts = range(0, w.shape[0], batch_size)
    for start in console.progress(starts, len(starts), "perplexity", "batch") if progress else starts:
        s, c = window_nll(model, w[start : start + batch_size], m[start : start + batch_size])
        total, count = total + s, count + c
        yield _result(total, count, min(start + batch_size, w.shape[0]))


def perplexity(
    model,
    ids: Tensor,
    seq_len: int = EvalConfig.seq_len,
    batch_size: int = EvalConfig.batch_size,
    progress: bool = False,
) -> Perplexity:
    result = None
    for result in perplexity_batches(model, ids, seq_len, batch_size, progress):
        if result.diverged:
            break
    return result


def _result(total: float, count: int, n_windows: int) -> Perplexity:
    nll = total / max(count, 1)
    finite = math.isfinite(nll)
    ppl = math.exp(nll) if finite and nll < 700 else math.inf
    return Perplexity(ppl=ppl, nll=nll, tokens=count, windows=n_windows, diverged=not math.isfinite(ppl))
