"""Sizes as people write them and read them: '24GB', '512MiB' or bytes in; '7.1 GiB' out."""

from __future__ import annotations

import re

from m2d_ray.errors import M2DError


def parse_size(text: str | int | None) -> int | None:
    """Bytes of '24GB', '512MiB', '2e9' or an int (None stays None)."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", str(text).lower())
    if not m:
        raise M2DError(f"memory size {text!r} not understood; write e.g. 24GB, 512MiB or a number of bytes")
    base = 1024 if m[3] or not m[2] else 1000
    return int(float(m[1]) * base ** "_kmgt".index(m[2] or "_"))


def gib(n: float) -> str:
    """Bytes as GiB (MiB below one GiB)."""
    return f"{n / (1 << 30):.1f} GiB" if n >= (1 << 30) else f"{n / (1 << 20):.0f} MiB"
