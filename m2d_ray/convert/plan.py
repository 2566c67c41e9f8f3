"""The conversion plan: what a student is made of, layer by layer, before any weight is touched.

A plan is pure data (selected experts, groups, merge coefficients, scales), so it can be printed,
logged, compared (two configs with the same plan build the very same student) and replayed.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.catalog.methods import GROUPINGS, SCALINGS, SCORINGS
from m2d_ray.convert.merge import merge_weights
from m2d_ray.errors import M2DError
from m2d_ray.grouping.methods import GroupingInputs, group
from m2d_ray.scoring.methods import select, selection_erank


@dataclass(frozen=True)
class LayerPlan:
    selected: list[int]  # pick order
    groups: list[list[int]]
    coefs: list[list[float]]  # merge coefficient of each member, per group
    alphas: list[float]  # down-projection scale per group
    shared_scale: float | None  # scale of the shared expert(s); None when the layer has none
    erank: float  # effective rank of the selected experts' output Gram


@dataclass(frozen=True)
class ConversionPlan:
    scoring: str
    grouping: str
    scaling: str
    K: int
    k: int
    layers: dict[int, LayerPlan]

    def signature(self, digits: int = 12) -> str:
        """Digest of everything that determines the student's weights (not the method names)."""

        def r(xs):
            return [round(float(x), digits) for x in xs]

        body = [
            (
                i,
                p.groups,
                [r(c) for c in p.coefs],
                r(p.alphas),
                None if p.shared_scale is None else round(p.shared_scale, digits),
            )
            for i, p in sorted(self.layers.items())
        ]
        return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {
            "scoring": self.scoring,
            "grouping": self.grouping,
            "scaling": self.scaling,
            "K": self.K,
            "k": self.k,
            "signature": self.signature(),
            "layers": {str(i): asdict(p) for i, p in sorted(self.layers.items())},
        }

    @classmethod
    def from_json(cls, d: dict) -> ConversionPlan:
        """Inverse of to_json (plans travel to sweep trials as JSON)."""
        layers = {int(i): LayerPlan(**p) for i, p in d["layers"].items()}
        return cls(
            scoring=d["scoring"], grouping=d["grouping"], scaling=d["scaling"], K=d["K"], k=d["k"], layers=layers
        )


def check_method_names(scoring: str, grouping: str, scaling: str) -> None:
    SCORINGS.check(scoring)
    GROUPINGS.check(grouping)
    SCALINGS.check(scaling)


def check_K(K: int, k: int, E: int) -> None:
    if not k <= K <= E:
        raise M2DError(f"K={K} is outside [k, E] = [{k}, {E}] for this model; choose {k} <= K <= {E}")


def plan_layer(
    st: LayerStats,
    inputs_for,
    scoring: str,
    grouping: str,
    scaling: str,
    K: int,
    k: int,
    has_shared: bool,
    gated_shared: bool,
    routed_scale: float = 1.0,
) -> LayerPlan:
    """Plan one MoE layer. `inputs_for(selected, scores)` builds the GroupingInputs (lazy weights)."""
    sel = select(scoring, st, K)
    groups = group(grouping, inputs_for(sel.experts, sel.scores), k)
    coefs = [merge_weights(sel.scores, g).tolist() for g in groups]
    alphas = SCALINGS[scaling](st, groups, sel.scores, routed_scale)
    shared_scale = (st.shared_gate_mean if gated_shared else 1.0) if has_shared else None
    return LayerPlan(
        selected=sel.experts,
        groups=groups,
        coefs=coefs,
        alphas=[float(a) for a in alphas],
        shared_scale=shared_scale,
        erank=selection_erank(st, sel),
    )


def make_plans(
    teacher, stats: dict[int, LayerStats], recipes: Sequence[tuple[str, str, str, int]]
) -> list[ConversionPlan]:
    """Plans of several (scoring, grouping, scaling, K) recipes of `teacher` (a `models.Teacher` or a
    `weights.LazyTeacher`), layer by layer: a layer's router rows, and the experts any recipe selects when a
    grouping clusters weights, are read once for every recipe and dropped before the next layer, so
    planning holds at most one teacher layer at a time."""
    adapter, config = teacher.adapter, teacher.config
    k, E = adapter.top_k(config), adapter.num_experts(config)
    for scoring, grouping, scaling, K in recipes:
        check_method_names(scoring, grouping, scaling)
        check_K(K, k, E)
    blocks = adapter.moe_blocks(teacher.skeleton)
    if sorted(blocks) != sorted(stats):
        raise M2DError(
            f"statistics cover layers {sorted(stats)} but the model's MoE layers are {sorted(blocks)}; recalibrate"
        )
    layers: list[dict[int, LayerPlan]] = [{} for _ in recipes]
    for i, block in blocks.items():
        shared = adapter.shared(block)  # structure only: whether the layer has a (gated) shared expert
        router = functools.cache(lambda i=i: teacher.router_weight(i))
        # only experts some recipe selects, read when a grouping first looks at weights
        needed = sorted({e for s, _, _, K in recipes for e in select(s, stats[i], K).experts})
        at = {e: j for j, e in enumerate(needed)}
        experts = functools.cache(lambda i=i, needed=needed: teacher.experts(i, needed))

        def inputs_for(selected, scores, st=stats[i], router=router, experts=experts, at=at):
            return GroupingInputs(
                selected=selected,
                scores=scores,
                gram=st.gram_mean,
                router=router,
                experts=lambda: experts().select([at[e] for e in selected]),
            )

        for plans, (scoring, grouping, scaling, K) in zip(layers, recipes):
            plans[i] = plan_layer(
                stats[i],
                inputs_for,
                scoring,
                grouping,
                scaling,
                K,
                k,
                has_shared=shared is not None,
                gated_shared=shared is not None and shared.gate is not None,
                routed_scale=adapter.routed_scale(config),
            )
    return [
        ConversionPlan(scoring=s, grouping=g, scaling=c, K=K, k=k, layers=p) for (s, g, c, K), p in zip(recipes, layers)
    ]


def make_plan(
    teacher, stats: dict[int, LayerStats], scoring: str, grouping: str, scaling: str, K: int
) -> ConversionPlan:
    """Plan every MoE layer of `teacher` from its calibration statistics."""
    return make_plans(teacher, stats, [(scoring, grouping, scaling, K)])[0]
