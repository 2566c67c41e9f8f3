"""The teacher once (stage2.targets hidden / topk / sampled): before any student starts, a Ray Data pass of each
teacher the students distil from (the MoE teacher, and a baseline's own) over the run's tokens, its outputs cached in
the run's storage (stages/shards.py: STORAGE/tokens/<digest>, STORAGE/targets/<digest>); the students then load no
teacher weights. Online, the stage is not part of the run.

A unit is one actor holding the teacher (whole, or a layer at a time: `memory.targets_pass`); its cost is each
teacher's forward over every training token (no head for hidden states), its storage the tokens x bytes per token
of every teacher. A killed pass resumes at its first missing shard; a run whose students are all distilled skips it.
"""

from __future__ import annotations

import math

from m2d_ray.distill.targets import blocks_per_shard
from m2d_ray.plan import memory
from m2d_ray.plan.cost import before, forward_flops, head_flops, student_tokens
from m2d_ray.plan.devices import bundle
from m2d_ray.plan.run_plan import teacher_pass
from m2d_ray.stages import baselines
from m2d_ray.stages.contract import Stage
from m2d_ray.stages.students import reads, todo


class Targets(Stage):
    name = "targets"
    keys = "ray.data_gpus_per_actor / ray.data_accelerator"

    def wanted(self, cfg) -> bool:
        return cfg.target_spec() is not None

    def request(self, cfg) -> dict:
        return bundle(1, cfg.ray.data_gpus_per_actor, cfg.ray.data_accelerator)

    def needs(self, p):
        c, t, seq = p.cfg.calib, p.models.teacher, p.cfg.distill.seq_len
        per_token, logits = p.per_token(t), not p.spec.exact
        return [
            teacher_pass(
                self.name,
                p,
                self.keys,
                lambda streamed: memory.targets_pass(t, c.batch_size, seq, t.dtype_bytes, streamed, per_token, logits),
            )
        ]

    def storage(self, p):
        x = p.cfg.distill
        return {"targets": x.blocks * x.seq_len * sum(p.per_token(t) for t in _teachers(p))}, {}

    def cost(self, c):
        """The MoE teacher's pass, then each baseline teacher's (new actors, Ray Data warm: no second round), as one
        row."""
        p, r = c.p, c.p.cfg.ray
        passes = [
            c.stage(
                self.name,
                _pass(p, t),
                c.place(self.name, r.data_gpus_per_actor, r.threads_per_worker, r.data_actors, r.data_accelerator),
                p.cfg.plan.actor_s,
                rounds=int(i == 0),
            )
            for i, t in enumerate(_teachers(p))
        ]
        row = passes[0]
        for later in passes[1:]:
            row = before(later, row)
        return [row]

    def finished(self, ctx) -> bool:

        return not todo(ctx.rd, ctx.cfg).pending

    def run(self, ctx) -> None:

        pending = {s.baseline for s in todo(ctx.rd, ctx.cfg).pending}
        ctx.ray()
        with ctx.waiting(self) as waiting:
            reads(ctx, waiting, [b for b in baselines.of(ctx.cfg) if b.name in pending])


def _teachers(p) -> list:
    """The shapes of every teacher with a pass: the MoE teacher, then each baseline's own (the MoE teacher's shape when
    its config cannot be read here)."""
    return [p.models.teacher] + [
        p.teachers.get(b.teacher_key, p.models.teacher) for b in baselines.of(p.cfg) if b.has_teacher
    ]


def _pass(p, teacher) -> list[float]:
    """The FLOPs of each actor of `teacher`'s pass over the run's tokens: its forward (no head for hidden states),
    split over the actors that have a shard to compute (ray.data_actors, at most the shards)."""

    x = p.cfg.distill
    actors = max(1, min(p.cfg.ray.data_actors, math.ceil(x.blocks / blocks_per_shard(x.seq_len, p.per_token(teacher)))))
    f = student_tokens(p.cfg) * (
        forward_flops(teacher, x.seq_len) - (head_flops(teacher) if p.mode == "hidden" else 0.0)
    )
    return [f / actors] * actors


STAGE = Targets()
