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
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import free_port, machine_line
from benchmarks.perf import distill_step as p7

ONE_RANK = [(p, x) for p in ("plain", "deepspeed") for x in ("fp32", "bf16-mixed")] + [("plain", "bf16-pure")]
TWO_RANKS = [(p, x) for p in ("ddp", "deepspeed", "sharded") for x in ("fp32", "bf16-mixed")]


def gap(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two loss trajectories, step by step."""
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def batches(steps: int, batch: int, seq: int, preset: str = "cpu", accum: int = 1) -> torch.Tensor:
    """[steps, accum, batch, seq] ids: each step's `accum` micro-batches of `batch` global sequences."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, p7.PRESETS[preset]["vocab"], (steps, accum, batch, seq), generator=g)


def trajectory(
    path: str,
    precision: str,
    rank: int,
    world: int,
    steps: int,
    batch: int,
    seq: int,
    preset: str = "cpu",
    accum: int = 1,
    sharpen: float = 1.0,
) -> list[float]:
    """`path`'s losses (means over the ranks and micro-batches), this rank reading its share of each global
    micro-batch, `accum` micro-batches a step. plain / ddp: DistillStep without DeepSpeed (with master weights, their
    float32 sums in place of DDP); deepspeed: ZeRO-2; sharded: plain beside an FSDP2-sharded teacher."""
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.precision import PRECISIONS
    from m2d_ray.distill.sharded_teacher import shard_loaded
    from m2d_ray.distill.step import DistillStep

    if path == "gradsum":  # not a trajectory: the summed gradient's error in this group (science/bf16_grad_sums.py)
        from benchmarks.science import bf16_grad_sums as grad_sums

        return [grad_sums.summed_gradient_error(preset, accum, rank, world, seq, False)]
    policy = PRECISIONS[precision]
    torch.manual_seed(0)
    teacher, student = p7.build_models(p7.PRESETS[preset], torch.float32)
    model = teacher.model.to(policy.dtype)  # the teacher computes in the policy's dtype, as distill/loop.py loads it
    head = model.get_output_embeddings().weight.detach()
    head.mul_(sharpen)  # a random head's logits are nearly uniform (std ~0.02 sqrt(d)): a loss of ~1e-4 is all noise
    if path == "sharded":
        shard_loaded(model, teacher.adapter.layers(model), "cpu")
    cfg = DistillConfig(
        steps=steps,
        warmup_steps=max(1, steps // 4),
        batch_size=batch // world,
        seq_len=seq,
        grad_accum=accum,
        deepspeed=path == "deepspeed",
    )
    trainer = DistillStep(student.train(), model, cfg, "cpu", world, policy, head=head)
    losses = []
    share = slice(rank * batch // world, (rank + 1) * batch // world)
    for b in batches(steps, batch, seq, preset, accum):
        trainer.step([mb[share] for mb in b])
        losses.append(trainer.take_loss())
    return losses


def _group_main(rank: int, world: int, port: int, runs: list, sizes: tuple, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {f"{path}/{x}": trajectory(path, x, rank, world, *sizes) for path, x in runs}
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_group(
    world: int,
    runs: list[tuple[str, str]],
    out: Path,
    steps: int,
    batch: int,
    seq: int,
    preset: str = "cpu",
    accum: int = 1,
    sharpen: float = 1.0,
) -> dict:
    """{"path/precision": losses} of `runs`, each trained by a group of `world` gloo processes (`sharpen`: the
    teacher's head scaled by it, for a teacher as sure of its tokens as a trained one)."""
    sizes = (steps, batch, seq, preset, accum, sharpen)
    mp.spawn(_group_main, args=(world, free_port(), runs, sizes, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=2, help="global sequences per step (even: two ranks split it)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--preset", default="cpu", choices=sorted(p7.PRESETS), help="P7's model shapes (default cpu)")
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
