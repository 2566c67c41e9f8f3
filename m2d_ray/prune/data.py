"""The data of a dense-to-dense pruning: calibration tokens for importance, evaluation ids for scoring candidates."""

from __future__ import annotations

from torch import Tensor

from m2d_ray.calibrate.tokens import EMBEDDED_EVAL, calibration_tokens, resolve_calib
from m2d_ray.data.text import TokenSet, check_spec, load_text, tokenize
from m2d_ray.models import is_embedded

HUB_EVAL = "wikitext2:test"


def data_specs(name: str, calib_data: str | None, eval_data: str | None, scored: bool) -> tuple[str, str | None]:
    """(calibration, evaluation) data of a dense teacher, checked before any weights are read: the embedded
    twin defaults to its synthetic corpus, other teachers to WikiText; evaluation data only when scored or given."""
    embedded = is_embedded(name)
    calib = resolve_calib(calib_data, None if embedded else name)
    check_spec(calib, "calibration data")
    ev = eval_data if eval_data is not None or not scored else (EMBEDDED_EVAL if embedded else HUB_EVAL)
    if ev:
        check_spec(ev, "evaluation data")
    return calib, ev


def load_tokens(
    name: str, tokenizer, calib_spec: str, eval_spec: str | None, seq_len: int, max_tokens: int, max_chars: int | None
) -> tuple[str, TokenSet, Tensor | None]:
    """(calibration spec, calibration tokens, evaluation ids or None) for the importance pass and the scoring."""
    spec, calib = calibration_tokens(tokenizer, calib_spec, None if is_embedded(name) else name, seq_len, max_tokens)
    return (
        spec,
        calib,
        tokenize(tokenizer, load_text(eval_spec, max_chars=max_chars), max_chars=max_chars) if eval_spec else None,
    )
