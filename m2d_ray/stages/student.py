"""One student's distillation job, as the run's storage lays it out: the one path of `m2d distill` and of every
stage-2 trial.

Rank 0 builds the initial student into the run's storage once (`build`), unless an initial student is given
(`init`: a directory the workers reach); every rank reads it back through its node's cache, and the distilled
student and the checkpoints go to the storage too (`RunStorage`, keyed by the trial's key, or no key for
`m2d distill`). Fitting the same key again resumes from its latest checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

from m2d_ray.config import DistillConfig
from m2d_ray.distill.loop import DistillJob
from m2d_ray.runtime.run_storage import RunStorage


def job(
    store: RunStorage,
    key: str | None,
    teacher: str,
    cfg: DistillConfig,
    eval_data: str,
    *,
    build: Callable | None = None,
    init: str | None = None,
    stop: Callable[[], bool] | None = None,
    max_failures: int = 0,
    tokens: str | None = None,
    targets: str | None = None,
    target_spec=None,
    shard_teacher: bool = False,
) -> DistillJob:
    """The job of distilling student `key` from `teacher` (names and URLs the workers reach), reading the run's token
    shards `tokens` and, when cached, the teacher's `targets` of `target_spec` (then the workers load no teacher
    weights; online, `shard_teacher` shards it over the ranks)."""
    checkpoints, name = store.checkpoints(key)
    return DistillJob(
        teacher,
        init or store.initial(key),
        cfg,
        eval_data,
        out=store.student(key),
        device="cuda" if cfg.gpus_per_worker > 0 else "cpu",
        stop=stop,
        build=None if init else build,
        tokens=tokens,
        targets=targets,
        target_spec=target_spec,
        checkpoints=checkpoints,
        run_name=name,
        max_failures=max_failures,
        shard_teacher=shard_teacher,
    )
