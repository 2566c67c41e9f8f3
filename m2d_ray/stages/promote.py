"""Promotion: the best (K, scaling) of every (scoring, grouping) pair by pre-distillation perplexity.

Only configs with a full, finite perplexity compete (pruned ones were stopped because a config of the
same pair was far better). Ties go to the smaller K, then to the grid's scaling order.
"""

from __future__ import annotations

import math


def promote(records: list[dict], scalings: list[str] | None = None) -> dict[str, dict]:
    """pair "scoring/grouping" -> the winning record's {scoring, grouping, K, scaling, ppl, key, signature}."""
    order = {s: i for i, s in enumerate(scalings or [])}
    best: dict[str, dict] = {}
    for r in records:
        if r["status"] != "ok" or r.get("ppl") is None or not math.isfinite(r["ppl"]):
            continue
        pair = f"{r['scoring']}/{r['grouping']}"
        rank = (r["ppl"], r["K"], order.get(r["scaling"], len(order)))
        cur = best.get(pair)
        if cur is None or rank < (cur["ppl"], cur["K"], order.get(cur["scaling"], len(order))):
            best[pair] = {k: r[k] for k in ("scoring", "grouping", "K", "scaling", "ppl", "key", "signature")}
    return dict(sorted(best.items()))


def unpromoted(records: list[dict]) -> list[str]:
    """Pairs with no config that finished with a finite perplexity (all diverged / failed)."""
    pairs = {f"{r['scoring']}/{r['grouping']}" for r in records}
    return sorted(pairs - set(promote(records)))
