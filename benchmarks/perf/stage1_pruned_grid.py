"""P2: the stage-1 grid with plan dedupe + per-pair early stopping against the full, unpruned grid.

Both sweeps run on one local Ray (num_cpus=4, 2 concurrent trials of 1 thread) from the same
statistics (the second run reuses the first's artifact), so they differ only in the search. Prints
the number of Tune trials, of full perplexity evaluations, wall times, their ratios, and whether the
promoted (K, scaling) of every (scoring, grouping) pair is the same.

    python -m benchmarks.perf.stage1_pruned_grid [--config tiny-grid] [--out runs/p2] [key=value ...]

Default: tiny-grid (the embedded teacher, 7 x 5 x 2 x K in {2, 4, 8, 16} = 280 configs).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from benchmarks.common import REPO, machine_line


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny-grid")  # a shipped config, or a file
    p.add_argument("--out", default=str(REPO / "runs" / "p2"))
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    from m2d_ray.config import load_config
    from m2d_ray.pipeline import run_stages

    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    print(machine_line())
    fast = run_stages(load_config(a.config, a.overrides), out / "pruned", "calibrate", "stage1")["stage1"]
    (out / "full").mkdir(parents=True)
    shutil.copytree(out / "pruned" / "stats", out / "full" / "stats")
    full = run_stages(
        load_config(a.config, [*a.overrides, "search.dedupe=false", "search.early_stop=false"]),
        out / "full",
        "calibrate",
        "stage1",
    )["stage1"]

    def win(r):
        return {k: (v["K"], v["scaling"]) for k, v in r.promotions.items()}

    same = win(fast) == win(full)
    diff = sorted(k for k in win(full) if win(fast).get(k) != win(full)[k])
    chunks = load_config(a.config, a.overrides).eval.chunks

    def eq(r):  # compute in full-evaluation equivalents
        return r.chunks_evaluated / chunks

    print(
        f"\nconfigs {len(full.records)}; distinct students {fast.probed or fast.evaluated}; {chunks} chunks per "
        "evaluation"
    )
    print(
        "| search | probe trials | evaluation trials | full perplexity evaluations | compute (full-eval equivalents) | "
        "wall (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| full grid | {full.probed} | {full.evaluated} | {full.full_evaluations} | {eq(full):.1f} | "
        f"{full.wall_s:.0f} |"
    )
    print(
        f"| dedupe + probe + early stopping | {fast.probed} | {fast.evaluated} | {fast.full_evaluations} | "
        f"{eq(fast):.1f} | {fast.wall_s:.0f} |"
    )
    print(
        f"| ratio full / ours | | | {full.full_evaluations / max(fast.full_evaluations, 1):.2f}x | "
        f"{eq(full) / eq(fast):.2f}x | {full.wall_s / fast.wall_s:.2f}x |"
    )
    print(
        f"same winners for all {len(win(full))} (scoring, grouping) pairs: {same}"
        + (f" (differ: {diff})" if diff else "")
    )


if __name__ == "__main__":
    main()
