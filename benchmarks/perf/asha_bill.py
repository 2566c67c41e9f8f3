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
import json

from workshop.asha_ray import CASES, plan_ends, simulate

RHOS = (0.0, 0.5, 0.9, 1.0)


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
