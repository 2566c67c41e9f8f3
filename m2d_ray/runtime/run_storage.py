"""The contract between the driver and its Ray workers: `RunStorage`, the one object that names every
place a worker reads or writes, built once on the driver and passed to every stage and worker.

Workers may run on nodes that do not see the driver's disk, so nothing reaches them as a driver-side
path. The storage (a local path, a path every node mounts, or ``s3://`` / ``gs://``) must be reachable
from every node: the driver puts a mark in it (`mark`), and each node looks for it the first time it works for
the run (`ensure_visible`, once per node), so that nodes an autoscaler adds later are checked too and a node
that leaves is never waited for. What workers read
is put there once: the user's text files (content-addressed: the same file is stored once) and, on a
cluster, a teacher directory from the driver's disk. Hub names, storage URLs and the embedded teacher
and corpus travel as they are.

    STORAGE/                        (a run: `storage:` / --storage, default the run directory)
      .m2d-storage                  the driver's mark: a node that does not see it does not see the storage
      data/<sha>/<file or files>    corpora on the driver's disk the workers read (distillation, validation, d2d search)
      tokens/<digest>/              the distillation stream tokenised once (shards + validation ids)
      targets/<digest>/             the teacher's cached targets over those tokens (stage2.targets)
      teacher/<name>-<digest>/      a driver-side teacher copied for the workers (on a cluster; student/ likewise)
      tune/                         stage-1 Tune state
      stage2/{init,students}/KEY    initial and distilled students
      stage2/train/KEY  stage2/tune Ray Train checkpoints, stage-2 Tune state
      analysis/KEY/batch-NNNNN.jsonl  a model's generated answers, a batch a file (stages/analysis.py)
    STORAGE/{init,student,train}    (`m2d distill`: one student, no key)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray

from m2d_ray import storage
from m2d_ray.artifacts import sha256_file, write_marker
from m2d_ray.console import say
from m2d_ray.data import source
from m2d_ray.errors import M2DError
from m2d_ray.models import is_embedded
from m2d_ray.runtime.ray_env import on_cluster

# Imported inside functions: what may be missing (optional packages, Ray's internal API), where its absence is handled.

MARK = ".m2d-storage"  # written by the driver (RunStorage.mark), looked for by each node (ensure_visible)


@dataclass(frozen=True)
class RunStorage:
    """Where a run's workers read and write (`root`: a storage URL). Every path below it is a method here."""

    root: str

    # ---- layout ------------------------------------------------------------------------------
    def tune(self, stage: int) -> str:
        """Ray Tune's state of stage 1 or 2."""
        return storage.join(self.root, "tune") if stage == 1 else storage.join(self.root, "stage2", "tune")

    def initial(self, key: str | None = None) -> str:
        """The initial student of a stage-2 trial (KEY), or of `m2d distill` (no key)."""
        return storage.join(self.root, "stage2", "init", key) if key else storage.join(self.root, "init")

    def student(self, key: str | None = None) -> str:
        """The distilled student of a stage-2 trial (KEY), or of `m2d distill` (no key)."""
        return storage.join(self.root, "stage2", "students", key) if key else storage.join(self.root, "student")

    def checkpoints(self, key: str | None = None) -> tuple[str, str]:
        """(storage path, run name) of a student's Ray Train run: checkpoints land in PATH/NAME."""
        return (storage.join(self.root, "stage2", "train"), key) if key else (self.root, "train")

    def drop_training_state(self, key: str | None, student_path: str | None) -> bool:
        """Remove a finished student's Train checkpoints; one that ended with a distilled model (`student_path`)
        only once that model is complete in storage. True when some were removed now."""
        if student_path is not None and not storage.exists(student_path):
            return False
        return storage.delete_dir(storage.join(*self.checkpoints(key)))

    def answers(self, key: str) -> str:
        """A model's generated answers for the analysis, one file per finished batch (evaluate/generation.py)."""
        return storage.join(self.root, "analysis", key)

    def tokens(self, digest: str) -> str:
        """A tokenised distillation stream (distill/tokens.py), shared by every student that reads it."""
        return storage.join(self.root, "tokens", digest)

    def targets(self, digest: str) -> str:
        """The teacher's cached targets over a token stream (distill/targets.py)."""
        return storage.join(self.root, "targets", digest)

    def _data(self, digest: str, name: str) -> str:
        return storage.join(self.root, "data", digest, name)

    # ---- checks (driver, before any work) -------------------------------------------------------
    def check(self) -> None:
        """The storage can be written and read back (credentials, endpoint, permissions), and is not a file."""
        probe = storage.join(self.root, f".m2d-probe-{uuid.uuid4().hex[:8]}")
        try:
            storage.write_bytes(probe, b"m2d")
            ok = storage.read_bytes(probe) == b"m2d"
            storage.delete(probe)
        except Exception as exc:  # unreachable endpoint, no bucket, no permission, a file in the way ...
            with contextlib.suppress(Exception):
                storage.delete(probe)
            raise M2DError(
                f"storage {self.root} cannot be written and read back ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160]}); "
                "give --storage a writable path every node mounts, or an s3:// / gs:// URI with credentials"
            ) from None
        if not ok:
            raise M2DError(f"storage {self.root} does not read back what was written; give another --storage")

    def mark(self) -> None:
        """(driver) Put the storage's mark, which every node looks for the first time it works for the run
        (`ensure_visible`): nodes that join later are checked too, and none is listed or pinned from here."""
        if not storage.is_remote(self.root) and not storage.exists(self._mark()):
            storage.write_bytes(self._mark(), b"m2d: this storage's mark; every node of a run checks that it sees it\n")

    def ensure_visible(self) -> None:
        """(a worker, before its first read or write) This node sees the storage: the driver's mark is there.
        Checked once per node (cached on the node); a node that does not see it fails its task with one line
        naming the node and the storage, recorded as that trial's or model's failure."""
        if storage.is_remote(self.root):
            return
        ctx = ray.get_runtime_context()
        node = ctx.get_node_id()
        cached = _node_cache() / hashlib.sha256(f"{node}\0{self.root}".encode()).hexdigest()[:24]
        if cached.exists():
            return
        if not storage.exists(self._mark()):
            address = _node_address()
            raise M2DError(
                f"node {address} cannot see the run's storage {self.root} (Ray node {node[:12]}); give --storage a "
                "path "
                "every node mounts (NFS/EFS) or an s3:// / gs:// URI"
            )
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.touch()

    def _mark(self) -> str:
        return storage.join(self.root, MARK)

    # ---- what workers read ------------------------------------------------------------------------
    def put_model(self, model: str, kind: str = "teacher") -> str:
        """How workers reach a model (a teacher, or a student given by directory): a hub name, a storage URL
        or an embedded teacher as they are; a directory on the driver's disk as is on a one-machine Ray,
        else copied into the storage once (STORAGE/KIND/NAME-DIGEST)."""

        path = Path(model).expanduser()
        if storage.is_remote(model) or not path.exists() or is_embedded(model) or not on_cluster():
            return model
        if self._holds(path):
            return model  # already inside the (shared) storage
        files = sorted(p for p in path.rglob("*") if p.is_file())
        digest = hashlib.sha256(
            json.dumps([(str(p.relative_to(path)), p.stat().st_size) for p in files]).encode()
        ).hexdigest()[:12]
        target = storage.join(self.root, kind, f"{path.name}-{digest}")
        if not storage.exists(target):
            size = sum(p.stat().st_size for p in files)
            say(
                f"{kind}: copying {path} ({size / 1e6:,.1f} MB) into the run's storage once, so that every node reads "
                "it"
            )

            def build(dest: Path) -> None:

                shutil.copytree(path, dest, dirs_exist_ok=True)
                write_marker(
                    dest, "teacher" if kind == "teacher" else "student"
                )  # last: the copy is complete or absent

            storage.save_dir(target, build)
        return target

    def put_data(self, spec: str | None) -> str | None:
        """A data spec as workers read it (data/source.py): a corpus on the driver's disk (a file, a directory,
        a glob) is put in the storage once, named by its content's sha256 (the same text is stored once), and
        given by its storage URL (with its #column); dataset names and storage URLs (s3://) are kept: read in place."""

        if spec is None:
            return None
        src = source.parse(spec)
        if src.kind != "files" or storage.is_remote(src.location):
            return spec
        suffix = "" if src.column == "text" else f"#column={src.column}"
        found = [Path(f.url) for f in source.files(src)]
        if all(self._holds(p) for p in found):
            return spec
        if len(found) == 1 and Path(src.location).expanduser().is_file():
            target = self._data(sha256_file(found[0])[:16], found[0].name)
            if not storage.exists(target):
                storage.put_file(found[0], target)
            return target + suffix

        base = Path(os.path.commonpath([str(p.parent) for p in found]))
        names = [p.relative_to(base).as_posix() for p in found]
        target = self._data(
            hashlib.sha256(json.dumps([[n, sha256_file(p)] for n, p in zip(names, found)]).encode()).hexdigest()[:16],
            "corpus",
        )
        if not storage.exists(target):
            size = sum(p.stat().st_size for p in found)
            say(
                f"data: copying {len(found)} files of {spec} ({size / 1e6:,.1f} MB) into the run's storage once, so "
                "that every node reads them"
            )

            def build(dest: Path) -> None:

                for n, p in zip(names, found):
                    (dest / n).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(p, dest / n)
                write_marker(dest, "data")  # last: the copy is complete or absent

            storage.save_dir(target, build)
        return target + suffix

    def _holds(self, path: Path) -> bool:
        """`path` lies inside this (local or mounted) storage already."""
        if storage.is_remote(self.root):
            return False
        root = Path(storage.filesystem(self.root)[1])
        return root == path.resolve() or root in path.resolve().parents


def _node_address() -> str:
    """This node's address as Ray knows it (its --node-ip-address), else this machine's."""
    try:
        from ray._private.worker import (
            global_worker,  # internal API: pinned ray==2.60.0
        )

        return global_worker.node_ip_address
    except Exception:
        return ray.util.get_node_ip_address()


def _node_cache() -> Path:
    """This node's own record of the storages it has seen (its temp directory, keyed by Ray node id)."""

    return Path(tempfile.gettempdir()) / "m2d-storage-seen"
