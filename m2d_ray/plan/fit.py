"""Unit start-ups fit on measured stage walls: what the GPU acceptance call turns a whole run's walls into
(plan.gpu_start_s, m2d_ray/measured_gpu.json), so that the bill of a run that small is its start-ups, measured.

A stage's wall in the bill is linear in the start-up of the unit it runs (each wave of units pays one start-up):
wall = wall at zero start-up + waves x start. `fit_starts` reads both terms from the bill itself (planned once with
every start-up at zero, once per unit kind with that one at a second), so the fit follows whatever the stages' costs
say (their rounds, lanes and compute), and each unit kind's start-up is the geometric mean of what its stages'
measured walls give (a kind shared by several stages, the actor of the calibration, targets and analysis, is not
fit to one of them alone)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

MIN_S = 0.5  # a start-up below this is not resolved by walls of tens of seconds


def fit_starts(
    walls_of: Callable[[dict[str, float]], Mapping[str, float]], measured: Mapping[str, float], units: list[str]
) -> dict[str, float]:
    """{unit: start-up seconds} that make `walls_of(starts)` (the bill's wall of each stage) meet the `measured`
    walls; a unit no measured stage depends on keeps no entry."""
    zero = {u: 0.0 for u in units}
    base = walls_of(zero)
    out = {}
    for u in units:
        slope = walls_of({**zero, u: 1.0})
        per_stage = [
            max(MIN_S, (measured[s] - base[s]) / (slope[s] - base[s]))
            for s in measured
            if s in base and slope[s] - base[s] > 1e-9
        ]
        if per_stage:
            out[u] = round(math.exp(sum(map(math.log, per_stage)) / len(per_stage)), 1)
    return out
