"""What `m2d run` and `m2d sweep` share: the run directory's lifecycle and the checks made once, on the
driver, before any work (every input a stage will read; a resumed run's fixed settings)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from m2d_ray.artifacts import check_output
from m2d_ray.config import D2D, SweepConfig
from m2d_ray.console import say
from m2d_ray.errors import M2DError, RunFailed
from m2d_ray.run_dir import RunDir
from m2d_ray.stages.run_storage import RunStorage


def new_run(out: str | None, cfg: SweepConfig) -> RunDir:
    """The directory of a new run: never an existing run (that is --resume), a file or a foreign directory."""
    rd = RunDir(out or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if rd.is_run():
        raise M2DError(f"{rd} already holds an m2d run; continue it with --resume {rd}, or choose another --out")
    check_output(rd.path, "run")
    return rd


def existing_run(path: str) -> RunDir:
    """An existing run directory (to resume or report on): one that m2d made."""
    rd = RunDir(path)
    if not rd.is_run():
        raise M2DError(f"{rd} is not an m2d run directory; m2d run CONFIG --out DIR (or m2d sweep) makes one")
    return rd


def run_storage(cfg: SweepConfig, rd: RunDir) -> RunStorage:
    """The run's storage, built once and passed to every stage: `storage:` / --storage, else the run directory."""
    return RunStorage(cfg.storage or str(rd.path))


def _corpora(cfg: SweepConfig, stages: tuple[int, ...]) -> dict:
    """Fingerprints of the file corpora the given stages read (data spec key -> data.source.fingerprint)."""
    from m2d_ray.calibrate.tokens import resolve_calib
    from m2d_ray.data import source

    specs = {"calib.data": resolve_calib(cfg.calib.data, cfg.model), "eval.data": cfg.eval.data}
    if 2 in stages:
        specs |= {"distill.train_data": cfg.distill.train_data, "distill.eval_data": cfg.distill.eval_data or cfg.eval.data}
    return {k: source.fingerprint(v) for k, v in specs.items() if source.parse(v).kind == "files"}


def check_corpora(rd: RunDir, cfg: SweepConfig, stages: tuple[int, ...]) -> None:
    """A resumed run reads the corpora it started with: the same spec whose files changed is refused, naming the change."""
    from m2d_ray.data import source

    saved = json.loads(rd.corpora.read_text()) if rd.corpora.exists() else {}
    for key, fp in _corpora(cfg, stages).items():
        if key in saved and saved[key]["spec"] == fp["spec"]:
            changed = source.changes(saved[key], fp)
            if changed:
                raise M2DError(f"{key} {fp['spec']} changed since {rd} started ({changed}); restore it, or start a new run with another --out")


def record_corpora(rd: RunDir, cfg: SweepConfig, stages: tuple[int, ...]) -> None:
    """Remember the corpora's fingerprints (new keys only: a resume keeps what the run started with)."""
    from m2d_ray.artifacts import write_json_atomic

    saved = json.loads(rd.corpora.read_text()) if rd.corpora.exists() else {}
    now = {**_corpora(cfg, stages), **saved}
    if now != saved:
        write_json_atomic(rd.corpora, now)


def keep_logs(where: Path) -> None:
    """From here on the command's log (libraries, Ray workers) lives in WHERE/logs/."""
    from m2d_ray import console

    path = console.keep_logs_in(where / "logs")
    if path is not None:
        say(f"logs: {path}")


def check_inputs(cfg: SweepConfig, stages: tuple[int, ...], tracking_uri: str | None = None) -> None:
    """Every input the given stages will read, checked on the driver before anything is written.

    The teacher's weights are read once, one tensor at a time, for NaN/inf (local checkpoints); workers
    that load it later need not fail one by one. A tracking server named by the user must answer.
    """
    from m2d_ray.calibrate.tokens import resolve_calib
    from m2d_ray.checkpoint import scan
    from m2d_ray.data.text import check_spec
    from m2d_ray.distill.data import check_source
    from m2d_ray.models import check_teacher, check_teacher_topk, default_teacher
    from m2d_ray.models import load_config as model_config
    from m2d_ray.stages.grid import expand

    model = cfg.model or default_teacher()
    adapter, config = check_teacher(model), model_config(model)
    expand(cfg.grid, adapter.top_k(config), adapter.num_experts(config))  # K within [k, E]
    check_spec(resolve_calib(cfg.calib.data, cfg.model), "calib.data")
    check_spec(cfg.eval.data, "eval.data")
    if 2 in stages:
        check_spec(cfg.distill.eval_data or cfg.eval.data, "distill.eval_data")
        check_teacher_topk(model, cfg.distill.teacher_topk)
        check_source(cfg.distill.train_data, cfg.distill)
        if D2D in cfg.stage2.baselines:
            from m2d_ray.stages.d2d import check_dense_teacher, dense_teacher

            check_dense_teacher(dense_teacher(cfg))
    if 3 in stages:
        from m2d_ray.evaluate.harness import check_tasks

        check_tasks(cfg.stage3.tasks, cfg.stage3.num_fewshot)
        from m2d_ray.evaluate.runner import check_teacher_fits

        check_teacher_fits(cfg, model)  # with stage3.gpu_memory set: a teacher no node can hold fails now
    if tracking_uri or cfg.mlflow.tracking_uri:
        from m2d_ray.track import Tracker

        Tracker(tracking_uri or cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    if cfg.storage:
        RunStorage(cfg.storage).check()
    scan(model, "teacher")


def check_resume(rd: RunDir, cfg: SweepConfig, tracking_uri: str | None, stages: tuple[int, ...]) -> None:
    """A resumed run keeps what its finished stages were computed with, and its inputs are checked again."""
    from m2d_ray.config import load_config
    from m2d_ray.stages.stage2 import check_stage2_config
    from m2d_ray.stages.stage3 import check_suite

    saved = load_config(rd.config).storage
    if cfg.storage != saved:
        raise M2DError(f"{rd} keeps its students and checkpoints in {saved or rd}; resume it without changing storage")
    if 2 in stages:
        check_stage2_config(rd, cfg)
    if 3 in stages:
        check_suite(rd, cfg.stage3)
    check_inputs(cfg, stages, tracking_uri)
    check_corpora(rd, cfg, stages)


def check_promoted(rd: RunDir) -> None:
    """Stage 1 that promoted nothing (every config failed or diverged) has failed: exit 1, the table says why."""
    if not rd.read_promotions()["pairs"]:
        raise RunFailed(f"stage 1 promoted no student: every config failed or diverged (see {rd.stage1_md} and {rd.logs})")


def check_outcome(run_dir: str | Path | RunDir) -> dict:
    """The run's final line (students by status, models evaluated); a run that distilled no promoted
    student, or evaluated no student, has failed (exit 1) whatever else it did — the report says why."""
    from m2d_ray.report.analysis import load_run, outcome, outcome_line

    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    o = outcome(load_run(rd.path))
    say(f"run done: {outcome_line(o)}")
    index = rd.report / "index.html"
    if o["promoted"] and not o["promoted_distilled"]:
        raise RunFailed(f"no promoted student was distilled ({o['students']['failed']} failed, {o['students']['diverged']} diverged): "
                        f"see {index} and {rd.logs}")
    if not o["evaluated"]:
        raise RunFailed(f"no student was evaluated: see {index} and {rd.logs}")
    return o
