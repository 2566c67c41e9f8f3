"""The gradient stage 2's optimizer reads in bf16-mixed, against the exact sum of the same micro-batch gradients
(issue 52): what a sum in bfloat16 loses over micro-batches and ranks, and what the platform's float32 sums keep.

P7's models at a preset (default `smoke`), the student in bfloat16 with float32 masters (`DistillStep`, plain path;
over `--world` gloo ranks its float32 all-reduce), learning rate 0 and no clipping: each step's micro-batches are
`--accum` different batches of ids (or one batch repeated: `--same`). The gradient the optimizer is handed is
compared with the sum in float64 of the bfloat16 gradients each micro-batch produces on each rank (autograd of the
same loss module on a copy of the student), divided by the ranks as DDP does: the relative error of the whole
gradient (its 2-norm). A bfloat16 sum's error grows with the count; a float32 sum's stays ~1e-7.

    python -m benchmarks.science.bf16_grad_sums                       # 1 rank x 12 micro-batches, and 2 ranks x 12
    python -m benchmarks.science.bf16_grad_sums --accum 4,16,64 --world 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.common import machine_line
from workshop.random_models import STEP_PRESETS
from workshop.trajectories import gradient_error


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smoke", choices=sorted(STEP_PRESETS))
    ap.add_argument("--accum", default="12", help="comma-separated micro-batch counts")
    ap.add_argument("--world", default="1,2", help="comma-separated gloo world sizes")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per micro-batch")
    ap.add_argument("--same", action="store_true", help="one micro-batch repeated (the issue's 12 identical ones)")
    ap.add_argument("--work", default="/tmp/m2d-grad-sums")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    print(machine_line(), file=sys.stderr)
    rows = []
    print("| ranks | micro-batches | relative error of the summed gradient |\n|---:|---:|---:|")
    for world in (int(x) for x in a.world.split(",")):
        for accum in (int(x) for x in a.accum.split(",")):
            err = gradient_error(a.preset, accum, world, a.tokens, a.same, work)
            rows.append({"world": world, "accum": accum, "error": err})
            print(f"| {world} | {accum} | {err:.1e} |", flush=True)
    print(machine_line(), file=sys.stderr)
    print(json.dumps({"args": vars(a), "rows": rows}))


if __name__ == "__main__":
    main()
