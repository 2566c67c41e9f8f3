"""One stage-1 trial as a plain function: plan -> dense student -> perplexity in chunks.

No Ray here: `run_trial` yields one metrics dict per chunk, the Tune trainable (stage1.py) only
forwards them with `tune.report`, and tests can call it directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from m2d_ray.config import EvalConfig
from m2d_ray.convert.build import build_from_plan
from m2d_ray.convert.plan import ConversionPlan
from m2d_ray.evaluate.perplexity import perplexity_batches, windows
from m2d_ray.evaluate.spread import spread


class InjectedFault(RuntimeError):
    """Raised by a trial listed in `faults.raise_in` (fault drills)."""


def chunk_ends(n_batches: int, chunks: int) -> set[int]:
    """Batch indices (1-based counts) after which a partial perplexity is reported."""
    chunks = max(1, min(chunks, n_batches))
    return {math.ceil(n_batches * (c + 1) / chunks) for c in range(chunks)}


def run_trial(
    teacher,
    plan: ConversionPlan,
    eval_ids: Tensor,
    cfg: EvalConfig,
    poison: bool = False,
    device: str = "cpu",
    devices: int = 1,
) -> Iterator[dict]:
    """Build the student of `plan` and yield {"chunk", "ppl", "nll", "tokens", "final", "diverged"}.

    The last dict has final=True; a non-finite partial perplexity ends the trial as diverged. `devices` > 1: the
    student is spread over that many devices of `device`'s kind, its layers in order (a trial given several whole GPUs
    because one cannot hold its student: evaluate/spread.py).
    """
    student = build_from_plan(teacher, plan)
    if devices > 1:
        spread(student, [f"cuda:{i}" if device == "cuda" else device for i in range(devices)])
    else:
        student = student.to(device)
    if poison:  # fault drill: a NaN weight, so the real evaluation path produces a NaN loss
        with torch.no_grad():
            next(p for n, p in student.named_parameters() if "mlp" in n).view(-1)[0] = float("nan")
    n_windows = windows(eval_ids, cfg.seq_len)[0].shape[0]
    n_batches = math.ceil(n_windows / cfg.batch_size)
    ends = chunk_ends(n_batches, cfg.chunks)
    chunk = 0
    for b, part in enumerate(perplexity_batches(student, eval_ids, cfg.seq_len, cfg.batch_size), start=1):
        if b not in ends and not part.diverged:
            continue
        chunk += 1
        final = b == n_batches or part.diverged
        yield {
            "chunk": chunk,
            "ppl": part.ppl,
            "nll": part.nll,
            "tokens": part.tokens,
            "windows": part.windows,
            "final": final,
            "diverged": part.diverged,
        }
        if final:
            return
