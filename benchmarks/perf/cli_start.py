"""How fast `m2d` answers: `--help` of every command, bad input, and `m2d plan` of the paper's run, each a fresh
process timed over several runs (min and median), beside `ray --help` and `python -c "import torch"` measured in the
same run (issue 53's targets: help and bad input <= 1 s, the paper plan <= 3 s on a quiet 2-core machine).

    python -m benchmarks.perf.cli_start [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from m2d_ray.shipped import EXPERIMENTS

REPO = Path(__file__).resolve().parents[2]
M2D = [sys.executable, "-m", "m2d_ray.cli"]
PAPER = [
    "plan",
    str(EXPERIMENTS / "qwen3_30b_a3b.yaml"),
    "--model",
    str(EXPERIMENTS / "configs" / "Qwen--Qwen3-30B-A3B"),
    "--gpu-memory",
    "80GB",
]
COMMANDS = ("run", "plan", "sweep", "calibrate", "convert", "distill", "prune-dense", "eval", "analyze", "report")


def cases() -> dict[str, tuple[list[str], float | None, int]]:
    """name -> (argv, the target in seconds or None for a reference, the exit code expected)."""
    out: dict[str, tuple[list[str], float | None, int]] = {
        "python -c 'import torch' (reference)": ([sys.executable, "-c", "import torch"], None, 0),
        "ray --help (reference)": (["ray", "--help"], None, 0),
        "m2d --help": ([*M2D, "--help"], 1.0, 0),
    }
    out.update({f"m2d {c} --help": ([*M2D, c, "--help"], 1.0, 0) for c in COMMANDS})
    out["m2d run: a missing config"] = ([*M2D, "run", "/nonexistent/run.yaml"], 1.0, 2)
    out["m2d run: an unknown key"] = (
        [*M2D, "run", str(EXPERIMENTS / "tiny.yaml"), "grid.scorng=[sf]"],
        1.0,
        2,
    )
    out["m2d plan: the paper's run"] = ([*M2D, *PAPER], 3.0, 0)
    return out


def timed(argv: list[str], code: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t = time.perf_counter()
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t
    if p.returncode != code:
        raise SystemExit(f"{' '.join(argv)}: exit {p.returncode}, expected {code}: {p.stderr[-500:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"{args.runs} runs each, load {load:.2f} at the start ({os.cpu_count()} cores)")
    print("| command | min s | median s | target s | met |\n|---|---:|---:|---:|---|")
    for name, (argv, target, code) in cases().items():
        times = [timed(argv, code) for _ in range(args.runs)]
        low, mid = min(times), statistics.median(times)
        met = "" if target is None else ("yes" if mid <= target else "no")
        print(f"| {name} | {low:.2f} | {mid:.2f} | {'' if target is None else f'{target:g}'} | {met} |", flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
