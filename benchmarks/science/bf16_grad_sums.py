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
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import free_port, machine_line
from benchmarks.perf import distill_step as p7


def summed_gradient_error(preset: str, accum: int, rank: int, world: int, tokens: int, same: bool) -> float:
    """Relative 2-norm error of the gradient DistillStep's optimizer reads against the float64 sum of the
    micro-batches' own bfloat16 gradients (means over `world` ranks, each reading its own batches)."""
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.precision import PRECISIONS
    from m2d_ray.distill.step import DistillStep, StudentLoss, cast_parameters, param_groups, teacher_outputs

    p = p7.PRESETS[preset]
    torch.manual_seed(0)
    teacher, student = p7.build_models(p, torch.float32)
    model = teacher.model.to(torch.bfloat16)
    head = model.get_output_embeddings().weight.detach()
    g = torch.Generator().manual_seed(1 + rank)
    n = 1 if same else accum
    ids = [torch.randint(0, p["vocab"], (1, tokens), generator=g) for _ in range(n)]
    mbs = [ids[i % n] for i in range(accum)]
    cfg = DistillConfig(steps=2, warmup_steps=1, batch_size=1, seq_len=tokens, grad_accum=accum, deepspeed=False)
    cfg = DistillConfig(**{**cfg.__dict__, "grad_clip": 1e30})  # no clipping: the sum itself
    copy_ = copy.deepcopy(student)
    trainer = DistillStep(student.train(), model, cfg, "cpu", world, PRECISIONS["bf16-mixed"], head=head)
    seen: list[torch.Tensor] = []
    step = trainer.opt.step

    def record(*a, **k):
        seen.extend(m.grad.detach().double().clone() for m in trainer.trained)
        return step(*a, **k)

    trainer.opt.step = record
    trainer.step(mbs)
    cast_parameters(copy_, torch.bfloat16)
    loss_module = StudentLoss(copy_.train(), cfg)
    params = [q for group in param_groups(copy_, 0.0) for q in group["params"]]  # the optimizer's order
    exact = [torch.zeros_like(q, dtype=torch.float64) for q in params]
    for mb in mbs:
        t_last, _ = teacher_outputs(model, mb, False)
        grads = torch.autograd.grad(loss_module(mb, t_last, head) / accum, params)
        for e, gr in zip(exact, grads):
            e += gr.double()
    flat = torch.cat([e.flatten() for e in exact])
    if world > 1:
        dist.all_reduce(flat)
        flat /= world
    got = torch.cat([x.flatten() for x in seen])
    return float((got - flat).norm() / flat.norm())


def _main(rank: int, world: int, port: int, args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        err = summed_gradient_error(args[0], args[1], rank, world, *args[2:])
        if rank == 0:
            Path(out).write_text(json.dumps(err))
    finally:
        dist.destroy_process_group()


def measure(preset: str, accum: int, world: int, tokens: int, same: bool, work: Path) -> float:
    """`summed_gradient_error` on one rank (in this process) or over a gloo group of `world`."""
    if world == 1:
        return summed_gradient_error(preset, accum, 0, 1, tokens, same)
    out = work / f"err-{accum}-{world}.json"
    mp.spawn(_main, args=(world, free_port(), (preset, accum, tokens, same), str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smoke", choices=sorted(p7.PRESETS))
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
            err = measure(a.preset, accum, world, a.tokens, a.same, work)
            rows.append({"world": world, "accum": accum, "error": err})
            print(f"| {world} | {accum} | {err:.1e} |", flush=True)
    print(machine_line(), file=sys.stderr)
    print(json.dumps({"args": vars(a), "rows": rows}))


if __name__ == "__main__":
    main()
