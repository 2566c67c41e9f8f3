"""Stage 2: distil the promoted student of every (scoring, grouping) pair, and the baselines, under one budget.

    RUN_DIR/promotions.json (stage 1)     the best (K, scaling) per pair, best pre-distillation ppl first
    the baselines' preparation            before the students, on Ray (the d2d search: stages/baselines/)
    one DistillJob per student            built here: what it trains on and with what (distill/loop.py); rank 0 of
                                          its Ray Train worker group builds the initial student into the run's
                                          storage, every rank reads it from there
    one Tune trial per student            fits its TorchTrainer (stage2_tune.py); ASHA on validation loss stops
                                          poor students early (decisions on a StopBoard actor)
    ledger + MLflow (driver callback)     RUN_DIR/stage2/trials/*.json; nested runs with loss curves
    table                                 RUN_DIR/stage2.csv, stage2.md, stage2_curves.png

A unit is one rank of a student (`memory.student_rank`): the student under ZeRO-2, and of its teacher all of it
(online), 1/workers of it and a gathered layer (online, sharded: distill/sharded_teacher.py), its output head (hidden
states) or a micro-batch of cached targets, as each teacher's targets say (plan/targets.py; `auto`: the plan's).
Nothing a worker reads comes from the driver's disk: the teacher and the text go through the run's storage, each job
travels with its trial.
Resume skips students in the ledger and retries failed ones from their last checkpoint (same Train run name and
storage); a trial whose node is lost is retried by Tune up to `ray.max_failures` times.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from m2d_ray.catalog.units import STUDENT
from m2d_ray.config import dump_config, load_config
from m2d_ray.console import say
from m2d_ray.distill.precision import deepspeed_refusal, resolve
from m2d_ray.errors import M2DError
from m2d_ray.plan import memory
from m2d_ray.plan.cost import before
from m2d_ray.plan.devices import bundle
from m2d_ray.plan.flops import forward_flops, stage2_flops, student_tokens, trained
from m2d_ray.plan.run_plan import unit
from m2d_ray.plan.targets import MOE, gather_seconds, read_bandwidth
from m2d_ray.report.page import render
from m2d_ray.report.run import curves_figure, figure
from m2d_ray.report.stage2 import write_stage2
from m2d_ray.stages import baselines
from m2d_ray.stages.baselines import BASELINES, BaselineFailed
from m2d_ray.stages.contract import Section, Stage
from m2d_ray.stages.grid import plan_of
from m2d_ray.stages.students import copy_duplicates, reads, taught, teacher_key, todo

# Imported inside functions: Ray, torch (`m2d plan` and the checks read this module without importing them).

STAGE1_KEYS = ("model", "calib", "grid")  # what decided the promotions: stage 2 must not change them
STAGE2_KEYS = ("distill", "stage2")  # what a started stage 2 must keep (ray, mlflow, stage3 may change)


@dataclass(frozen=True)
class Stage2Result:
    records: list[dict]  # the ledger's


class Stage2(Stage):
    name = "stage2"
    keys = "distill.gpus_per_worker / distill.cpus_per_worker / distill.accelerator"

    def check_config(self, cfg) -> None:

        baselines.of(cfg)  # known names
        for b in BASELINES:
            BASELINES[b].check_config(cfg)
        x = cfg.distill
        if x.uses_deepspeed:  # before any work: the engine's start refuses it too
            why = deepspeed_refusal(resolve(x.precision, gpu=x.gpus_per_worker > 0).dtype_name, x.zero)
            if why:
                raise M2DError(why)

    def reads(self, cfg) -> dict[str, str]:
        own = {k: v for b in baselines.of(cfg) for k, v in b.reads(cfg).items()}
        return {
            "distill.train_data": cfg.distill.train_data,
            "distill.eval_data": cfg.distill.eval_data or cfg.eval.data,
            **own,
        }

    def check(self, cfg, teacher: str) -> None:

        from m2d_ray.data.text import check_spec
        from m2d_ray.distill.data import check_source
        from m2d_ray.models import check_teacher_topk

        check_spec(cfg.distill.eval_data or cfg.eval.data, "distill.eval_data")
        check_teacher_topk(teacher, cfg.distill.teacher_topk)
        check_source(cfg.distill.train_data, cfg.distill)
        for b in baselines.of(cfg):
            b.check(cfg)

    def check_resume(self, rd, cfg) -> None:
        """Stage 1's settings unchanged (stage 2 distils that run's promotions), and a started stage 2's too."""
        saved1, new = load_config(rd.config).to_dict(), cfg.to_dict()
        changed = [k for k in STAGE1_KEYS if new[k] != saved1[k]]
        if changed:
            raise M2DError(
                f"{', '.join(changed)} differ from stage 1 of {rd}; stage 2 distils that run's promotions: use its "
                "config"
            )
        if rd.stage2_config.exists():
            saved2 = load_config(rd.stage2_config).to_dict()
            diff = [k for k in STAGE2_KEYS if new[k] != saved2[k]]
            if diff:
                raise M2DError(
                    f"stage 2 of {rd} was started with other settings ({', '.join(diff)}); resume it unchanged or use "
                    "a new run directory"
                )

    def request(self, cfg) -> dict:
        x = cfg.distill
        return bundle(x.cpus_per_worker, x.gpus_per_worker, x.accelerator)

    def needs(self, p):
        """One rank of a student of each teacher (`stage2` for the MoE teacher's, `stage2:<key>` for a baseline's own
        teacher's), holding what it holds of that teacher as the teacher's targets say (plan/targets.py)."""

        x = p.cfg.distill
        policy = resolve(x.precision, gpu=x.gpus_per_worker > 0)  # what distill/loop.py trains in
        rows = []
        for t in taught(p):
            c = p.choice(t.key)
            parts = memory.student_rank(
                p.models.student,
                t.shape,
                x.batch_size * x.seq_len,
                policy.weight_bytes,
                x.workers,
                x.uses_deepspeed,
                x.zero,
                x.checkpointing,
                x.loss_chunk,
                c.kind,
                p.per_token(t.shape, t.key),
                c.shard,
                masters=policy.masters,
            )
            name = self.name if t.key == MOE else f"{self.name}:{t.key}"
            rows.append(
                unit(
                    name,
                    "rank",
                    parts,
                    x.gpus_per_worker,
                    x.workers,
                    self.request(p.cfg),
                    p.devices,
                    _fix(p.cfg, parts),
                    self.keys,
                )  # fmt: skip
            )
        return rows

    def storage(self, p):
        """Every student's initial and distilled model and the token shards stay; each student's Train checkpoints
        stay too with stage2.keep_training_state, else only while it trains (those of the students at once)."""

        x, s = p.cfg.distill, p.models.student
        n = p.pairs + len(p.cfg.stage2.baselines)
        policy = resolve(x.precision, gpu=x.gpus_per_worker > 0)
        b_train = policy.weight_bytes
        low = b_train < 4 and (policy.masters or x.uses_deepspeed)  # float32 masters and moments in the state
        optimizer = (12 if low else 2 * b_train) * s.params
        per_student = x.keep_checkpoints * (s.params * b_train + optimizer)
        stays = {
            "initial students": n * s.params * s.dtype_bytes,
            "distilled students": n * s.params * b_train,
            "token shards": x.blocks * x.seq_len * 4 + (x.eval_max_tokens or 0) * 4,
        }
        if p.cfg.stage2.keep_training_state:
            return {**stays, "checkpoints": n * per_student}, {}
        return stays, {"checkpoints": min(n, p.students_at_once or n) * per_student}

    def cost(self, c):
        """Each student's steps and validations, up to where ASHA is expected to stop it (the dearest students paired
        with the longest runs: ASHA's order is the students' quality, unknown here), after the baselines'
        preparation. A student reading cached targets takes at least their reads at the storage's bandwidth; one of a
        sharded teacher adds its gathers (plan/targets.py)."""
        p = c.p
        x, m = p.cfg.distill, p.models
        students = sorted(
            (t for t in taught(p) for _ in range(t.students)), key=lambda t: -forward_flops(t.shape, x.seq_len)
        )
        reports = [n for n, k in reversed(p.ends) for _ in range(k)]
        where = c.place(
            self.name,
            x.workers * x.gpus_per_worker,
            x.workers * x.threads_per_worker,
            p.students_at_once or len(students),
            x.accelerator,
        )
        one_node = where.node is not None and x.workers * x.gpus_per_worker <= where.node.gpus
        flops, io, comm, work = [], [], [], []
        for t, n in zip(students, reports):
            choice, share = p.choice(t.key), trained(p.cfg, n)
            flops.append(stage2_flops(p.cfg, m, choice.kind, t.shape, n))
            read = share * student_tokens(p.cfg) * p.per_token(t.shape, t.key)
            io.append(read / read_bandwidth(p.cfg, p.storage_kind))
            comm.append(gather_seconds(p.cfg, t.shape, share * x.steps, one_node) if choice.shard else 0.0)
            work.append(choice.kind)  # a step's efficiency is its targets mode's (plan.efficiency)
        row = c.stage(self.name, flops, where, STUDENT, io_s=io, comm_s=comm, work=work)
        for b in baselines.of(p.cfg):
            first = b.prepare_cost(c)
            row = before(first, row) if first else row
        return [row]

    def run(self, ctx) -> Stage2Result:
        from m2d_ray.stages import stage2_tune as tuned

        cfg, rd = ctx.cfg, ctx.rd
        if not rd.stage2_config.exists():  # the settings a resumed stage 2 must keep
            dump_config(cfg, rd.stage2_config)
        parent = ctx.parent()
        ctx.tracker.log(
            parent, params={f"stage2.{k}": v for k, v in cfg.to_dict()["distill"].items()}
        )  # as written (MLflow params never change)
        out = ctx.recorder(rd.stage2_ledger(), tuned.mlflow_fields, prefix="stage2/")
        t = todo(rd, cfg)
        say(
            f"stage 2: {len(t.all)} students ({len(t.all) - len(cfg.stage2.baselines)} promoted + baselines), "
            f"{len(t.pending)} to distil"
            + (f", {len(t.duplicates)} repeating another's plan (distilled once)" if t.duplicates else "")
            + (f" ({t.retried} failed before: retried from their last checkpoint)" if t.retried else "")
        )
        drop = None if cfg.stage2.keep_training_state else tuned.TrainingStateDrop(ctx.store)
        if t.pending:
            ctx.ray()
            recorder = tuned.Recorder(
                {s.key: s for s in t.pending},
                out,
                {s.key: ctx.choice(teacher_key(s)).label for s in t.pending},
                cfg.ray.max_failures,
                drop,
            )
            with ctx.waiting(self) as waiting:
                pending, prepared = _prepare(ctx, waiting, t.pending, recorder)
                if pending:
                    data = reads(ctx, waiting, [BASELINES[s.baseline] for s in pending if s.baseline])
                    plans = rd.read_plans()["plans"] if any(s.baseline is None for s in pending) else {}
                    tuned.distil(ctx, pending, recorder, partial(_job, ctx, data, plans, prepared))
        copy_duplicates(out, t.all, t.duplicates)
        records = out.ledger.records()
        if drop is not None:  # also what a run killed between a ledger record and its removal left
            for r in records:
                if "duplicate_of" not in r:
                    drop(r)
            if drop.removed:
                say(
                    f"stage 2: the training state of {len(drop.removed)} students removed from storage "
                    "(stage2.keep_training_state=true keeps it)"
                )
        outputs = write_stage2(records, [s.key for s in t.all], rd.path)
        ctx.tracker.artifacts(parent, outputs)
        ctx.tracker.finish(parent)
        return Stage2Result(records)

    def sections(self, data) -> list[Section]:
        own = [s for b in baselines.of(data.cfg) for s in b.sections(data)]
        curves = figure("curves.png", "validation-loss curves", lambda path: curves_figure(data, path))
        return [*own, Section("Validation loss during distillation", render([curves]))]


def _fix(cfg, parts: dict) -> str:
    """What to change when a rank does not fit: the largest part says."""
    x = cfg.distill
    big = max(parts, key=parts.get)
    if big == "teacher":
        return (
            "stage2.targets=hidden (the teacher's final hidden states cached once: a rank holds its output head only), "
            "stage2.shard_teacher=true (a rank holds 1/workers of it and one layer at a time) or stage2.targets=auto "
            "(the cheapest of them that fits); the loss stays exact"
        )
    if big == "teacher shard":
        return f"more distill.workers (the teacher is sharded over them; now {x.workers}) or stage2.targets=hidden"
    if big == "activations" and x.checkpointing != "full":
        return "distill.checkpointing=full (or auto: the least recompute that fits)"
    if big in ("optimizer", "grads") and x.workers < 8:
        return f"more distill.workers (ZeRO-2 shards the optimizer over them; now {x.workers})"
    steps = "raise distill.grad_accum to keep the tokens per step"
    return f"a smaller distill.batch_size (now {x.batch_size}; {steps}) or a larger GPU"


def _prepare(ctx, waiting, pending: list, recorder) -> tuple[list, dict]:
    """Each pending baseline's preparation (the d2d search), before the students: (the students left, what each
    baseline prepared). A baseline whose preparation fails is that student's failure: recorded, the others go on."""
    prepared = {}
    for s in [s for s in pending if s.baseline]:
        b = BASELINES[s.baseline]
        own = b.teacher(ctx.cfg)
        try:
            prepared[b.name] = b.prepare(ctx, waiting, ctx.workers_teacher, ctx.store.put_model(own) if own else None)
        except BaselineFailed as exc:
            recorder.record(s.key, "failed", {}, error=str(exc))
            pending = [p for p in pending if p.key != s.key]
    return pending, prepared


def _job(ctx, data, plans: dict, prepared: dict, s, stop):
    """The DistillJob of student `s` (`stop`: its stop check): a promoted one built from its plan, a baseline by its
    own builder."""
    from m2d_ray.convert.initial import InitialStudent
    from m2d_ray.stages.student import job

    cfg = ctx.cfg
    b = BASELINES[s.baseline] if s.baseline else None
    teacher, x = data.of(b, cfg)
    choice = ctx.choice(teacher_key(s))
    build = (
        b.builder(data.teacher, prepared.get(b.name), x.seed)
        if b
        else InitialStudent(data.teacher, plan_of(plans, s.key), None, x.seed)
    )
    return job(
        ctx.store,
        s.key,
        teacher,
        x,
        data.eval_data,
        build=build,
        stop=stop,
        max_failures=cfg.ray.max_failures,
        tokens=data.tokens[teacher],
        targets=data.targets.get(teacher),
        target_spec=choice.spec(x.temperature, x.seed),
        shard_teacher=choice.shard,
    )


STAGE = Stage2()
