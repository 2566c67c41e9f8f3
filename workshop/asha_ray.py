"""Ray Tune's own ASHAScheduler deciding over simulated students: the reference plan/cost.py's copy of ASHA's rule
is held to (tests/unit/test_plan_cost.py) and measured against (benchmarks/perf/asha_bill.py).

Each simulated student has a quality q; its validation loss at report r is sqrt(rho) q + sqrt(1 - rho) e_r (rho:
how much a student's loss at one report says about the next); `lanes` of them train at once, one report per unit of
time, and a stopped or finished student frees its lane for the next. At rho = 1 the students keep their order of
quality, the case the plan expects.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

from m2d_ray.config import load_config
from m2d_ray.plan.asha import asha_ends

# Imported inside functions: Ray, which the plan (read by every process first) does not load.

#: (name, students, reports, grace, reduction factor, students at once)
CASES = [
    ("paper (37 students, 8 reports, 2 at once)", 37, 8, 2, 3, 2),
    ("tiny.yaml with ASHA (11 students, 4 reports)", 11, 4, 2, 3, 2),
    ("100 students, 27 reports, 4 at once", 100, 27, 1, 3, 4),
    ("20 students, 16 reports, rf 2", 20, 16, 1, 2, 2),
]


def simulate(n: int, reports: int, grace: int, rf: float, lanes: int, rho: float, seed: int) -> Counter:
    """{reports a student made before it ended: students} with Ray's ASHAScheduler deciding."""
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    rng = random.Random(seed)
    sched = ASHAScheduler(
        time_attr="training_iteration",
        metric="val_loss",
        mode="min",
        max_t=reports,
        grace_period=grace,
        reduction_factor=rf,
    )
    quality = [rng.gauss(0, 1) for _ in range(n)]
    trials = [SimpleNamespace(trial_id=f"s{i:04d}") for i in range(n)]
    running: list[tuple[float, int, int]] = []  # (time of its next report, start order, report number)
    started, ends = 0, Counter()
    for _ in range(min(lanes, n)):
        sched.on_trial_add(None, trials[started])
        heapq.heappush(running, (1.0, started, 1))
        started += 1
    while running:
        t, i, r = heapq.heappop(running)
        loss = math.sqrt(rho) * quality[i] + math.sqrt(1 - rho) * rng.gauss(0, 1)
        action = sched.on_trial_result(None, trials[i], {"training_iteration": r, "val_loss": loss})
        if action == TrialScheduler.STOP or r >= reports:
            ends[r] += 1
            if started < n:
                sched.on_trial_add(None, trials[started])
                heapq.heappush(running, (t + 1.0, started, 1))
                started += 1
        else:
            heapq.heappush(running, (t + 1.0, i, r + 1))
    return ends


def plan_ends(n: int, reports: int, grace: int, rf: float, lanes: int) -> list[tuple[float, int]]:
    """The plan's expected ends for the same students (plan/cost.asha_ends through a config)."""
    cfg = load_config(None)
    cfg = replace(
        cfg,
        distill=replace(cfg.distill, steps=reports, eval_every=1),
        stage2=replace(cfg.stage2, asha=True, grace_evals=grace, reduction_factor=rf),
    )
    return asha_ends(cfg, n, lanes)
