"""The methods a config or a command may name: scorings, groupings, scalings and the random baseline students.

Each registry knows its entries' names and one-line docs here, without torch; the module that implements an entry
is imported at its first lookup and registers it (`registry.Registry`).
"""

from __future__ import annotations

from m2d_ray.registry import Registry

_SCORING = "m2d_ray.scoring.methods"

SCORINGS = Registry(
    "scoring",
    lazy={
        **{b: (_SCORING, f"Top-K experts by {b.upper()}.") for b in ("sf", "pp", "ps", "cp", "acp")},
        "do-cp": (_SCORING, "D-optimal (greedy log-det) with base importance CP."),
        "do-acp": (_SCORING, "D-optimal (greedy log-det) with base importance ACP."),
    },
)

_GROUPING = "m2d_ray.grouping.methods"

GROUPINGS = Registry(
    "grouping",
    lazy={
        "rr": (_GROUPING, "Rank r (by score) goes to group r mod k."),
        "wc": (_GROUPING, "Average-linkage on cosine distance of the flattened concat(gate, up, down)."),
        "rc": (_GROUPING, "Average-linkage on cosine distance of the router weight rows."),
        "ab": (
            _GROUPING,
            "MC-SMoE: the k best-scored experts anchor; every other one joins its most router-similar anchor.",
        ),
        "oc": (_GROUPING, "HC-SMoE: average-linkage on 1 - rho, rho_ij = G_ij / sqrt(G_ii G_jj) (output cosine)."),
    },
)

_SCALING = "m2d_ray.convert.scaling"
_BASELINES = "m2d_ray.convert.baselines"

SCALINGS = Registry(
    "scaling",
    lazy={
        "uniform": (
            _SCALING,
            "alpha_g = 1/k (times the router's routed_scaling_factor): the mean weight of a renormalised top-k router.",
        ),
        "proportional": (
            _SCALING,
            "alpha_g = group score mass / total score mass (x routed_scaling_factor; uniform for all-zero scores).",
        ),
        "avg-cp": (_SCALING, "alpha_g = mean over the group of the weight the router applies to e when it selects e."),
    },
)

RANDOM_BASELINES = Registry(
    "baseline",
    lazy={
        "random-ffn": (_BASELINES, "Teacher attention, embeddings, norms and head; every MoE FFN freshly initialised."),
        "random-init": (
            _BASELINES,
            "The student architecture with every weight freshly initialised (transformers' own init).",
        ),
    },
)

#: the paper's best recipe (D-optimal ACP scores, round-robin groups by rank, uniform scaling): what `m2d convert`
#: makes unless told otherwise
PAPER_BEST = {"scoring": "do-acp", "grouping": "rr", "scaling": "uniform"}
