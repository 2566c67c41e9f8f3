"""Where Ray workers find what a run gives them: its storage and its teacher, checked before work starts.

Workers may run on nodes that do not see the driver's disk. So a run's storage must be reachable from
every node (checked: a probe written by the driver must be readable by a task on each node), and the
teacher must be a hub name (each node fetches it), a storage URL (each node reads it through its
cache) or the embedded teacher (installed with the package). A teacher directory on the driver's disk
is copied into the run's storage once when the run uses a Ray cluster, and read from there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from pathlib import Path

import ray

from m2d_ray import storage
from m2d_ray.console import say
from m2d_ray.errors import M2DError
from m2d_ray.sweep.ray_env import on_cluster


def run_storage(cfg, run_dir: Path) -> str:
    """The run's storage URL: `storage:` / --storage, else the run directory itself."""
    return cfg.storage or str(run_dir)


def check_storage(url: str) -> None:
    """Before any work, on the driver: the storage can be written and read back (credentials, endpoint,
    permissions), and is not a file."""
    probe = storage.join(url, f".m2d-probe-{uuid.uuid4().hex[:8]}")
    try:
        storage.write_bytes(probe, b"m2d")
        ok = storage.read_bytes(probe) == b"m2d"
        storage.delete(probe)
    except Exception as exc:  # unreachable endpoint, no bucket, no permission, a file in the way ...
        with contextlib.suppress(Exception):
            storage.delete(probe)
        raise M2DError(f"storage {url} cannot be written and read back ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
                       "give --storage a writable path every node mounts, or an s3:// / gs:// URI with credentials") from None
    if not ok:
        raise M2DError(f"storage {url} does not read back what was written; give another --storage")


@ray.remote(num_cpus=0)
def _sees(url: str) -> bool:
    return storage.exists(url)


def check_visible(url: str) -> None:
    """Every alive Ray node reads a probe the driver wrote to the storage (a local path must be shared)."""
    if storage.is_remote(url):
        return
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) < 2:
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = storage.join(url, f".m2d-visible-{uuid.uuid4().hex[:8]}")
    storage.write_bytes(probe, b"m2d")
    try:
        seen = ray.get([_sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(probe) for n in nodes])
    finally:
        storage.delete(probe)
    blind = [n["NodeManagerAddress"] for n, ok in zip(nodes, seen) if not ok]
    if blind:
        raise M2DError(f"storage {url} is not visible from {len(blind)} of {len(nodes)} Ray nodes ({', '.join(blind[:3])}); "
                       "give --storage a path every node mounts (NFS/EFS) or an s3:// / gs:// URI")


def teacher_for_workers(model: str, url: str) -> str:
    """How Ray workers reach the teacher: a hub name, a storage URL or the embedded teacher as they are; a
    directory on the driver's disk as is on a one-machine Ray, else copied into the storage once."""
    from m2d_ray.models import default_teacher

    path = Path(model).expanduser()
    if storage.is_remote(model) or not path.exists() or model == default_teacher() or not on_cluster():
        return model
    if not storage.is_remote(url) and storage.filesystem(url)[1] in (str(path.resolve()), *map(str, path.resolve().parents)):
        return model  # already inside the (shared) storage
    files = sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256(json.dumps([(str(p.relative_to(path)), p.stat().st_size) for p in files]).encode()).hexdigest()[:12]
    target = storage.join(url, "teacher", f"{path.name}-{digest}")
    if not storage.exists(target):
        size = sum(p.stat().st_size for p in files)
        say(f"teacher: copying {path} ({size / 1e6:,.1f} MB) into the run's storage once, so that every node reads it")
        from m2d_ray.artifacts import write_marker

        def build(dest: Path) -> None:
            import shutil

            shutil.copytree(path, dest, dirs_exist_ok=True)
            write_marker(dest, "teacher")  # last: the copy is complete or absent

        storage.save_dir(target, build)
    return target
