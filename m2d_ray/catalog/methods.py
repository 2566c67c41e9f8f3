"""The methods a config or a command may name: scorings, groupings, scalings and the random baseline students.

Each registry knows its entries' names and one-line docs here, without torch; the module that implements an entry
is imported at its first lookup and registers it (`registry.Registry`).
"""

from __future__ import annotations

from m2d_ray.registry import Registry

SCORINGS = Registry.in_module(
    "scoring",
    "m2d_ray.scoring.methods",
    {
        **{b: f"Top-K experts by {b.upper()}." for b in ("sf", "pp", "ps", "cp", "acp")},
        "do-cp": "D-optimal (greedy log-det) with base importance CP.",
        "do-acp": "D-optimal (greedy log-det) with base importance ACP.",
    },
)

GROUPINGS = Registry.in_module(
    "grouping",
    "m2d_ray.grouping.methods",
    {
        "rr": "Rank r (by score) goes to group r mod k.",
        "wc": "Average-linkage on cosine distance of the flattened concat(gate, up, down).",
        "rc": "Average-linkage on cosine distance of the router weight rows.",
        "ab": "MC-SMoE: the k best-scored experts anchor; every other one joins its most router-similar anchor.",
        "oc": "HC-SMoE: average-linkage on 1 - rho, rho_ij = G_ij / sqrt(G_ii G_jj) (output cosine).",
    },
)

SCALINGS = Registry.in_module(
    "scaling",
    "m2d_ray.convert.scaling",
    {
        "uniform": "alpha_g = 1/k (times the router's routed_scaling_factor): the mean weight of a renormalised "
        "top-k router.",
        "proportional": "alpha_g = group score mass / total score mass (x routed_scaling_factor; uniform for all-zero "
        "scores).",
        "avg-cp": "alpha_g = mean over the group of the weight the router applies to e when it selects e.",
    },
)

RANDOM_BASELINES = Registry.in_module(
    "baseline",
    "m2d_ray.convert.baselines",
    {
        "random-ffn": "Teacher attention, embeddings, norms and head; every MoE FFN freshly initialised.",
        "random-init": "The student architecture with every weight freshly initialised (transformers' own init).",
    },
)

#: the paper's best recipe (D-optimal ACP scores, round-robin groups by rank, uniform scaling): what `m2d convert`
#: makes unless told otherwise
PAPER_BEST = {"scoring": "do-acp", "grouping": "rr", "scaling": "uniform"}


#: the dense-to-dense baseline's candidate shapes at a parameter budget (prune/search.py), each scored by perplexity
#: before distillation: (kind, hidden factor, heads factor, layers factor); the FFN width is solved for the budget.
#: Here, without torch: the plan prices one evaluation per mix.
PRUNING_MIXES = (
    ("width: ffn", 1.0, 1.0, 1.0),
    ("width: hidden + ffn", 0.75, 1.0, 1.0),
    ("width: heads + ffn", 1.0, 0.5, 1.0),
    ("depth + width: ffn", 1.0, 1.0, 0.75),
    ("depth + width: ffn", 1.0, 1.0, 0.5),
    ("depth + width: hidden + ffn", 0.75, 1.0, 0.75),
)
