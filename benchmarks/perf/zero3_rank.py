"""A ZeRO-3 rank of the 22B student of Qwen3-235B-A22B against the plan, counted on `meta` (no GPU, no weights).

The plan's rank (plan/memory.training at ZeRO-3) beside what the real modules and tensors hold at that shape:
* the partitions: every parameter of the student built on `meta` split over the W ranks as DeepSpeed's ZeRO-3 pads
  it (ceil(numel / W) each): its b-byte weights, its float32 gradient partition and float32 masters and Adam moments;
* the reduce bucket: DeepSpeed's own default reduce_bucket_size (its config model), b-byte and float32 copies;
* what is gathered whole: the largest decoder layer (running) and the next (prefetched), and the output head the KL
  reads, from the modules' own parameters;
* activations and the KL's buffers: one micro-batch's forward, chunked KL and backward on `meta` under the plan's
  checkpointing, their peak counted by paper_step.LiveBytes (issue 61's rehearsal), each parameter's gradient freed
  as it is formed (ZeRO-3 reduce-scatters it into the float32 partition counted above).

    python -m benchmarks.perf.zero3_rank [--world 8] [--checkpointing full]

prints one JSON line: each part planned and counted, and the total's ratio (the plan is held within 15%).
"""

from __future__ import annotations

import argparse
import json

import torch

from m2d_ray.plan import memory
from m2d_ray.plan.shapes import models_of
from workshop.random_models import SHAPE, preset_config

#: the 22B student of Qwen3-235B-A22B (m2d_ray/experiments/configs/Qwen--Qwen3-235B-A22B) at the paper's micro-batch
#: (4 x 4096 tokens); its teacher built with one layer (the rehearsal holds the student, the teacher's head only)
PRESET = dict(
    zip(SHAPE, (4096, 94, 64, 4, 128, 128, 1536, 8, 151936)),
    device="meta",
    seq_len=4096,
    batch=4,
    teacher_layers=1,
)


def count(world: int, policy: str) -> dict:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from benchmarks.perf.paper_step import gpu_like_meta, rehearse
    from workshop.random_models import teacher_and_student

    torch.set_num_threads(1)
    b, tokens = 2, PRESET["batch"] * PRESET["seq_len"]
    _, student = teacher_and_student(PRESET, torch.bfloat16, device="meta")
    params = {id(p): p for p in student.parameters()}.values()
    part = sum(-(-p.numel() // world) for p in params)
    bucket = min(sum(p.numel() for p in params), DeepSpeedZeroConfig().reduce_bucket_size) * (b + 4)
    layers = [sum(p.numel() for p in m.parameters()) for m in student.model.layers]
    head = student.get_output_embeddings().weight.numel()
    counted = {
        "student": part * b,
        "gathered": (2 * max(layers) + head) * b,
        "grads": part * 4 + bucket,
        "optimizer": part * 12,
    }
    with gpu_like_meta():
        counted["activations + kl"] = rehearse(PRESET, policy, drop_grads=True)["peak_bytes"]
    shape = models_of(preset_config(PRESET)).student
    planned = memory.training(shape, tokens, b, world, True, 3, policy, 1024, masters=True)
    planned["activations + kl"] = planned.pop("activations") + planned.pop("kl")
    total_p, total_c = sum(planned.values()), sum(counted.values())
    return {
        "world": world,
        "checkpointing": policy,
        "student_params": shape.params,
        "planned_gib": {k: round(v / 2**30, 2) for k, v in planned.items()},
        "counted_gib": {k: round(v / 2**30, 2) for k, v in counted.items()},
        "planned_total_gib": round(total_p / 2**30, 2),
        "counted_total_gib": round(total_c / 2**30, 2),
        "ratio": round(total_p / total_c, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--checkpointing", default="full", choices=("none", "selective", "full"))
    a = ap.parse_args()
    print(json.dumps(count(a.world, a.checkpointing)))


if __name__ == "__main__":
    main()
