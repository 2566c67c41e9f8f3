"""What each kind of Ray worker imports before its first call: the module Ray loads to deserialise the unit's function
or class, imported in a fresh interpreter (min of several runs), with the heavy libraries it pulls, at this checkout
and at an earlier commit side by side (the same machine, interleaved).

    python -m benchmarks.perf.worker_imports [--base eacf559] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers.modeling_utils", "transformers", "ray", "mlflow", "datasets", "deepspeed", "lm_eval")
#: unit -> the module whose import a worker of it pays before its first call
UNITS = {
    "calibration actor (Ray Data)": "m2d_ray.calibrate.ray_data",
    "token actor (Ray Data)": "m2d_ray.data.ray_tokens",
    "targets actor (Ray Data)": "m2d_ray.runtime.shards",
    "stage-1 trial (Tune)": "m2d_ray.stages.stage1_tune",
    "stage-2 trial (Tune)": "m2d_ray.stages.stage2_tune",
    "Train worker": "m2d_ray.distill.trainer",
    "d2d search task": "m2d_ray.stages.baselines.d2d",
    "stage-3 task (lm-eval)": "m2d_ray.stages.stage3",
    "analysis task": "m2d_ray.stages.analysis",
    "the CLI (every command)": "m2d_ray.cli",
}


def probe(root: Path, module: str) -> tuple[float, list[str]]:
    code = (
        "import sys, time\nt = time.perf_counter()\n"
        f"import {module}\n"
        "print(time.perf_counter() - t)\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    took, heavy = out.stdout.strip().split("\n") if "\n" in out.stdout.strip() else (out.stdout.strip(), "")
    return float(took), heavy.split()


def checkout(ref: str) -> Path:
    """The package at `ref` in a temporary directory (git archive: no work tree touched)."""
    dest = Path(tempfile.mkdtemp(prefix="m2d-worker-start-"))
    archive = subprocess.run(["git", "archive", ref, "m2d_ray"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="eacf559", help="the commit to compare with (default: before issue 53)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    base = checkout(args.base)
    print(f"load {os.getloadavg()[0]:.2f} at the start; min of {args.runs} fresh interpreters each")
    print(f"| unit | module | {args.base} s | now s | ratio | heavy at {args.base} | heavy now |")
    print("|---|---|---:|---:|---:|---|---|")
    for unit, module in UNITS.items():
        then, now = [], []
        for _ in range(args.runs):  # interleaved: the machine's drift falls on both
            then.append(probe(base, module))
            now.append(probe(REPO, module))
        t0, t1 = min(t for t, _ in then), min(t for t, _ in now)
        h0, h1 = " ".join(then[0][1]) or "-", " ".join(now[0][1]) or "-"
        print(f"| {unit} | `{module}` | {t0:.2f} | {t1:.2f} | {t0 / t1:.1f}x | {h0} | {h1} |", flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at the end ({time.strftime('%H:%M')})")


if __name__ == "__main__":
    main()
