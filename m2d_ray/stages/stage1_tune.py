"""Stage 1's work on Ray (stages/stage1.py says what the stage is): the plans of the grid in one Ray task, one Tune
trial per distinct student (a probe round of first chunks, then the survivors best-first under PairwiseStopper),
the ledger and MLflow written from the driver as trials end, then the table, heatmap and promotions.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray import tune

from m2d_ray import storage
from m2d_ray.accelerators import pin, spot
from m2d_ray.arch import get_adapter
from m2d_ray.artifacts import write_json_atomic
from m2d_ray.calibrate.artifact import StatsArtifact, load_stats
from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.config import SweepConfig, parse_recipe
from m2d_ray.console import say
from m2d_ray.data.text import load_text, tokenize
from m2d_ray.evaluate.split import spread_over
from m2d_ray.models import model_config
from m2d_ray.report.stage1 import heatmap, write_tables
from m2d_ray.run_dir import RunDir
from m2d_ray.runtime.demand import tune_check
from m2d_ray.runtime.ray_env import trial_error
from m2d_ray.runtime.record import Logged, StageRecorder, fit_tuner
from m2d_ray.runtime.run_storage import RunStorage
from m2d_ray.runtime.scheduler import PairwiseStopper
from m2d_ray.stages.grid import TrialSpec, Unique, dedupe, expand, plan_all, plan_of
from m2d_ray.stages.promote import promote, unpromoted
from m2d_ray.stages.trial import InjectedFault, run_trial
from m2d_ray.track import NOTE_TAG, run_description, run_tags
from m2d_ray.weights import open_teacher


@dataclass
class Stage1Result:
    run_dir: Path
    records: list[dict]
    promotions: dict[str, dict]
    probed: int  # students whose first chunk was measured in the probe round
    evaluated: int  # Tune trials run after the probe round (all trials when there is none)
    full_evaluations: int  # students whose whole perplexity was computed (ok or diverged)
    chunks_evaluated: int  # perplexity chunks computed in all, probes included (compute, in chunks)
    wall_s: float


# ---- the trial (runs in a Tune worker) ---------------------------------------------------------
_TEACHERS: dict[tuple[str, str], object] = {}


def _teacher(model: str, device: str):
    """One lazy teacher per worker process (Tune reuses actors across trials): no weights are held, each
    student reads the tensors it is made of."""

    if (model, device) not in _TEACHERS:
        _TEACHERS[(model, device)] = open_teacher(model, device=device)
    return _TEACHERS[(model, device)]


def stage1_trainable(config: dict, *, model: str, plans: dict, eval_ids, cfg: SweepConfig, store: RunStorage) -> None:
    store.ensure_visible()  # this node sees the run's storage (checked once per node): the teacher may be read from it
    torch.set_num_threads(cfg.ray.threads_per_worker)
    key = config["key"]
    if key in cfg.faults.raise_in:
        raise InjectedFault(f"injected failure in {key} (faults.raise_in)")
    device = cfg.device or ("cuda" if cfg.ray.trial_gpus > 0 else "cpu")
    teacher = _teacher(model, "cpu")  # the student is built on CPU and moved: a GPU slice holds only the student
    for metrics in run_trial(
        teacher,
        plan_of(plans, key),
        eval_ids,
        cfg.eval,
        poison=key in cfg.faults.nan_in,
        device=device,
        devices=spread_over(cfg.ray.trial_gpus),  # whole GPUs: the student's layers spread over them
    ):
        tune.report(metrics)
        if metrics["chunk"] == config.get("max_chunks"):
            return  # probe round: the first chunk only


@ray.remote(num_cpus=1)
def _plan_task(
    model: str, stats: dict[str, torch.Tensor], layers: list[int], specs: list[TrialSpec], threads: int
) -> dict:

    torch.set_num_threads(threads)
    teacher = open_teacher(model)  # plan_all reads one layer's router and experts at a time
    return plan_all(teacher, {i: LayerStats.from_tensors(stats, f"layer{i}.") for i in layers}, specs)


# ---- records -------------------------------------------------------------------------------------
def make_record(
    spec: TrialSpec,
    plan: dict,
    status: str,
    partials: list[tuple[int, float]],
    final: dict | None,
    duplicate_of: str | None,
    attempt: str,
    error: str | None = None,
) -> dict:
    layers = plan["layers"]
    return {
        **spec.params(),
        "key": spec.key,
        "signature": plan["signature"],
        "status": status,
        "ppl": final["ppl"] if status == "ok" else None,
        "nll": final["nll"] if final else None,
        "tokens": final["tokens"] if final else None,
        "partials": [[c, p if math.isfinite(p) else None] for c, p in partials],
        "duplicate_of": duplicate_of,
        "selected": {i: p["selected"] for i, p in layers.items()},
        "effective_rank": sum(p["erank"] for p in layers.values()) / len(layers),
        "error": error,
        "attempt": attempt,
    }


def mlflow_fields(r: dict) -> Logged:
    """A config's nested MLflow run: its recipe, perplexity (and the partial ones), selection and status."""
    metrics = {"effective_rank": r["effective_rank"]}
    if r["ppl"] is not None:
        metrics["perplexity"] = r["ppl"]
    tags = {
        "signature": r["signature"],
        "duplicate_of": r["duplicate_of"],
        "selected": json.dumps(r["selected"]),
        **run_tags(1, f"{r['scoring']}/{r['grouping']}", "config"),
    }
    return Logged(
        {k: r[k] for k in ("scoring", "grouping", "scaling", "K")},
        metrics,
        tags,
        {"partial_perplexity": [tuple(p) for p in r["partials"]]},
    )


class Recorder(tune.Callback):
    """Driver side: on each finished Tune trial, write the ledger for every config of its student, then MLflow."""

    def __init__(
        self, uniques: dict[str, Unique], plans: dict, out: StageRecorder, attempt: str, max_failures: int = 0
    ) -> None:
        self.uniques, self.plans, self.out = uniques, plans, out
        self.attempt, self.max_failures = attempt, max_failures
        self.partials: dict[str, list[tuple[int, float]]] = {}
        self.probes: dict[str, float] = {}  # probe round: key -> first-chunk perplexity
        self.probe_file: Path | None = None
        self.total = self.finished = self.full = self.chunks = self.trials = 0

    def on_trial_start(self, iteration, trials, trial, **info):
        key = trial.config["key"]
        self.partials[key] = []
        self.out.tracker.trial_run(self.out.parent, key, self.uniques[key].canonical.params())

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if "chunk" in result:
            self.partials[trial.config["key"]].append((result["chunk"], result["ppl"]))
            self.chunks += 1

    def on_trial_complete(self, iteration, trials, trial, **info):
        last, key = trial.last_result or {}, trial.config["key"]
        if last.get("final"):
            self.record(key, "diverged" if last.get("diverged") else "ok", last)
        elif trial.config.get("max_chunks"):
            self.probes[key] = last["ppl"]
            if self.probe_file is not None:  # saved as they come: a killed probe round resumes where it was
                write_json_atomic(self.probe_file, self.probes)
            self.finished += 1
            say(f"[probe {self.finished}/{self.total}] {key}: first chunk ppl {last['ppl']:.2f}")
        else:
            self.record(key, "pruned", last)

    def on_trial_error(self, iteration, trials, trial, **info):
        self.record(
            trial.config["key"],
            "failed",
            trial.last_result or {},
            error=trial_error(trial, "stage 1", self.max_failures),
        )

    def record(self, key: str, status: str, last: dict, error: str | None = None) -> None:
        """Ledger records for every config of this student, then their MLflow runs."""
        u = self.uniques[key]
        final = last if last.get("final") else None
        records = [
            make_record(
                m,
                self.plans[m.key],
                status,
                self.partials.get(key, []),
                final,
                None if m == u.canonical else key,
                self.attempt,
                error,
            )
            for m in u.members
        ]
        for r in records:  # ledger first (source of truth), then MLflow (reconciled on resume)
            self.out.ledger.write(r)
        for r in records:
            self.out.log(r)
        self.finished += 1
        self.full += status in ("ok", "diverged")
        ppl = f"{last['ppl']:.2f}" if last.get("ppl") is not None and math.isfinite(last["ppl"]) else "-"
        dup = f" (+{len(u.members) - 1} identical)" if len(u.members) > 1 else ""
        say(f"[{self.finished}/{self.total}] {key}: {status} ppl {ppl}{dup}")


# ---- the sweep -----------------------------------------------------------------------------------
def _plans(cfg: SweepConfig, model: str, rd: RunDir, art: StatsArtifact, specs: list[TrialSpec], waiting) -> dict:
    """The plan of every config (RUN_DIR/plans.json, reused when the statistics and configs are the same)."""
    if rd.plans.exists():
        saved = rd.read_plans()
        if saved["stats_sha256"] == art.checksum and set(saved["plans"]) >= {s.key for s in specs}:
            return saved["plans"]
    tensors = {k: v for i, st in art.layers.items() for k, v in st.to_tensors(f"layer{i}.").items()}
    plans = waiting.get(_plan_task.remote(model, tensors, sorted(art.layers), specs, cfg.ray.threads_per_worker))
    write_json_atomic(rd.plans, {"stats_sha256": art.checksum, "plans": plans})
    return plans


def sweep(ctx, stage) -> Stage1Result:
    """Stage 1 of the run `ctx` (resumed where its ledger stops); see the module docstring."""

    t0 = time.time()
    cfg, rd, model = ctx.cfg, ctx.rd, ctx.teacher
    mcfg = model_config(model)
    adapter = get_adapter(mcfg)
    k, E = adapter.top_k(mcfg), adapter.num_experts(mcfg)
    specs = expand(cfg.grid, k, E)
    attempt = _attempt(rd)
    ctx.ray()
    remote, art = ctx.workers_teacher, load_stats(rd.stats)
    with ctx.waiting(stage) as waiting:
        plans = _plans(cfg, remote, rd, art, specs, waiting)
        uniques = dedupe(specs, plans, cfg.search.dedupe)
        parent = ctx.parent(
            params={
                "model": model,
                "k": k,
                "E": E,
                "configs": len(specs),
                "distinct_students": len(uniques),
                "stats_sha256": art.checksum,
                "calib_tokens": art.manifest["n_tokens"],
                "eval_data": cfg.eval.data,
                "grid.K": ",".join(map(str, sorted({s.K for s in specs}))),
                "early_stop": cfg.search.early_stop,
                "stop_factor": cfg.search.stop_factor,
                "dedupe": cfg.search.dedupe,
            },
            tags={"run_dir": str(rd), "teacher": model, NOTE_TAG: run_description(cfg.name, rd, model, len(specs))},
        )
        out = ctx.recorder(rd.stage1_ledger(), mlflow_fields)
        _copy_to_identical(out, uniques)
        ledger = out.ledger
        pending = [u for u in uniques if u.canonical.key not in ledger.done()]
        say(f"stage 1: {len(specs)} configs, {len(uniques)} distinct students, {len(pending)} to evaluate")

        ids = (
            tokenize(
                ctx.tokenizer, load_text(cfg.eval.data, max_chars=cfg.eval.max_chars), max_chars=cfg.eval.max_chars
            )
            if pending
            else None
        )
        recorder = Recorder({u.canonical.key: u for u in pending}, plans, out, attempt, cfg.ray.max_failures)

        def run(
            units: list[Unique], phase: str, stopper: PairwiseStopper | None = None, max_chunks: int | None = None
        ) -> None:
            _tune(
                cfg,
                remote,
                ctx.store,
                plans,
                units,
                ids,
                recorder,
                f"stage1-{attempt}-{phase}",
                rd,
                stopper,
                max_chunks,
            )

        stopper = None
        if pending and cfg.search.early_stop:
            stopper = PairwiseStopper(
                cfg.search.stop_factor, cfg.search.grace_chunks, pairs={u.canonical.key: u.pairs for u in uniques}
            )
            stopper.seed(ledger.records())
        probed = 0
        if stopper and cfg.search.probe and cfg.eval.chunks > 1:
            recorder.probes, recorder.probe_file = _load_probes(rd), rd.probes
            todo = [u for u in pending if u.canonical.key not in recorder.probes]
            if todo:
                run(todo, "probe", max_chunks=1)
            probed = len(recorder.probes)
            stopper.seed_probes(recorder.probes)
            pending = _after_probes(
                [u for u in pending if u.canonical.key not in ledger.done()], recorder.probes, stopper, recorder
            )
        if pending:
            run(pending, "eval", stopper)
    records = ledger.records()
    promotions = _finish(cfg, rd, records, ctx.tracker, parent, model, art, k, E)
    return Stage1Result(
        rd.path, records, promotions, probed, recorder.trials, recorder.full, recorder.chunks, time.time() - t0
    )


def named(ctx, stage) -> Stage1Result:
    """stage2.recipes: no search. The recipes planned from the statistics (one Ray task, as the grid's plans) into
    plans.json, and a promotions file that names them, in their order, for stage 2 (no pre-distillation perplexity:
    `ppl` None)."""
    t0 = time.time()
    cfg, rd, model = ctx.cfg, ctx.rd, ctx.teacher
    mcfg = model_config(model)
    adapter = get_adapter(mcfg)
    specs = [TrialSpec(r.scoring, r.grouping, r.scaling, r.K) for r in map(parse_recipe, cfg.stage2.recipes)]
    ctx.ray()
    art = load_stats(rd.stats)
    with ctx.waiting(stage) as waiting:
        plans = _plans(cfg, ctx.workers_teacher, rd, art, specs, waiting)
    pairs = {s.pair: {**s.params(), "ppl": None, "key": s.key, "signature": plans[s.key]["signature"]} for s in specs}
    write_json_atomic(
        rd.promotions,
        {
            "teacher": model,
            "stats_sha256": art.checksum,
            "k": adapter.top_k(mcfg),
            "E": adapter.num_experts(mcfg),
            "criterion": "named in stage2.recipes (no stage-1 search)",
            "pairs": pairs,
            "order": [s.pair for s in specs],  # as named (the file's keys are sorted)
            "unpromoted": [],
        },
    )
    say(f"stage 1: no search; {len(specs)} students named by stage2.recipes planned: {', '.join(cfg.stage2.recipes)}")
    return Stage1Result(rd.path, [], pairs, 0, 0, 0, 0, time.time() - t0)


def _attempt(rd: RunDir) -> str:
    """This start of stage 1 (counted in sweep.json): it names its Tune experiments and its records' attempt."""
    state = json.loads(rd.state.read_text())
    state["attempts"] = state.get("attempts", 0) + 1
    write_json_atomic(rd.state, state)
    return f"{state['sweep_id'][:8]}-{state['attempts']}"


def _load_probes(rd: RunDir) -> dict[str, float]:
    return json.loads(rd.probes.read_text()) if rd.probes.exists() else {}


def _after_probes(
    pending: list[Unique], probes: dict[str, float], stopper: PairwiseStopper, recorder: Recorder
) -> list[Unique]:
    """Prune students hopeless at chunk 1 against every probe; order the rest best-first (so the
    scheduler meets each pair's best early and stops the others sooner)."""
    survivors = []
    recorder.total, recorder.finished = len(pending), 0
    for u in sorted(pending, key=lambda u: probes[u.canonical.key]):
        key = u.canonical.key
        if stopper.is_hopeless(key, 1, probes[key]):
            recorder.partials[key] = [(1, probes[key])]
            recorder.record(key, "pruned", {"ppl": probes[key]})
        else:
            survivors.append(u)
    return survivors


def _copy_to_identical(out: StageRecorder, uniques: list[Unique]) -> None:
    """After a kill: copy finished results to identical configs missing a record."""
    done = out.ledger.done()
    for u in uniques:
        if u.canonical.key in done:
            src = out.ledger.read(u.canonical.key)
            for m in u.members[1:]:
                if m.key not in done:
                    out.write({**src, **m.params(), "key": m.key, "duplicate_of": u.canonical.key})


def _tune(
    cfg,
    model,
    store: RunStorage,
    plans,
    units: list[Unique],
    ids,
    recorder: Recorder,
    name: str,
    rd: RunDir,
    stopper: PairwiseStopper | None = None,
    max_chunks: int | None = None,
) -> None:
    """One Tune run over `units` (grid order = the order given); results go through `recorder`."""
    recorder.total, recorder.finished = len(units), 0
    recorder.trials += 0 if max_chunks else len(units)
    resources = {
        "cpu": cfg.ray.cpus_per_trial,
        "gpu": cfg.ray.trial_gpus,
        **(pin(cfg.ray.trial_accelerator) if cfg.ray.trial_gpus > 0 else {}),
        **spot(cfg.ray.spot_trials),
    }
    trainable = tune.with_resources(
        tune.with_parameters(stage1_trainable, model=model, plans=plans, eval_ids=ids, cfg=cfg, store=store), resources
    )
    space = {"key": tune.grid_search([u.canonical.key for u in units])}
    if max_chunks:
        space["max_chunks"] = max_chunks
    tuner = tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(
            scheduler=stopper,
            max_concurrent_trials=cfg.ray.max_concurrent_trials,
            reuse_actors=True,
            trial_name_creator=lambda t: t.config["key"],
            trial_dirname_creator=lambda t: t.config["key"],
        ),
        run_config=tune.RunConfig(
            name=name,
            **storage.ray_storage(store.tune(1)),
            callbacks=[recorder, tune_check("stage1")],
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=cfg.ray.max_failures, fail_fast=False),
        ),
    )
    fit_tuner(tuner, f"--resume {rd}")


def tag_promoted(tracker, parent: str, promotions: dict[str, dict]) -> None:
    """Each pair's winner gets kind `promoted` in MLflow (as its student in stages 2 and 3), so one filter shows
    them."""
    for p in promotions.values():
        tracker.log(tracker.trial_run(parent, p["key"], {}), tags={"kind": "promoted"})


def _finish(cfg, rd: RunDir, records, tracker, parent, model, art, k, E) -> dict:
    order = {"scoring": list(cfg.grid.scoring), "grouping": list(cfg.grid.grouping), "scaling": list(cfg.grid.scaling)}
    outputs = write_tables(records, order, rd.path)
    outputs.append(heatmap(records, order, rd.stage1_heatmap, title=f"stage 1: {Path(model).name}, k={k}, E={E}"))
    promotions = promote(records, list(cfg.grid.scaling))
    write_json_atomic(
        rd.promotions,
        {
            "teacher": model,
            "stats_sha256": art.checksum,
            "k": k,
            "E": E,
            "criterion": f"lowest pre-distillation perplexity on {cfg.eval.data}",
            "pairs": promotions,
            "unpromoted": unpromoted(records),
        },
    )
    outputs.append(rd.promotions)
    counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "pruned", "diverged", "failed")}
    tracker.log(
        parent,
        metrics={f"configs_{s}": n for s, n in counts.items()},
        tags={"promotions": json.dumps({p: f"K={v['K']},{v['scaling']}" for p, v in promotions.items()})},
    )
    tag_promoted(tracker, parent, promotions)
    tracker.artifacts(parent, outputs)
    tracker.finish(parent)
    say(f"stage 1 done: {counts}; table {rd.stage1_md}")
    return promotions
