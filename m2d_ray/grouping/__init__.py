"""Groupings: partition the K selected experts into exactly k non-empty groups.

The registry is declared here, without torch: configs and the CLI know the names; `grouping/methods.py`
implements them (and says how groups are ordered) and is imported at the first lookup.
"""

from __future__ import annotations

from m2d_ray.registry import Registry

_METHODS = "m2d_ray.grouping.methods"

GROUPINGS = Registry(
    "grouping",
    lazy={
        "rr": (_METHODS, "Rank r (by score) goes to group r mod k."),
        "wc": (_METHODS, "Average-linkage on cosine distance of the flattened concat(gate, up, down)."),
        "rc": (_METHODS, "Average-linkage on cosine distance of the router weight rows."),
        "ab": (
            _METHODS,
            "MC-SMoE: the k best-scored experts anchor; every other one joins its most router-similar anchor.",
        ),
        "oc": (_METHODS, "HC-SMoE: average-linkage on 1 - rho, rho_ij = G_ij / sqrt(G_ii G_jj) (output cosine)."),
    },
)

__all__ = ["GROUPINGS"]
