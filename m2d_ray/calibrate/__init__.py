"""Calibration: one pass over tokenised text recording, per MoE layer, the statistics of method.md."""

from __future__ import annotations

from pathlib import Path

from m2d_ray.calibrate.artifact import StatsArtifact, load_matching, save_stats
from m2d_ray.calibrate.collect import collect_stats
from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.calibrate.stream import collect_stats_streamed, should_stream
from m2d_ray.data.text import TokenSet
from m2d_ray.models import load_teacher

__all__ = ["calibrate", "data_fingerprint", "StatsArtifact", "LayerStats"]


def data_fingerprint(spec: str, tokens: TokenSet) -> dict:
    return {
        "spec": spec,
        "tokens_sha256": tokens.sha256(),
        "n_tokens": tokens.n_tokens,
        "seq_len": int(tokens.ids.shape[1]),
    }


def calibrate(
    teacher,
    tokens: TokenSet,
    data_spec: str,
    out: str | Path | None = None,
    batch_size: int = 8,
    progress: bool = True,
    device: str = "cpu",
    stream: bool | None = None,
    max_memory: str | int | None = None,
    spill_above: int | None = None,
    overwrite: bool = False,
) -> tuple[StatsArtifact, bool]:
    """Statistics of `teacher` on `tokens`, saved to `out`; reuses `out` when it already matches.

    A loaded `models.Teacher` runs the whole-model pass. A `weights.LazyTeacher` is streamed layer by
    layer when `stream` is set, or (stream=None) when it does not fit `max_memory` (default: the free
    memory of `device`); otherwise it is loaded whole onto `device` first.
    Returns (artifact, reused). With out=None the statistics stay in memory (no checksum).
    """

    model_fp, data_fp = teacher.fingerprint(), data_fingerprint(data_spec, tokens)
    if out is not None and (found := load_matching(out, model_fp, data_fp)) is not None:
        return found, True
    streamed = not hasattr(teacher, "model") and should_stream(teacher, device, stream, max_memory)
    if streamed:
        layers = collect_stats_streamed(
            teacher,
            tokens.ids,
            tokens.mask,
            batch_size=batch_size,
            device=device,
            progress=progress,
            spill_above=spill_above,
        )
    else:
        if not hasattr(teacher, "model"):
            teacher = load_teacher(teacher.name, device=device)
        layers = collect_stats(
            teacher.model, teacher.adapter, tokens.ids, tokens.mask, batch_size=batch_size, progress=progress
        )
    layers = {i: LayerStats.from_tensors(st.to_tensors(""), "") for i, st in layers.items()}  # to CPU
    extra = {"top_k": teacher.adapter.top_k(teacher.config), "engine": "streamed" if streamed else "whole"}
    if out is None:
        return StatsArtifact(layers=layers, manifest={"model": model_fp, "data": data_fp, "sha256": "", **extra}), False
    return save_stats(out, layers, model_fp, data_fp, extra, overwrite=overwrite), False
