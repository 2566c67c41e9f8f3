"""One recorder for every stage: a result goes to the stage's ledger first (the truth on resume), then to
its nested MLflow run, idempotently, so a kill between the two is repaired by `reconcile` on resume; and
one Tune runner, whose own failure (not a trial's) keeps what the ledgers hold.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

from m2d_ray.errors import M2DError, RunFailed, StorageFull, full_disk
from m2d_ray.run_dir import Ledger
from m2d_ray.track import LOGGED_TAG, Tracker

#: MLflow run status of each record status
RUN_STATUS = {"ok": "FINISHED", "diverged": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}


@dataclass(frozen=True)
class Logged:
    """What a record puts in its MLflow run."""

    params: dict
    metrics: dict
    tags: dict
    steps: dict | None = None
    artifacts: tuple[str, ...] = ()  # files logged to the run (before it counts as logged)


@dataclass
class StageRecorder:
    """Records of one stage: `write` = ledger, then MLflow run `prefix + key` under the run's parent.

    `fields(record)` says what the MLflow run gets; the `m2d.logged` tag is set last, so a run that a
    kill left half-logged is logged again by `reconcile` (found by its key, never created twice).
    """

    ledger: Ledger
    tracker: Tracker
    parent: str
    fields: Callable[[dict], Logged]
    prefix: str = ""

    def write(self, record: dict) -> None:
        self.ledger.write(record)
        self.log(record)

    def log(self, r: dict) -> None:
        f = self.fields(r)
        run = self.tracker.trial_run(self.parent, self.prefix + r["key"], f.params)
        self.tracker.log(
            run, metrics=f.metrics, tags={"status": r["status"], "error": r.get("error"), **f.tags}, steps=f.steps
        )
        self.tracker.artifacts(run, list(f.artifacts))
        self.tracker.finish(run, RUN_STATUS[r["status"]])
        self.tracker.log(run, tags={LOGGED_TAG: "1"})

    def reconcile(self) -> None:
        """After a kill: log every ledger record whose MLflow run was not finished."""
        logged = self.tracker.logged_trials(self.parent)
        for r in self.ledger.records():
            if self.prefix + r["key"] not in logged:
                self.log(r)


def fit_tuner(tuner, resume: str) -> None:
    """`tuner.fit()`; Tune itself breaking (not a trial) fails the command, finished results stay saved."""
    try:
        tuner.fit()
    except M2DError:  # the stage cannot be served (runtime/demand.py): its own one line
        raise
    except Exception as exc:
        traceback.print_exc()
        if why := full_disk(traceback.format_exc()):  # Tune could not write its state: the disk, not Tune, stopped
            raise StorageFull(f"Ray Tune could not write its state ({why})") from None
        raise RunFailed(
            f"Ray Tune stopped ({type(exc).__name__}); finished results are saved: resume with {resume}"
        ) from None
