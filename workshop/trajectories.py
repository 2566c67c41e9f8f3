"""Stage 2's loss trajectories per path and precision policy, and the error of the gradient its optimizer reads:
the runs tests/unit/test_precision.py holds and benchmarks/science (precision_trajectories, bf16_grad_sums) print.

Two training paths agree when their loss *trajectories* agree (Adam's first step is blind to a gradient's scale):
each run trains a random-FFN student of a `random_models.STEP_PRESETS` teacher on the same global batches, one rank
in this process or a gloo group of ranks (`local_group`), and returns its losses, the means over its ranks.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from m2d_ray.config import DistillConfig
from m2d_ray.distill.precision import PRECISIONS
from m2d_ray.distill.sharded_teacher import shard_loaded
from m2d_ray.distill.step import DistillStep, StudentLoss, cast_parameters, param_groups, teacher_outputs
from workshop.local_group import gloo_rank, spawn
from workshop.random_models import STEP_PRESETS, teacher_and_student

ONE_RANK = [(p, x) for p in ("plain", "deepspeed") for x in ("fp32", "bf16-mixed")] + [("plain", "bf16-pure")]
TWO_RANKS = [(p, x) for p in ("ddp", "deepspeed", "sharded") for x in ("fp32", "bf16-mixed")]


def gap(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two loss trajectories, step by step."""
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@dataclass(frozen=True)
class Sizes:
    """A run's sizes: `steps` steps of `batch` global sequences of `seq` tokens, in `accum` micro-batches a step, on
    the models of a STEP_PRESETS `preset`, the teacher's head scaled by `sharpen` (a teacher as sure of its tokens
    as a trained one)."""

    steps: int
    batch: int
    seq: int
    preset: str = "cpu"
    accum: int = 1
    sharpen: float = 1.0


def batches(s: Sizes) -> torch.Tensor:
    """[steps, accum, batch, seq] ids: each step's `accum` micro-batches of `batch` global sequences."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, STEP_PRESETS[s.preset]["vocab"], (s.steps, s.accum, s.batch, s.seq), generator=g)


def trajectory(path: str, precision: str, rank: int, world: int, s: Sizes) -> list[float]:
    """`path`'s losses (means over the ranks and micro-batches), this rank reading its share of each global
    micro-batch. plain / ddp: DistillStep without DeepSpeed (with master weights, their float32 sums in place of
    DDP); deepspeed: ZeRO-2; sharded: plain beside an FSDP2-sharded teacher; gradsum: not a trajectory but the
    summed gradient's error in this group (`summed_gradient_error`)."""
    if path == "gradsum":
        return [summed_gradient_error(s.preset, s.accum, rank, world, s.seq, False)]
    policy = PRECISIONS[precision]
    torch.manual_seed(0)
    teacher, student = teacher_and_student(STEP_PRESETS[s.preset], torch.float32)
    model = teacher.model.to(policy.dtype)  # the teacher computes in the policy's dtype, as distill/loop.py loads it
    head = model.get_output_embeddings().weight.detach()
    head.mul_(s.sharpen)  # a random head's logits are nearly uniform (std ~0.02 sqrt(d)): a loss of ~1e-4 is noise
    if path == "sharded":
        shard_loaded(model, teacher.adapter.layers(model), "cpu")
    cfg = DistillConfig(
        steps=s.steps,
        warmup_steps=max(1, s.steps // 4),
        batch_size=s.batch // world,
        seq_len=s.seq,
        grad_accum=s.accum,
        deepspeed=path == "deepspeed",
    )
    trainer = DistillStep(student.train(), model, cfg, "cpu", world, policy, head=head)
    losses = []
    share = slice(rank * s.batch // world, (rank + 1) * s.batch // world)
    for b in batches(s):
        trainer.step([mb[share] for mb in b])
        losses.append(trainer.take_loss())
    return losses


def _group_main(rank: int, world: int, port: int, runs: list, sizes: Sizes, out: str) -> None:
    with gloo_rank(rank, world, port):
        result = {f"{path}/{x}": trajectory(path, x, rank, world, sizes) for path, x in runs}
        if rank == 0:
            Path(out).write_text(json.dumps(result))


def run_group(world: int, runs: list[tuple[str, str]], out: Path, *sizes) -> dict:
    """{"path/precision": losses} of `runs`, each trained by a group of `world` gloo processes at `sizes` (the
    fields of `Sizes`, in order), the group's result written to `out`."""
    spawn(_group_main, world, runs, Sizes(*sizes), str(out))
    return json.loads(out.read_text())


def summed_gradient_error(preset: str, accum: int, rank: int, world: int, tokens: int, same: bool) -> float:
    """Relative 2-norm error of the gradient DistillStep's optimizer reads (bf16-mixed, plain path, learning rate
    moot, no clipping) against the float64 sum of the micro-batches' own bfloat16 gradients (means over `world`
    ranks, each reading its own batches; `same`: one micro-batch repeated `accum` times)."""
    p = STEP_PRESETS[preset]
    torch.manual_seed(0)
    teacher, student = teacher_and_student(p, torch.float32)
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


def _error_main(rank: int, world: int, port: int, args: tuple, out: str) -> None:
    with gloo_rank(rank, world, port):
        err = summed_gradient_error(args[0], args[1], rank, world, *args[2:])
        if rank == 0:
            Path(out).write_text(json.dumps(err))


def gradient_error(preset: str, accum: int, world: int, tokens: int, same: bool, work: Path) -> float:
    """`summed_gradient_error` on one rank (in this process) or over a gloo group of `world` (written under `work`)."""
    if world == 1:
        return summed_gradient_error(preset, accum, 0, 1, tokens, same)
    out = work / f"err-{accum}-{world}.json"
    spawn(_error_main, world, (preset, accum, tokens, same), str(out))
    return json.loads(out.read_text())
