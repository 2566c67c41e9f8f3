"""Stage 2's loss trajectories per path and precision policy (issue 47): what tests/unit/test_precision.py holds.

P7's `cpu` preset models (a random Qwen3-MoE teacher, 16 experts, and its random-FFN student), `--steps` steps at the
paper's learning rate (1e-4, cosine to 1e-5), the same global batches for every run. One rank (plain torch,
DeepSpeed ZeRO-2) and two gloo ranks (DDP, DeepSpeed ZeRO-2, DDP beside an FSDP2-sharded teacher), each in fp32,
bf16-mixed and (one rank, plain) bf16-pure; each run's losses are the means over its ranks. Printed: every run's gap
to its path's float32 trajectory (the largest relative difference at any step) and the float32 paths' gaps to each
other.

    python -m benchmarks.science.precision_trajectories  # the test's sizes: 20 steps of 2 x 32 tokens
    python -m benchmarks.science.precision_trajectories --seq 256 --batch 4  # P7's cpu batch (bf16 is ~5x slower on
        CPUs)
    python -m benchmarks.science.precision_trajectories --preset smoke --accum 12   # grad_accum 12 (issue 52), smoke
        shapes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import machine_line
from workshop.random_models import STEP_PRESETS
from workshop.trajectories import ONE_RANK, TWO_RANKS, gap, run_group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=2, help="global sequences per step (even: two ranks split it)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--preset", default="cpu", choices=sorted(STEP_PRESETS), help="P7's model shapes (default cpu)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches a step (distill.grad_accum)")
    ap.add_argument("--sharpen", type=float, default=1.0, help="the teacher's head scaled by it (default 1)")
    ap.add_argument("--work", default="/tmp/m2d-precision")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    print(machine_line(), file=sys.stderr)
    groups = {
        "": run_group(1, ONE_RANK, work / "w1.json", a.steps, a.batch, a.seq, a.preset, a.accum, a.sharpen),
        " x2": run_group(2, TWO_RANKS, work / "w2.json", a.steps, a.batch, a.seq, a.preset, a.accum, a.sharpen),
    }
    runs = {name + world: losses for world, group in groups.items() for name, losses in group.items()}
    rows = [
        {"run": name + world, "gap_to_fp32": gap(losses, group[name.split("/")[0] + "/fp32"]), "last": losses[-1]}
        for world, group in groups.items()
        for name, losses in group.items()
    ]
    ones = {"deepspeed vs plain, fp32": gap(runs["deepspeed/fp32"], runs["plain/fp32"])}
    ones["deepspeed vs ddp, fp32, 2 ranks"] = gap(runs["deepspeed/fp32 x2"], runs["ddp/fp32 x2"])
    ones["ddp (2 ranks) vs plain (1), fp32"] = gap(runs["ddp/fp32 x2"], runs["plain/fp32"])
    print("| run | largest gap to its fp32 trajectory | last loss |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['gap_to_fp32']:.2%} | {r['last']:.6f} |")
    print("\n| float32 paths | largest gap |\n|---|---:|")
    for k, v in ones.items():
        print(f"| {k} | {v:.1e} |")
    print(machine_line(), file=sys.stderr)
    print(json.dumps({"sizes": vars(a), "runs": runs, "rows": rows, "fp32": ones}))


if __name__ == "__main__":
    main()
