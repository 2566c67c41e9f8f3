"""The teacher once (stage2.targets hidden / topk / sampled, or auto where the plan has a teacher store its states):
before any student starts, a Ray Data pass of each such teacher the students distil from (the MoE teacher, and a
baseline's own) over the run's tokens, its outputs cached in the run's storage (runtime/shards.py:
STORAGE/tokens/<digest>, STORAGE/targets/<digest>); the students then load no teacher weights. Online, the stage is
not part of the run; under auto with no teacher storing its states, it has nothing to do.

A unit is one actor holding the teacher (whole, or a layer at a time: `memory.targets_pass`); its cost is each
teacher's forward over every training token (no head for hidden states), its storage the tokens x bytes per token
of every teacher. A killed pass resumes at its first missing shard; a run whose students are all distilled skips it.
"""

from __future__ import annotations

import math

from m2d_ray.catalog.targets import HIDDEN, ONLINE, blocks_per_shard
from m2d_ray.catalog.units import ACTOR
from m2d_ray.plan import memory
from m2d_ray.plan.cost import before
from m2d_ray.plan.devices import bundle
from m2d_ray.plan.flops import forward_flops, head_flops, student_tokens
from m2d_ray.plan.run_plan import teacher_pass
from m2d_ray.plan.targets import MOE
from m2d_ray.stages import baselines
from m2d_ray.stages.contract import Stage
from m2d_ray.stages.students import reads, taught, teacher_key, todo


class Targets(Stage):
    name = "targets"
    keys = "ray.data_gpus_per_actor / ray.data_accelerator"

    def wanted(self, cfg) -> bool:
        """With a cached mode, or auto (a teacher the plan has store its states; none: nothing to do, `finished`)."""
        return cfg.stage2.targets != ONLINE

    def request(self, cfg) -> dict:
        return bundle(1, cfg.ray.data_gpus_per_actor, cfg.ray.data_accelerator)

    def needs(self, p):
        """One actor of each storing teacher's pass (`targets`, `targets:<key>` for a baseline's own teacher)."""
        c, seq = p.cfg.calib, p.cfg.distill.seq_len
        return [
            teacher_pass(
                self.name if t.key == MOE else f"{self.name}:{t.key}",
                p,
                self.keys,
                lambda streamed, t=t: memory.targets_pass(
                    t.shape,
                    c.batch_size,
                    seq,
                    t.shape.dtype_bytes,
                    streamed,
                    p.per_token(t.shape, t.key),
                    p.choice(t.key).kind != HIDDEN,
                ),
            )
            for t in _stored(p)
        ]

    def storage(self, p):
        x, stored = p.cfg.distill, _stored(p)
        return (
            {"targets": x.blocks * x.seq_len * sum(p.per_token(t.shape, t.key) for t in stored)} if stored else {}
        ), {}

    def cost(self, c):
        """The MoE teacher's pass, then each baseline teacher's (new actors, Ray Data warm: no second round), as one
        row; none when no teacher stores its targets."""
        p, r = c.p, c.p.cfg.ray
        passes = [
            c.stage(
                self.name,
                _pass(p, t),
                c.place(self.name, r.data_gpus_per_actor, r.threads_per_worker, r.data_actors, r.data_accelerator),
                ACTOR,
                rounds=int(i == 0),
            )
            for i, t in enumerate(_stored(p))
        ]
        if not passes:
            return []
        row = passes[0]
        for later in passes[1:]:
            row = before(later, row)
        return [row]

    def finished(self, ctx) -> bool:
        t = todo(ctx.rd, ctx.cfg)
        return not any(ctx.choice(teacher_key(s)).stores for s in t.pending)

    def run(self, ctx) -> None:

        pending = {s.baseline for s in todo(ctx.rd, ctx.cfg).pending}
        ctx.ray()
        with ctx.waiting(self) as waiting:
            reads(ctx, waiting, [b for b in baselines.of(ctx.cfg) if b.name in pending])


def _stored(p) -> list:
    """The teachers whose targets are cached (`students.Taught`): the MoE teacher, then each baseline's own."""
    return [t for t in taught(p) if p.choice(t.key).stores]


def _pass(p, t) -> list[float]:
    """The FLOPs of each actor of teacher `t`'s pass over the run's tokens: its forward (no head for hidden states),
    split over the actors that have a shard to compute (ray.data_actors, at most the shards)."""
    x = p.cfg.distill
    shards = math.ceil(x.blocks / blocks_per_shard(x.seq_len, p.per_token(t.shape, t.key)))
    actors = max(1, min(p.cfg.ray.data_actors, shards))
    hidden = p.choice(t.key).kind == HIDDEN
    f = student_tokens(p.cfg) * (forward_flops(t.shape, x.seq_len) - (head_flops(t.shape) if hidden else 0.0))
    return [f / actors] * actors


STAGE = Targets()
