"""Stage 1's grid in numbers and names: a student named directly (`Recipe`, stage2.recipes) and the K list of a
teacher (`k_values`), which the plan's arithmetic reads too (plan/cost.py)."""

from __future__ import annotations

from dataclasses import dataclass

from m2d_ray.catalog.distill import AUTO
from m2d_ray.catalog.methods import GROUPINGS, SCALINGS, SCORINGS
from m2d_ray.errors import M2DError


@dataclass(frozen=True)
class Recipe:
    """One student named directly (stage2.recipes): what stage 1 would have promoted for its pair."""

    scoring: str
    grouping: str
    K: int
    scaling: str

    @property
    def pair(self) -> str:
        return f"{self.scoring}/{self.grouping}"

    def __str__(self) -> str:
        return f"{self.scoring}/{self.grouping}/K{self.K}/{self.scaling}"


def parse_recipe(text: str) -> Recipe:
    """`scoring/grouping/K<K>/scaling` (e.g. do-acp/rr/K8/uniform), each name checked against its registry."""
    parts = str(text).strip().split("/")
    usage = "write scoring/grouping/K<K>/scaling, e.g. do-acp/rr/K8/uniform"
    if len(parts) != 4 or parts[2][:1] not in ("K", "k") or not parts[2][1:].isdigit() or int(parts[2][1:]) < 1:
        raise M2DError(f"stage2.recipes: {text!r} is not a recipe; {usage}")
    for name, registry in ((parts[0], SCORINGS), (parts[1], GROUPINGS), (parts[3], SCALINGS)):
        if name not in registry:
            raise M2DError(f"stage2.recipes: {text!r}: {registry.unknown_message(name)}")
    return Recipe(parts[0], parts[1], int(parts[2][1:]), parts[3])


def k_values(K: str | tuple[int, ...], k: int, E: int) -> list[int]:
    """The K list for a model with top-k `k` and `E` experts; raises when a K is outside [k, E]."""
    if K == AUTO:
        out, v = [], k
        while v < E:
            out.append(v)
            v *= 2
        return out + [E]
    bad = [v for v in K if not k <= v <= E]
    if bad:
        raise M2DError(f"grid.K has {bad} outside [k, E] = [{k}, {E}] for this model; use values in that range or auto")
    return sorted(set(K))
