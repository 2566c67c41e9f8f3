"""The science run: `m2d run wiki4` on ../shared/teachers/qwen3moe-wiki4, then the paper's tables.

    python -m benchmarks.science.wiki4_run [--run-dir runs/wiki4-run]

Runs (or resumes) the whole pipeline into RUN_DIR, then prints, from the run directory only:
the baseline table (mean accuracy, each row against random FFN + teacher attention in the same run),
the marginal spread of scoring vs grouping, the selection overlap of all scorings at K = k and the
effective rank of each scoring's selection at K = k, next to the paper's reference values.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from benchmarks.common import REPO, machine_line
from m2d_ray.report.analysis import distill_rows, erank_table, load_run, marginal, overlap, selections

PAPER = (
    "paper (Qwen3-30B-A3B, 0.3B tokens, mean of 5 benchmarks, %): DO-ACP K=8 43.41 · ACP K=8 42.52 · CP ~40.4 · "
    "SF×OC 37.52 · SF×AB 36.31 · random FFN 32.70 · random init 30.15 · teacher 79.65; scoring spread 5.7 pp, grouping "
    "~1 pp; "
    "DO-ACP overlap with frequency scorings <= 0.08; effective rank of the selected 8: CP 6.07, DO-ACP 7.37"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default=str(REPO / "runs" / "wiki4-run"))
    args = ap.parse_args()
    run_dir = Path(args.run_dir)
    print(machine_line())
    cmd = (
        ["m2d", "run", "--resume", str(run_dir)]
        if (run_dir / "config.yaml").exists()
        else ["m2d", "run", "wiki4", "--out", str(run_dir)]
    )
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    data = load_run(run_dir)
    rows = distill_rows(data)
    ref = next(r["mean"] for r in rows if r["scoring"] == "random-ffn")
    print("\n| student | K | scaling | stage-1 ppl | final val ppl | accuracy | vs random FFN |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        name = f"{r['scoring'].upper()} × {r['grouping'].upper()}" if r["kind"] == "student" else r["scoring"]

        def fmt(v, f):
            return "" if v is None else f.format(v)

        print(
            f"| {name} | {fmt(r['K'], '{}')} | {r['scaling']} | {fmt(r['stage1_ppl'], '{:,.0f}')} | "
            f"{fmt(r['val_ppl'], '{:.1f}')} | "
            f"{fmt(r['mean'], '{:.4f}')} | {fmt(r['mean'] - ref if r['mean'] is not None else None, '{:+.4f}')} |"
        )
    g = data.cfg.grid
    for axis in ("scoring", "grouping"):
        m = marginal(rows, axis, getattr(g, axis))
        spread = max(m.values()) - min(m.values())
        print(
            f"\nmarginal mean accuracy per {axis}: "
            + ", ".join(f"{k} {v:.4f}" for k, v in m.items())
            + f"  (spread {spread * 100:.2f} pp)"
        )
    sel = selections(data, data.k)
    ov = overlap(sel, data.k)
    print(f"\nselection overlap at K = k = {data.k} (|S_a ∩ S_b| / K, mean over layers)")
    print("| | " + " | ".join(s.upper() for s in ov) + " |\n|---|" + "---:|" * len(ov))
    for a in ov:
        print(f"| {a.upper()} | " + " | ".join(f"{ov[a][b]:.2f}" for b in ov) + " |")
    Ks, er = erank_table(data)
    print(
        f"\neffective rank of the selected {data.k} (max {data.k}): "
        + ", ".join(f"{s} {t[data.k]:.2f}" for s, t in er.items())
    )
    print(f"\n{PAPER}\nreport: {run_dir / 'report' / 'index.html'}")


if __name__ == "__main__":
    sys.exit(main())
