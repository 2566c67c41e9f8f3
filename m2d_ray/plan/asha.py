"""ASHA in stage 2, expected before the run: the rungs a student reports at, and where the students of a simulated
stage 2 end (fixed seed: the same plan every time), which the bill prices instead of every student's whole budget
(tests/unit/test_plan_cost.py holds the rule to Ray Tune's own ASHAScheduler).
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections import Counter

from m2d_ray.config import SweepConfig
from m2d_ray.plan.flops import student_reports


def asha_rungs(reports: int, grace: int, rf: float) -> list[float]:
    """The reports after which Ray's ASHA may stop a student: its bracket's milestones grace x rf^k, as many as
    tune's _Bracket makes, below max_t = `reports` (a report at max_t is the student's last anyway)."""
    if grace <= 0 or rf <= 1 or reports <= grace:
        return []
    count = int(math.log(reports / grace) / math.log(rf) + 1)
    return [grace * rf**k for k in range(count) if grace * rf**k < reports]


ASHA_RUNS = 200  # stage 2s simulated for the expected ends (fixed seed: the same plan every time)


def asha_ends(cfg: SweepConfig, n: int, lanes: int | None = None) -> list[tuple[float, int]]:
    """[(reports, students that end after them)] of stage 2's `n` students, `lanes` at once: where ASHA
    (stage2.asha) stops them, the last entry the students that finish; [(reports, n)] without ASHA.

    Expected over ASHA_RUNS stage 2s of students of normally distributed quality in random order, each keeping
    its loss at every report (loss curves that do not cross: the dearest case, as a student's loss early says
    much about it later), rounded to whole students. benchmarks/perf/asha_bill.py holds it to Ray's own scheduler."""
    full, s2 = student_reports(cfg), cfg.stage2
    rungs = asha_rungs(full, min(s2.grace_evals, full), s2.reduction_factor) if s2.asha else []
    if not rungs or n < 2:
        return [(full, n)]
    return list(_expected_ends(n, full, tuple(rungs), s2.reduction_factor, lanes or n))


@functools.lru_cache(maxsize=256)
def _expected_ends(n: int, full: int, rungs: tuple, rf: float, lanes: int) -> tuple[tuple[float, int], ...]:
    """`asha_ends`' simulation, kept per its inputs: a plan weighs many candidates (auto settings, placements) whose
    stage 2 is the same, and the simulation (fixed seed) gives each the same ends."""
    rng, seen = random.Random(0), Counter()
    for _ in range(ASHA_RUNS):
        seen.update(_asha_run([rng.gauss(0, 1) for _ in range(n)], full, list(rungs), rf, lanes))
    counts = {r: k / ASHA_RUNS for r, k in seen.items()}
    whole = {r: math.floor(k) for r, k in counts.items()}  # largest remainders: whole students, n in all
    for r in sorted(counts, key=lambda r: whole[r] - counts[r])[: n - sum(whole.values())]:
        whole[r] += 1
    return tuple((r, whole[r]) for r in sorted(whole) if whole[r])


def _asha_run(loss: list[float], full: int, rungs: list[float], rf: float, lanes: int) -> Counter:
    """{reports: students that ended after them} of one stage 2 under tune's ASHA rule: at the first report at
    or past a rung, a student is stopped when its loss is worse than numpy's interpolated (1 - 1/rf) quantile
    (of the rewards, -loss) of the students recorded there before it; one report a unit of time, `lanes` at
    once, a stopped or finished student's lane going to the next."""
    recorded: dict[float, dict[int, float]] = {m: {} for m in rungs}
    ends, running, started = Counter(), [], min(lanes, len(loss))
    for i in range(started):
        heapq.heappush(running, (1, i))
    reports = [0] * len(loss)
    while running:
        t, i = heapq.heappop(running)
        reports[i] += 1
        r = reports[i]
        stop = r >= full  # max_t: its last report
        rung = None if stop else next((m for m in reversed(rungs) if r >= m and i not in recorded[m]), None)
        if rung is not None:
            seen = sorted(recorded[rung].values())
            if seen:
                q = (1 - 1 / rf) * (len(seen) - 1)
                lo = math.floor(q)
                cutoff = seen[lo] + (seen[min(lo + 1, len(seen) - 1)] - seen[lo]) * (q - lo)
                stop = -loss[i] < cutoff
            recorded[rung][i] = -loss[i]
        if stop:
            ends[r] += 1
            if started < len(loss):
                heapq.heappush(running, (t + 1, started))
                started += 1
        else:
            heapq.heappush(running, (t + 1, i))
    return ends
