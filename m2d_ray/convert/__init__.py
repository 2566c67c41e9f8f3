"""Conversion: plan (select, group, scale) -> merge -> concatenate -> dense student (`convert/build.py`).

The registries of this step are declared here, without torch: configs and the CLI know the names of the
scalings (`convert/scaling.py`) and of the random baseline students (`convert/baselines.py`), whose modules
are imported at the first lookup.
"""

from __future__ import annotations

from m2d_ray.registry import Registry

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

__all__ = ["SCALINGS", "RANDOM_BASELINES"]
