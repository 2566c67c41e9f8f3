"""The calibration text of a teacher, tokenised into padded sequences (m2d calibrate, convert and stage 1)."""

from __future__ import annotations

from m2d_ray.console import say
from m2d_ray.data.text import TokenSet, calibration_set, load_text
from m2d_ray.errors import M2DError
from m2d_ray.models import default_teacher

#: defaults of the embedded teacher's corpus; other teachers calibrate on WikiText (as the paper)
EMBEDDED_CALIB, EMBEDDED_EVAL = "synthetic:valid", "synthetic:test"
HUB_CALIB = "wikitext2:train"


def resolve_calib(spec: str | None, model: str | None) -> str:

    if spec:
        return spec
    return EMBEDDED_CALIB if model in (None, default_teacher()) else HUB_CALIB


def load_text_with_fallback(spec: str, max_tokens: int | None = None) -> str:
    """Load `spec` (as far as `max_tokens` need); when WikiText cannot be fetched (offline) fall back to the embedded
    corpus."""
    try:
        return load_text(spec, max_tokens=max_tokens)
    except M2DError as exc:
        if not spec.startswith("wikitext"):
            raise
        say(f"m2d: warning: {exc}; using the embedded synthetic corpus instead")
        return load_text(EMBEDDED_CALIB, max_tokens=max_tokens)


def calibration_tokens(
    tokenizer, calib_data: str | None, model: str | None, seq_len: int, max_tokens: int
) -> tuple[str, TokenSet]:
    """(resolved data spec, TokenSet) of the calibration text, packed into padded sequences."""
    spec = resolve_calib(calib_data, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return spec, calibration_set(
        tokenizer, load_text_with_fallback(spec, max_tokens), seq_len=seq_len, max_tokens=max_tokens, pad_id=pad
    )
