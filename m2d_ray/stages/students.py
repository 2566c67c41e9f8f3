"""Stage 2's students and what every one of them reads, shared by the targets pass (which caches the teachers'
outputs for them first) and stage 2 (which distils them).

    students(...)     the promoted students best-first, then the baselines (`baseline-NAME`)
    duplicates(...)   promoted students whose plan repeats a better-ranked one's: distilled once, recorded for both
    pending(...)      those still to distil (a failed student is tried again)
    reads(...)        the teachers as workers reach them, the text, and per teacher its token shards and, when it
                      stores its targets (ctx.choice), those: made once into the run's storage (content-addressed),
                      found again after
    taught(p)         the teachers of a plan and the students each serves
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from m2d_ray.config import DistillConfig
from m2d_ray.plan.shapes import Shape
from m2d_ray.plan.targets import MOE
from m2d_ray.run_dir import RunDir
from m2d_ray.runtime.record import StageRecorder
from m2d_ray.stages.baselines import BASELINES, Baseline, of

# Imported inside functions: Ray, torch (`m2d plan` and the checks read this module without importing them).


@dataclass(frozen=True)
class Taught:
    """A teacher stage 2 distils from: its key (plan/targets.py), its shape and the students distilled from it."""

    key: str
    shape: Shape
    students: int


def taught(p) -> list[Taught]:
    """Stage 2's teachers in a plan (`Planning` p): the MoE teacher (the promoted students and the baselines built from
    it), then each baseline's own teacher (its students), at its shape when its config was read, else the MoE
    teacher's."""
    own = [b for b in of(p.cfg) if b.has_teacher]
    moe = Taught(MOE, p.models.teacher, p.pairs + len(p.cfg.stage2.baselines) - len(own))
    return [moe] + [
        Taught(b.teacher_key, p.teachers.get(b.teacher_key, p.models.teacher), b.teacher_students) for b in own
    ]


def teacher_key(s: Student) -> str:
    """The key of the teacher student `s` is distilled from."""
    b = BASELINES[s.baseline] if s.baseline else None
    return b.teacher_key if b is not None and b.has_teacher else MOE


@dataclass(frozen=True)
class Student:
    """One stage-2 student: a promoted config (`key` = its stage-1 key) or a baseline (`baseline-NAME`)."""

    key: str
    pair: str  # "scoring/grouping", or the baseline's name
    stage1_ppl: float | None = None
    baseline: str | None = None

    def params(self) -> dict:
        return {"key": self.key, "pair": self.pair, "baseline": self.baseline, "stage1_ppl": self.stage1_ppl}


def students(promotions: dict, baselines: list[Baseline], only: tuple[str, ...] = ()) -> list[Student]:
    """Promoted students best-first (ASHA meets strong students early), then the baselines; `only` keeps those
    (scoring/grouping) pairs."""
    order = {p: i for i, p in enumerate(promotions.get("order", ()))}  # named recipes: as named (no stage-1 ppl)
    pairs = sorted(
        ((p, v) for p, v in promotions["pairs"].items() if not only or p in only),
        key=lambda kv: order[kv[0]] if kv[0] in order else kv[1]["ppl"],
    )
    return [Student(p["key"], pair, p["ppl"]) for pair, p in pairs] + [
        Student(b.key, b.name, None, b.name) for b in baselines
    ]


def duplicates(todo: list[Student], plans: dict) -> dict[str, str]:
    """Promoted students whose plan repeats a better-ranked one's (at K = k every grouping builds the same
    student): their key -> the key of the student distilled for both."""
    first: dict[str, str] = {}
    out = {}
    for s in todo:
        if s.baseline is None:
            sig = plans[s.key]["signature"]
            out.update({s.key: first[sig]} if sig in first else {})
            first.setdefault(sig, s.key)
    return out


def copy_duplicates(out: StageRecorder, todo: list[Student], dups: dict[str, str]) -> None:
    """Each duplicate gets its distilled twin's record (ledger and MLflow), under its own key and pair."""
    done = out.ledger.done()
    by_key = {s.key: s for s in todo}
    for key, twin in dups.items():
        if twin in done:
            r = {**out.ledger.read(twin), **by_key[key].params(), "key": key, "duplicate_of": twin}
            if key not in done or out.ledger.read(key) != r:
                out.write(r)


@dataclass(frozen=True)
class Todo:
    """Stage 2's students of a run: all of them, the duplicates and those still to distil."""

    all: list[Student]
    duplicates: dict[str, str]
    pending: list[Student]
    retried: int  # of `pending`, students that failed before


def todo(rd: RunDir, cfg) -> Todo:
    """The students of the run in `rd` and what is left of them (the stage-2 ledger is the truth)."""
    everyone = students(rd.read_promotions(), of(cfg), cfg.stage2.pairs)
    plans = rd.read_plans()["plans"] if any(s.baseline is None for s in everyone) else {}
    dups = duplicates(everyone, plans)
    done = {r["key"]: r["status"] for r in rd.stage2_records()}
    pending = [s for s in everyone if done.get(s.key, "failed") == "failed" and s.key not in dups]
    return Todo(everyone, dups, pending, sum(s.key in done for s in pending))


@dataclass(frozen=True)
class Reads:
    """What the students read, as workers reach it: the MoE teacher, the validation text, the distillation settings
    with the data's storage URLs, and per teacher (the MoE teacher's, each baseline's own) its token shards and,
    with a cached mode, its targets."""

    teacher: str
    eval_data: str
    distill: DistillConfig
    urls: dict[str, str]  # each baseline's own teacher: as the driver names it -> as workers reach it
    tokens: dict[str, str]  # teacher (as workers reach it) -> its token shards
    targets: dict[str, str]  # teacher -> its cached targets (none online)

    def of(self, baseline: Baseline | None, cfg) -> tuple[str, DistillConfig]:
        """(the teacher a student is distilled from as workers reach it, its distillation settings)."""
        if baseline is None:
            return self.teacher, self.distill
        own = baseline.teacher(cfg)
        return self.urls[own] if own else self.teacher, baseline.distill_config(self.distill)


def reads(ctx, waiting, baselines: list[Baseline]) -> Reads:
    """The students' reads (`baselines`: those whose teachers they need), made into the run's storage where missing:
    the text copied once, each teacher's tokens by Ray Data and, with stage2.targets cached, its targets pass."""
    from m2d_ray.models import load_tokenizer
    from m2d_ray.runtime.shards import targets, tokens

    cfg, store = ctx.cfg, ctx.store
    eval_data = store.put_data(cfg.distill.eval_data or cfg.eval.data)
    distill = replace(cfg.distill, train_data=store.put_data(cfg.distill.train_data), eval_data=eval_data)
    teachers, urls = {ctx.workers_teacher: (ctx.teacher, distill, MOE)}, {}
    for b in baselines:
        name = b.teacher(cfg)
        if name is not None:
            urls[name] = store.put_model(name)
            teachers[urls[name]] = (name, b.distill_config(distill), b.teacher_key)
    toks = {
        t: waiting.call(tokens, store, t, load_tokenizer(name), x, eval_data) for t, (name, x, _) in teachers.items()
    }
    targ = {}  # the teacher once: the targets of a teacher that stores them, cached for every student
    for t, (_, x, key) in teachers.items():
        spec = ctx.choice(key).spec(x.temperature, x.seed)
        if spec is not None:
            targ[t] = waiting.call(targets, store, t, toks[t], spec, x, cfg.calib, cfg.ray)
    return Reads(ctx.workers_teacher, eval_data, distill, urls, toks, targ)
