"""What `m2d run`, `m2d sweep` and `m2d report` share: the run directory's lifecycle (a new one refused where
something else is, an existing one only where m2d made it), the command's log, and the run's outcome line."""

from __future__ import annotations

import time
from pathlib import Path

from m2d_ray import console
from m2d_ray.artifacts import check_output
from m2d_ray.config import SweepConfig
from m2d_ray.console import say
from m2d_ray.errors import M2DError, RunFailed
from m2d_ray.report.analysis import outcome, outcome_line
from m2d_ray.run_dir import RunDir
from m2d_ray.stages.report import run_data


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


def keep_logs(where: Path) -> None:
    """From here on the command's log (libraries, Ray workers) lives in WHERE/logs/."""

    path = console.keep_logs_in(where / "logs")
    if path is not None:
        say(f"logs: {path}")


def check_outcome(run_dir: str | Path | RunDir) -> dict:
    """The run's final line (students by status, models evaluated); a run that distilled no promoted
    student, or evaluated no student, has failed (exit 1) whatever else it did — the report says why; so has one
    whose analysis failed for a model (its generation, or a judge that could not judge): a resume retries those."""

    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    o = outcome(run_data(rd))
    say(f"run done: {outcome_line(o)}")
    index = rd.report / "index.html"
    if o["promoted"] and not o["promoted_distilled"]:
        raise RunFailed(
            f"no promoted student was distilled ({o['students']['failed']} failed, {o['students']['diverged']} "
            "diverged): "
            f"see {index} and {rd.logs}"
        )
    if not o["evaluated"]:
        raise RunFailed(f"no student was evaluated: see {index} and {rd.logs}")
    if o["analysis_failed"]:
        key, error = next(iter(o["analysis_failed"].items()))
        raise RunFailed(
            f"the analysis failed for {len(o['analysis_failed'])} models ({key}: {str(error)[:240]}); "
            f"m2d run --resume {rd} retries them"
        )
    return o
