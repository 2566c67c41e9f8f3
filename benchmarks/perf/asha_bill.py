"""Stage 2's bill under ASHA (plan/cost.asha_ends) against Ray's own scheduler (issue 33).

    python -m benchmarks.perf.asha_bill  # the paper's 37 students, tiny.yaml's 11 with ASHA on, and more, at
    4 correlations
    python -m benchmarks.perf.asha_bill --runs 2000

The plan expects where ASHA stops each student by its own copy of ASHA's rule, over students in random order
of quality who keep their loss at every report (rho = 1 below). Here Ray Tune's `ASHAScheduler` itself decides,
on simulated students: each has a quality q, its validation loss at report r is sqrt(rho) q + sqrt(1 - rho) e_r
(rho: how much a student's loss at one report says about the next), `lanes` of them train at once, one report
per unit of time, and a stopped or finished student frees its lane for the next. Printed: the students that
finish and the reports they all make (what stage 2's FLOPs are made of), the plan's against the mean over
runs, and their ratio.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections import Counter
from types import SimpleNamespace

#: (name, students, reports, grace, reduction factor, students at once)
CASES = [
    ("paper (37 students, 8 reports, 2 at once)", 37, 8, 2, 3, 2),
    ("tiny.yaml with ASHA (11 students, 4 reports)", 11, 4, 2, 3, 2),
    ("100 students, 27 reports, 4 at once", 100, 27, 1, 3, 4),
    ("20 students, 16 reports, rf 2", 20, 16, 1, 2, 2),
]
RHOS = (0.0, 0.5, 0.9, 1.0)


def simulate(n: int, reports: int, grace: int, rf: float, lanes: int, rho: float, seed: int) -> Counter:
    """{reports a student made before it ended: students} with Ray's ASHAScheduler deciding (see the module)."""
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
    from dataclasses import replace

    from m2d_ray.config import load_config
    from m2d_ray.plan.cost import asha_ends

    cfg = load_config(None)
    cfg = replace(
        cfg,
        distill=replace(cfg.distill, steps=reports, eval_every=1),
        stage2=replace(cfg.stage2, asha=True, grace_evals=grace, reduction_factor=rf),
    )
    return asha_ends(cfg, n, lanes)


def compare(n: int, reports: int, grace: int, rf: float, lanes: int, rho: float, runs: int) -> dict:
    """The plan's finishers and total reports against the mean of `runs` simulated stage 2s."""
    sims = [simulate(n, reports, grace, rf, lanes, rho, seed) for seed in range(runs)]
    plan = plan_ends(n, reports, grace, rf, lanes)
    finish = sum(s[reports] for s in sims) / runs
    total = sum(sum(r * k for r, k in s.items()) for s in sims) / runs
    plan_total = sum(r * k for r, k in plan)
    return {
        "rho": rho,
        "plan_finish": plan[-1][1],
        "ray_finish": finish,
        "plan_reports": plan_total,
        "ray_reports": total,
        "ratio": plan_total / total,
        "plan": plan,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=500)
    args = ap.parse_args()
    from benchmarks.common import machine_line

    print(machine_line())
    print("| case | rho | finish: plan | finish: Ray (mean) | reports: plan | reports: Ray (mean) | plan / Ray |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    out = []
    for name, n, reports, grace, rf, lanes in CASES:
        for rho in RHOS:
            c = compare(n, reports, grace, rf, lanes, rho, args.runs)
            out.append({"case": name, **c})
            print(
                f"| {name} | {rho:g} | {c['plan_finish']} | {c['ray_finish']:.2f} | {c['plan_reports']:g} | "
                f"{c['ray_reports']:.1f} | "
                f"{c['ratio']:.3f} |"
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
