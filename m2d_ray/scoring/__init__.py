"""Scorings: name -> function(stats, K) -> Selection (the K kept experts and per-expert scores).

The registry is declared here, without torch: configs and the CLI know the names; `scoring/methods.py`
implements them and is imported at the first lookup.
"""

from __future__ import annotations

from m2d_ray.registry import Registry

_METHODS = "m2d_ray.scoring.methods"

SCORINGS = Registry(
    "scoring",
    lazy={
        **{b: (_METHODS, f"Top-K experts by {b.upper()}.") for b in ("sf", "pp", "ps", "cp", "acp")},
        "do-cp": (_METHODS, "D-optimal (greedy log-det) with base importance CP."),
        "do-acp": (_METHODS, "D-optimal (greedy log-det) with base importance ACP."),
    },
)

__all__ = ["SCORINGS"]
