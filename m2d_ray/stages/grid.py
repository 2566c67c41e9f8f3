"""The stage-1 grid: every (scoring, grouping, scaling, K), planned once, and deduplicated by plan.

Two configs that build the very same student (at K = k every grouping gives singletons; at K = E all
scorings keep every expert ...) have equal plan signatures (groups, merge coefficients and scales),
so the student is evaluated once and the result is shared. Names never enter the signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from m2d_ray.config import GridConfig, k_values

if TYPE_CHECKING:
    from m2d_ray.convert.plan import ConversionPlan

# Imported inside functions: the conversion plans (torch: `m2d plan` reads the grid without them).


@dataclass(frozen=True, order=True)
class TrialSpec:
    scoring: str
    grouping: str
    scaling: str
    K: int

    @property
    def key(self) -> str:
        """File- and run-name-safe identity of the config."""
        return f"{self.scoring}_{self.grouping}_{self.scaling}_K{self.K}"

    @property
    def pair(self) -> str:
        return f"{self.scoring}/{self.grouping}"

    def params(self) -> dict:
        return {"scoring": self.scoring, "grouping": self.grouping, "scaling": self.scaling, "K": self.K}


def expand(grid: GridConfig, k: int, E: int) -> list[TrialSpec]:
    """Every config of the grid in table order (scoring, grouping, scaling, K)."""
    Ks = k_values(grid.K, k, E)
    return [TrialSpec(s, g, c, K) for s in grid.scoring for g in grid.grouping for c in grid.scaling for K in Ks]


def plan_all(teacher, stats, specs: list[TrialSpec]) -> dict[str, dict]:
    """Plan (as JSON) of every spec; CPU work on the statistics and router/expert weights, read layer by layer."""
    from m2d_ray.convert.plan import make_plans

    plans = make_plans(teacher, stats, [(s.scoring, s.grouping, s.scaling, s.K) for s in specs])
    return {s.key: p.to_json() for s, p in zip(specs, plans)}


@dataclass(frozen=True)
class Unique:
    """One student to evaluate, and every config that builds it (the first one is canonical)."""

    signature: str
    members: tuple[TrialSpec, ...]

    @property
    def canonical(self) -> TrialSpec:
        return self.members[0]

    @property
    def pairs(self) -> list[str]:
        return sorted({m.pair for m in self.members})


def dedupe(specs: list[TrialSpec], plans: dict[str, dict], enabled: bool = True) -> list[Unique]:
    """Group specs by plan signature (or one group per spec when disabled), in grid order."""
    groups: dict[str, list[TrialSpec]] = {}
    for s in specs:
        sig = plans[s.key]["signature"] if enabled else s.key
        groups.setdefault(sig, []).append(s)
    return [Unique(plans[m[0].key]["signature"], tuple(m)) for m in groups.values()]


def plan_of(plans: dict[str, dict], key: str) -> ConversionPlan:
    from m2d_ray.convert.plan import ConversionPlan

    return ConversionPlan.from_json(plans[key])
