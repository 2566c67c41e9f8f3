"""Know before spending, for the disk: the plan's storage peak against the free space of the filesystems a run
writes to, before any work.

What is checked: the run's storage (`storage:` / --storage; the run directory when unset), where the plan's parts go
(statistics, token shards, cached targets, initial and distilled students, checkpoints), and the run directory, which
also holds the run's own records (the MLflow store, Tune's state, logs, the report: about 9 MiB in the demo, allowed
for here as RECORDS). Paths on one filesystem add up. A resumed run needs only what its storage does not hold yet.
Object stores (s3://, gs://) report no free space: there `plan.max_storage` is the bound.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from m2d_ray.sizes import gib
from m2d_ray.storage import is_remote

#: the run directory's own records besides the plan's parts (MLflow, Tune state, logs, report): a floor and a share
RECORDS_BYTES, RECORDS_SHARE = 8 << 20, 0.05


def _existing(path: Path) -> Path:
    """The path itself, or its nearest ancestor that exists (a new run directory is made later)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def written(path: str | Path) -> int:
    """Bytes already under `path` (a resumed run's storage holds part of its peak)."""
    p = Path(path)
    if not p.exists():
        return 0
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def needs(peak: int, run_dir: Path, storage: str | None, resumed: bool) -> dict[Path, int]:
    """Bytes each local place must still take: the storage its share of the peak (less what it holds when resumed),
    the run directory its records; an object store is left out."""
    out: dict[Path, int] = {}
    records = RECORDS_BYTES + int(RECORDS_SHARE * peak)
    place = None if storage and is_remote(storage) else Path(storage) if storage else run_dir
    if place is not None:
        out[place] = max(0, peak - (written(place) if resumed else 0))
    out[run_dir] = out.get(run_dir, 0) + records
    return out


def space_problem(need: dict[Path, int], free=lambda p: shutil.disk_usage(p).free) -> str | None:
    """One line for the first filesystem whose free space is below what the run will write there (places on one
    filesystem add up), with what to change; None when every one has room."""
    by_fs: dict[int, tuple[list[Path], int, Path]] = {}
    for place, n in need.items():
        anchor = _existing(place)
        dev = os.stat(anchor).st_dev
        paths, total, _ = by_fs.get(dev, ([], 0, anchor))
        by_fs[dev] = ([*paths, place], total + n, anchor)
    for paths, total, anchor in by_fs.values():
        left = free(anchor)
        if total > left:
            where = " and ".join(str(p) for p in paths)
            return (
                f"the run will write {gib(total)} to {where} but its filesystem has {gib(left)} free; free space "
                "there, give --out (or storage:) on a larger disk, write less (stage2.keep_training_state=false, a "
                "smaller stage2.targets mode such as topk:64 or online, fewer students), or, with stage2.targets=auto, "
                "set plan.max_storage to the free space (the plan then chooses what fits)"
            )
    return None
