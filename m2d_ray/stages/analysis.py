"""Stage 3's generation analysis: what the models write, put in the paper's error taxonomy (evaluate/taxonomy.py).

    stage3.analysis (config.AnalysisConfig)   the questions (MMLU's test split, or the offline local set), the prompt,
                                              the sampling (temperature, seed, tokens), the judge, the thresholds
    RUN_DIR/analysis/settings.json            the questions' ids, prompt and sampling: what a resumed run must keep
    one Ray task per model                    the models stage 3 evaluates, placed as stage 3 places them
                                              (evaluate/runner.py: a GPU, several when sharded, else 1 CPU thread);
                                              each answers in batches, every batch saved to STORAGE/analysis/KEY/ as it
                                              ends, so a killed run continues where it stopped
    the rules, then the judge                 on the driver (pure functions); the judge decides the wrong, coherent,
                                              on-topic answers: `teacher` in one Ray task holding the MoE teacher
                                              (placed as stage 3's teacher), `openai:MODEL` from the driver (its
                                              server asked for the model before any work); a model whose judge
                                              leaves more than `max_unjudged` of them unjudged is recorded failed
    RUN_DIR/analysis/responses/KEY.jsonl      every answer with its category, the extracted answer and why
    RUN_DIR/analysis/results/KEY.json         counts and shares, accuracy per subject group, an excerpt per category
    MLflow                                    a nested run `analysis/KEY` per model: the category rates as metrics, the
                                              responses as its artifact, the sampling as params, the judge and its
                                              prompt as tags (RUN_DIR/analysis/judge.json beside them)

A model with a record is not generated again; a failed one (its generation or its judge) is tried again on resume,
its saved batches read back; a changed judge or threshold classifies the saved answers again without generating;
changed questions, prompt, sampling or stop strings are refused on resume (two samples in one figure). A failed
model fails the run (`m2d run` exits 1 after the report: commands/runs.check_outcome).

The plan prices the generation as the issue asks: the prompt and the new tokens through the model, every answer
taken to its token limit (an upper bound), FLOPs / (peak x efficiency). On a GPU decoding a small batch is bound by
memory bandwidth rather than FLOPs, so the time is a lower bound there. Memory: the weights (a share of them when
sharded) and the batch's sequences at prompt + new tokens (evaluate/placement.py's per-sequence estimate, which
counts logits over the whole sequence: generation keeps fewer).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING

from m2d_ray.artifacts import write_json_atomic, write_text_atomic
from m2d_ray.catalog.units import ACTOR
from m2d_ray.config import AnalysisConfig, SweepConfig
from m2d_ray.console import say
from m2d_ray.data.synthetic import DOMAINS
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.judges import (
    OpenAIJudge,
    StreamedTeacherJudge,
    TeacherJudge,
    describe,
    parse_judge,
    shortfall,
    ties,
)
from m2d_ray.evaluate.paper_tasks import MMLU_SUBJECTS
from m2d_ray.evaluate.placement import model_size, plan_generation, plan_streamed
from m2d_ray.evaluate.questions import TEMPLATE_CHARS, Question, check_set, group_of, sample
from m2d_ray.evaluate.runner import generation_placements, max_length
from m2d_ray.evaluate.taxonomy import by_rules, classify, judge_extracted, summary
from m2d_ray.peaks import peaks, reset_peaks
from m2d_ray.plan.bill import StageCost
from m2d_ray.plan.cost import before
from m2d_ray.plan.devices import bundle
from m2d_ray.plan.flops import forward_flops
from m2d_ray.plan.run_plan import unit
from m2d_ray.plan.suite import prompt_tokens
from m2d_ray.report.answers import answer_parts
from m2d_ray.report.page import render
from m2d_ray.run_dir import TEACHER_KEY, Ledger, RunDir
from m2d_ray.runtime.record import Logged
from m2d_ray.stages import stage3
from m2d_ray.stages.contract import Section, Stage
from m2d_ray.track import model_kind, run_tags

if TYPE_CHECKING:
    from m2d_ray.evaluate.generation import Sampling

# Imported inside functions: Ray, torch and the generation loop (`m2d plan` and the checks read this module
# without them).


class Analysis(Stage):
    name = "analysis"
    keys = stage3.Stage3.keys

    def wanted(self, cfg: SweepConfig) -> bool:
        return cfg.stage3.analysis.enabled

    def check(self, cfg, teacher: str) -> None:
        a = cfg.stage3.analysis
        check_set(a.questions)  # MMLU fetched and intact
        kind, model = parse_judge(a.judge)
        if kind == "openai":
            OpenAIJudge.configured(model, a).check()  # the server answers, before any generation

    def check_resume(self, rd, cfg) -> None:
        check_settings(rd, cfg.stage3.analysis)

    def request(self, cfg) -> dict:
        return stage3.STAGE.request(cfg)

    def needs(self, p):
        """One row per model stage 3 evaluates (and the teacher when it judges): its weights (a share when sharded
        over a node's GPUs) and a whole batch of generated sequences (evaluate/placement.plan_generation)."""
        a, c = p.cfg.stage3.analysis, p.cfg.stage3
        gpus, mem, per_node = stage3.gpu_room(p)
        models = stage3.models_to_evaluate(p)
        if parse_judge(a.judge)[0] == "teacher":
            models.setdefault(TEACHER_KEY, p.models.teacher_config)
        prompt = int(prompt_tokens(a.questions, TEMPLATE_CHARS))
        rows = []
        for key, config in models.items():
            size, length = model_size(config), max_length(config, prompt + a.max_new_tokens)
            gpu = mem if gpus > 0 else None
            streamed = None
            try:
                e = plan_generation(size, gpu, per_node, a.batch_size, prompt, length, gpus if gpus < 1 else None)
                shard = max(1, int(e.gpus))
            except M2DError:  # fits on no number of a node's GPUs: what it would need on all of them
                shard = per_node
                if key == TEACHER_KEY:  # the judge only scores: a decoder layer at a time, where that fits
                    streamed = _streamed(size, gpu, a.batch_size, length)
            if streamed is not None:
                shard, label = 1, f"{key}, streamed a decoder layer at a time"
                parts = {
                    "a decoder layer or the head": streamed.weights,
                    "batch of sequences": a.batch_size * streamed.sequence,
                }
            else:
                spread, each = size.generation_bytes(prompt, length)
                label = f"{key}, sharded over {shard}" if shard > 1 else key
                parts = {
                    "weights": int(size.weights / shard * (1.05 if shard > 1 else 1)),
                    "batch of sequences": a.batch_size * (spread // shard + each),
                }
            rows.append(
                unit(
                    f"{self.name}:{key}",
                    label,
                    parts,
                    (gpus if gpus < 1 else 1) if gpus > 0 else 0,
                    shard,
                    bundle(c.cpus_per_task, shard if gpus >= 1 else gpus, c.accelerator),
                    p.devices,
                    "a smaller stage3.analysis.batch_size or max_new_tokens, or nodes with more or larger GPUs"
                    + (", or another judge: stage3.analysis.judge=none or openai:MODEL" if key == TEACHER_KEY else ""),
                    self.keys,
                    pinned_memory=mem if gpus > 0 else None,
                )
            )
        return rows

    def cost(self, c):
        """Every model's questions at prompt + new tokens (all to the limit: an upper bound), then the judge; each a
        model's load (an actor's start: plan.actor_s) besides, no Ray round of its own (tasks on the run's Ray, as
        stage 3's)."""
        p, a = c.p, c.p.cfg.stage3.analysis
        n, prompt = questions_of(a), prompt_tokens(a.questions, TEMPLATE_CHARS)
        seq = prompt + a.max_new_tokens
        # a model's start is its load (an actor's, as a Ray Data actor's), its tasks go to the Ray the run runs
        generation = stage3.price_models(
            c, self.name, lambda shape: n * seq * forward_flops(shape, int(seq)), ACTOR, rounds=0
        )
        answers = n * generation.units
        kind, model = parse_judge(a.judge)
        if kind == "none":
            return [generation]
        if kind == "openai":  # a request per answer, and one more for each it may extract (an upper bound)
            asks = answers * (2 if a.judge_extracts else 1)
            judge = StageCost(f"{self.name}:judge", 0.0, asks / a.judge_rate, 0.0, None, asks, 1, a.judge)
        else:  # every answer judged (an upper bound): the question and the answer (about `seq`), once per label and
            t = p.models.teacher  # label order
            judged = 4 * answers * seq * forward_flops(t, int(seq))
            plan = c.plans.get(f"{self.name}:{TEACHER_KEY}")
            s3 = p.cfg.stage3
            where = c.place(plan.name, plan.share * plan.units, s3.threads_per_task, 1, s3.accelerator, plan.request)
            judge = c.stage(f"{self.name}:judge", [judged], where, ACTOR, rounds=0)
        # the judge runs after the generation; `before` adds the two (sums commute) and keeps the generation's row
        return [before(judge, generation)]

    def run(self, ctx) -> dict[str, dict]:
        return analyse(ctx, self)

    def sections(self, data):
        parts = answer_parts(data)
        return [Section("Stage 3: what the models write (error taxonomy)", render(parts))] if parts else []


def questions_of(a: AnalysisConfig) -> int:
    """How many questions the sample has (57 MMLU subjects, or the corpus' 6 domains; every subject has more rows)."""
    return a.per_subject * (len(MMLU_SUBJECTS) if a.questions == "mmlu" else len(DOMAINS))


def sampling(a: AnalysisConfig) -> Sampling:
    from m2d_ray.evaluate.generation import Sampling

    return Sampling(a.max_new_tokens, a.temperature, a.seed, a.batch_size)


def fixed(a: AnalysisConfig) -> dict:
    """What the answers are generated from: a started analysis keeps it."""
    from m2d_ray.evaluate.generation import recorded

    return recorded(a.questions, a.per_subject, sampling(a))


def check_settings(rd: RunDir, a: AnalysisConfig) -> dict:
    """The analysis' generation settings; a started one must keep them (its answers would mix two samples)."""
    now = fixed(a)
    if rd.analysis_settings.exists():
        saved = json.loads(rd.analysis_settings.read_text())
        changed = [k for k in now if saved.get(k) != now[k]]
        if changed:
            raise M2DError(
                f"the analysis of {rd} generated its answers with other settings ({', '.join(changed)}); keep "
                f"stage3.analysis.{changed[0]} as it was ({saved.get(changed[0])!r}) or use a new run directory"
            )
    return now


def classified_with(a: AnalysisConfig) -> dict:
    """What a model's categories depend on besides its answers: a change classifies them again."""
    return {"judge": a.judge, "thresholds": asdict(a.thresholds), "judge_extracts": a.judge_extracts}


def mlflow_fields(rd: RunDir, r: dict) -> Logged:
    """What a model's record puts in its MLflow run (`rd`: the run directory its responses file is in)."""
    metrics = {f"share.{k}": v for k, v in r.get("shares", {}).items() if v is not None}
    for name in ("catastrophic", "knowledge_errors", "accuracy"):
        if r.get(name) is not None:
            metrics[name] = r[name]
    metrics.update({f"acc.{g}": v["accuracy"] for g, v in r.get("groups", {}).items()})
    s = r.get("settings", {})
    params = {"stage": "analysis", "pair": r["pair"], "model": r["model"], **s}
    tags = {**run_tags("analysis", r["pair"], model_kind(r["key"])), **r.get("judged_by", {})}
    return Logged(params, metrics, tags, artifacts=(str(rd.path / r["responses"]),) if r.get("responses") else ())


def excerpts(records: list[dict], chars: int = 300) -> dict[str, dict]:
    """The first answer (in question order) of each category, shortened."""
    out: dict[str, dict] = {}
    for r in records:
        if r["category"] not in out:
            text = " ".join(r["response"].split())
            out[r["category"]] = {
                "id": r["id"],
                "subject": r["subject"],
                "extracted": r["extracted"],
                "reason": r["reason"],
                "text": text[:chars] + ("…" if len(text) > chars else ""),
            }
    return out


# ---- the run ---------------------------------------------------------------------------------------------------
def analyse(ctx, stage: Analysis) -> dict[str, dict]:
    """Every model stage 3 evaluates answers the questions; its answers are classified and recorded. Returns
    {key: record}."""
    cfg, rd, a = ctx.cfg, ctx.rd, ctx.cfg.stage3.analysis
    settings = check_settings(rd, a)
    questions = sample(a.questions, a.per_subject, a.seed)
    if not rd.analysis_settings.exists():
        write_json_atomic(rd.analysis_settings, {**settings, "ids": [q.id for q in questions]})
    write_json_atomic(rd.analysis_judge, describe(a.judge))
    todo = stage3.jobs(rd, cfg, rd.read_promotions()["teacher"])
    out = ctx.recorder(Ledger(rd.analysis_results), partial(mlflow_fields, rd), prefix="analysis/")
    how = classified_with(a)
    done = {r["key"]: r for r in out.ledger.records()}
    pending = [j for j in todo if done.get(j.key, {}).get("status") != "ok" or done[j.key].get("classified") != how]
    say(
        f"analysis: {len(todo)} models x {len(questions)} questions ({a.questions}, up to {a.max_new_tokens} new "
        f"tokens, judge {a.judge}), {len(pending)} to do"
    )
    if pending:
        ctx.ray()
        for r in _analysed(ctx, stage, pending, questions, {"settings": settings, "classified": how}):
            out.write(r)
            done[r["key"]] = r
        failed = [k for k, r in done.items() if r["status"] != "ok"]
        say(
            f"analysis: {len(done) - len(failed)} models classified"
            + (f", {len(failed)} failed ({', '.join(failed)}: m2d run --resume retries them)" if failed else "")
        )
    ctx.tracker.finish(ctx.parent())
    return done


def _analysed(ctx, stage: Analysis, jobs: list, questions: list[Question], base: dict) -> list[dict]:
    """The record of each job: its answers generated (or read back), put through the rules, the open ones judged
    (the judge failing fails the models it had to decide: recorded, and retried on resume)."""
    rd, a = ctx.rd, ctx.cfg.stage3.analysis
    th = a.thresholds
    answers = _generate(ctx, stage, jobs, questions)
    kind, model = parse_judge(a.judge)
    if kind == "openai" and a.judge_extracts:  # rule 8: the judge reads what the rules could not
        extractor = OpenAIJudge.configured(model, a).extract
        for got in answers.values():
            if "rows" in got:
                got["rows"] = judge_extracted(got["rows"], extractor, th)
    open_ = [(k, r) for k, v in answers.items() if "rows" in v for r in v["rows"] if by_rules(r, th).category is None]
    try:
        (said, why, odds), judge_error = _judge(ctx, stage, [r for _, r in open_]) if open_ else ([], "", []), None
    except Exception as exc:
        from m2d_ray.runtime.ray_env import failure

        said, why, odds, judge_error = [], "", [], "judge: " + failure(str(exc), "analysis", 0, 0)
    verdict = {(k, r["id"]): v for (k, r), v in zip(open_, said)}
    sure = {(k, r["id"]): v for (k, r), v in zip(open_, odds)}
    judged_by = {"judge": a.judge, "judge_prompt": describe(a.judge)["prompt"]}
    out = []
    for job in jobs:
        got = answers[job.key]
        opened = [x for x in got.get("rows", []) if by_rules(x, th).category is None]
        error = got.get("error") or (judge_error if opened else None)
        decided = [] if error else [verdict[(job.key, x["id"])] for x in opened]
        given = Given(decided, [sure[(job.key, x["id"])] for x in opened] if sure else [])
        if not error and parse_judge(a.judge)[0] != "none":
            error = shortfall(a.judge, decided, a.max_unjudged, why)  # a judge that cannot judge fails the model
        if error:
            out.append({**asdict(job), "status": "failed", "error": error, **base})
            continue
        records = [{**x, "model": job.key} for x in classify(got["rows"], given, th)]
        path = rd.analysis_responses(job.key)
        write_text_atomic(path, "".join(json.dumps(x) + "\n" for x in records))
        out.append(
            {
                **asdict(job),
                "status": "ok",
                **base,
                **summary(records, group_of),
                "judged_by": judged_by,
                "truncated": sum(x.get("finish") == "length" for x in records),
                "responses": str(path.relative_to(rd.path)),
                "excerpts": excerpts(records),
                **{k: v for k, v in got.items() if k != "rows"},
            }
        )
    return out


def _places(cfg: SweepConfig, models: dict[str, str], get, streamable=()) -> dict:
    """Where each model generates: stage 3's devices, the analysis' whole batch beside the weights (`streamable`: the
    models that only score, read a layer at a time where no node holds them)."""
    a = cfg.stage3.analysis
    prompt = int(prompt_tokens(a.questions, TEMPLATE_CHARS))
    return generation_placements(
        models, cfg.stage3, cfg.stage3_gpus(), a.batch_size, prompt, prompt + a.max_new_tokens, get, streamable
    )


def _generate(ctx, stage: Analysis, jobs: list, questions: list[Question]) -> dict[str, dict]:
    """One Ray task per model: {key: {"rows": answers, "gen_s", "placement", peaks} or {"error": line}}."""
    import ray

    from m2d_ray.runtime.ray_env import failure

    cfg, a = ctx.cfg, ctx.cfg.stage3.analysis
    gpus, opts = cfg.stage3_gpus(), stage3.task_options(cfg)
    device = "cuda" if gpus > 0 else "cpu"
    models = stage3.reachable(ctx, jobs)
    task = ray.remote(_answer_task)
    out: dict[str, dict] = {}
    with ctx.waiting(stage) as waiting:
        places = _places(cfg, models, waiting.get)
        qs = ray.put([asdict(q) for q in questions])
        refs = {
            task.options(**{**opts, "num_gpus": places[j.key].gpus}).remote(
                models[j.key],
                qs,
                asdict(sampling(a)),
                device,
                places[j.key],
                ctx.store.answers(j.key),
                cfg.stage3.threads_per_task,
                ctx.store,
            ): j
            for j in jobs
        }
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=waiting.poll)
            waiting.check()
            if not ready:
                continue
            job = refs.pop(ready[0])
            try:
                out[job.key] = ray.get(ready[0])
                rows = out[job.key]["rows"]
                cut = sum(r["finish"] == "length" for r in rows)
                line = f"{len(rows)} answers in {out[job.key]['gen_s']:.0f} s ({cut} cut at the token limit)"
            except Exception as exc:  # one model failing does not stop the others
                out[job.key] = {"error": failure(str(exc), "analysis", cfg.ray.max_failures, cfg.ray.max_failures)}
                line = "failed"
            say(f"[analysis {len(out)}/{len(jobs)}] {job.key}: {line}")
    return out


def _judge(ctx, stage: Analysis, records: list[dict]) -> tuple[list[str], str, list[float]]:
    """A verdict for each record, why some are unjudged, and how sure the judge was (the teacher's log-odds; [] from
    another): the openai judge from here, the teacher in one Ray task placed as stage 3's."""
    import ray

    cfg, a = ctx.cfg, ctx.cfg.stage3.analysis
    kind, model = parse_judge(a.judge)
    if kind == "none":
        return ["unjudged"] * len(records), "", []
    if kind == "openai":
        judge = OpenAIJudge.configured(model, a)
        said = judge(records)
        unjudged = sum(v == "unjudged" for v in said)
        say(f"analysis: {judge.name} judged {len(records)} answers ({unjudged} unjudged, {judge.failures} failed)")
        return said, judge.why(), []
    gpus, opts = cfg.stage3_gpus(), stage3.task_options(cfg)
    teacher = ctx.workers_teacher
    with ctx.waiting(stage) as waiting:
        place = _places(cfg, {TEACHER_KEY: teacher}, waiting.get, streamable=(TEACHER_KEY,))[TEACHER_KEY]
        ref = (
            ray.remote(_judge_task)
            .options(**{**opts, "num_gpus": place.gpus})
            .remote(
                teacher,
                records,
                a.batch_size,
                "cuda" if gpus > 0 else "cpu",
                place,
                cfg.stage3.threads_per_task,
                ctx.store,
            )
        )
        said, odds = waiting.get(ref)
    say(f"analysis: the teacher judged {len(records)} answers ({said.count('unjudged')} ties)")
    return said, ties(said), odds


def _answer_task(model, questions, s, device, placement, url, threads, store) -> dict:
    """A Ray task on any node: load one model (sharded when its placement says so) and answer every question, a
    batch at a time, each batch saved to the run's storage as it ends (those saved already are read back)."""
    import torch

    from m2d_ray.evaluate.generation import BatchStore, Sampling, answer_all, load

    store.ensure_visible()
    torch.set_num_threads(threads)
    reset_peaks()
    t0 = time.time()
    lm, tok = load(model, device, placement)
    rows = answer_all(
        lm, tok, [Question(**{**q, "choices": tuple(q["choices"])}) for q in questions], Sampling(**s), BatchStore(url)
    )
    return {"rows": rows, "gen_s": round(time.time() - t0, 1), "placement": placement.describe(), **peaks()}


def _streamed(size, gpu: int | None, batch: int, length: int):
    """The teacher judge's placement a decoder layer at a time, None where even that does not fit."""
    try:
        return plan_streamed(size, gpu, batch, length)
    except M2DError:
        return None


def _judge_task(teacher, records, batch_size, device, placement, threads, store) -> tuple[list[str], list[float]]:
    """A Ray task: the teacher judges `records` (its label continuations' log-likelihoods): its verdicts and their
    log-odds; a teacher no node holds is read from its checkpoint a decoder layer at a time (its placement says so)."""
    import torch

    from m2d_ray.evaluate.generation import load

    store.ensure_visible()
    torch.set_num_threads(threads)
    if placement.streamed:
        from m2d_ray.weights import open_model

        lazy = open_model(teacher)
        judge = StreamedTeacherJudge(lazy, lazy.tokenizer, batch_size, device=device)
    else:
        lm, tok = load(teacher, device, placement)
        judge = TeacherJudge(lm, tok, batch_size)
    return judge(records), judge.log_odds


class Given:
    """Verdicts decided already (and the judge's log-odds, when it gave them), as `classify` calls a judge."""

    def __init__(self, said: list[str], log_odds: list[float]) -> None:
        self.said, self.log_odds = said, log_odds

    def __call__(self, records: list[dict]) -> list[str]:
        return self.said


STAGE = Analysis()
