"""Calibration: one Ray Data pass of the teacher over the calibration text records, per MoE layer, the router's
softmax over all E experts, its top-k and every expert's output on every token (calibrate/ray_data.py).

    Ray Data actor pool (ray.data_actors)   each holds the teacher (whole, or one layer at a time) and returns
                                            a block's partial sums; the driver adds them in float64
    RUN_DIR/stats/                          the statistics artifact; reused when teacher and tokens match

It needs one teacher per actor (`memory.calibration`), costs the teacher with every expert on every token plus
each MoE layer's E x E Gram, and leaves the float64 statistics. Stage 1 is its only reader: a finished stage 1
makes it finished too.
"""

from __future__ import annotations

from m2d_ray.catalog.units import ACTOR
from m2d_ray.console import say
from m2d_ray.plan import memory
from m2d_ray.plan.devices import bundle
from m2d_ray.plan.flops import calibration_flops
from m2d_ray.plan.run_plan import teacher_pass
from m2d_ray.stages.contract import Stage

# Imported inside functions: Ray (`m2d plan` and the checks read this module without importing it).


class Calibrate(Stage):
    name = "calibrate"
    keys = "ray.data_gpus_per_actor / ray.data_accelerator"

    def reads(self, cfg) -> dict[str, str]:
        from m2d_ray.calibrate.tokens import resolve_calib

        return {"calib.data": resolve_calib(cfg.calib.data, cfg.model)}

    def check(self, cfg, teacher: str) -> None:
        from m2d_ray.calibrate.tokens import resolve_calib
        from m2d_ray.data.text import check_spec

        check_spec(resolve_calib(cfg.calib.data, cfg.model), "calib.data")

    def request(self, cfg) -> dict:
        return bundle(1, cfg.ray.data_gpus_per_actor, cfg.ray.data_accelerator)

    def needs(self, p):
        c, t, gpu = p.cfg.calib, p.models.teacher, p.cfg.ray.data_gpus_per_actor > 0
        return [
            teacher_pass(
                self.name,
                p,
                self.keys,
                lambda streamed: memory.calibration(t, c.batch_size, c.seq_len, t.dtype_bytes, streamed, gpu),
            )
        ]

    def storage(self, p):
        t = p.models.teacher
        return {"statistics": t.layers * (t.experts**2 + 4 * t.experts + 2) * 8}, {}

    def cost(self, c):
        cfg = c.p.cfg
        r = cfg.ray
        flops = cfg.calib.max_tokens * calibration_flops(c.p.models.teacher, cfg.calib.seq_len)
        where = c.place(self.name, r.data_gpus_per_actor, r.threads_per_worker, r.data_actors, r.data_accelerator)
        return [c.stage(self.name, [flops / r.data_actors] * r.data_actors, where, ACTOR)]

    def finished(self, ctx) -> bool:
        return ctx.rd.promotions.exists()  # stage 1 read the statistics already

    def run(self, ctx) -> None:
        from m2d_ray.calibrate.ray_data import calibrate_ray
        from m2d_ray.calibrate.tokens import calibration_tokens
        from m2d_ray.models import load_tokenizer

        cfg, c, r = ctx.cfg, ctx.cfg.calib, ctx.cfg.ray
        ctx.ray()
        spec, tokens = calibration_tokens(load_tokenizer(ctx.teacher), c.data, cfg.model, c.seq_len, c.max_tokens)
        with ctx.waiting(self) as waiting:
            art, reused = waiting.call(
                calibrate_ray,
                ctx.teacher,
                tokens,
                spec,
                ctx.rd.stats,
                batch_size=c.batch_size,
                actors=r.data_actors,
                gpus_per_actor=r.data_gpus_per_actor,
                accelerator=r.data_accelerator,
                threads=r.threads_per_worker,
                load_from=ctx.workers_teacher,
                stream=c.stream,
                max_memory=c.max_memory,
            )
        say(
            f"statistics: {'reused' if reused else 'computed'} {art.manifest['n_tokens']} tokens, sha256 "
            f"{art.checksum[:12]}"
        )


STAGE = Calibrate()
