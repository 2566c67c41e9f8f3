"""On-disk contracts between stages: atomic directory writes, checksums, manifests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from m2d_ray.errors import M2DError

#: every directory the platform writes carries this file: {"kind": ..., "created": ...}; only a
#: directory with it (and of the same kind) is ever replaced, and only when the user asks (--overwrite)
MARKER = "m2d_output.json"
KINDS = (
    "statistics",
    "student",
    "distillation",
    "run",
    "report",
    "teacher",
    "pruned",
    "tokens",
    "targets",
    "data",
    "analysis",
)


def output_kind(path: str | os.PathLike) -> str | None:
    """The kind of platform output stored in directory `path` (from its marker), else None."""
    try:
        kind = json.loads((Path(path) / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in KINDS else None


def write_marker(path: str | os.PathLike, kind: str) -> None:
    assert kind in KINDS, kind
    write_json_atomic(Path(path) / MARKER, {"kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def check_output(path: str | os.PathLike, kind: str, overwrite: bool = False, what: str = "--out") -> Path:
    """Refuse, before any work, an output path this command may not write.

    Allowed: a path that does not exist, an empty directory, or — with `overwrite` — a directory
    holding a previous output of the same kind. A file, anything under a file, or a directory m2d
    did not write (or wrote as something else) is never touched.
    """
    p = Path(path).expanduser()
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        raise M2DError(f"{what} {p} is an existing file; m2d never replaces it: choose another path or move it away")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise M2DError(f"{what} {p} is inside {parent}, which is a file: choose a new path")
            break
    if p.is_dir() and any(p.iterdir()):
        found = output_kind(p)
        if found != kind:
            what_is = (
                f"holds an m2d {found}, not {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
                if found
                else "is a non-empty directory that m2d did not write"
            )
            raise M2DError(f"{what} {p} {what_is}; m2d never replaces it: choose another path or move it away")
        if not overwrite:
            raise M2DError(
                f"{what} {p} already holds an m2d {kind}; pass --overwrite to replace it, or choose a new path"
            )
    return p


def make_dirs(path: Path) -> list[Path]:
    """mkdir -p that returns the directories it created (outermost first), so a failure can remove them."""
    missing = [q for q in [path, *path.parents] if not q.exists()][::-1]
    for q in missing:
        q.mkdir(exist_ok=True)
    return missing


def remove_created(created: list[Path]) -> None:
    """Undo `make_dirs`: remove the directories it created, innermost first, if still empty."""
    for q in reversed(created):
        with contextlib.suppress(OSError):
            q.rmdir()


def replace_dir(final: Path, new: Path) -> None:
    """Put directory `new` at `final`; a previous `final` is removed only once `new` is in place.

    Callers have checked that `final` may be replaced (check_output)."""
    if final.is_dir() and any(final.iterdir()):
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        new.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if final.is_dir():
            final.rmdir()
        new.rename(final)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, kind: str, overwrite: bool = False, what: str = "--out") -> Iterator[Path]:
    """Yield a temp directory next to `final`; rename it into place only if the block succeeds.

    `final` must pass `check_output` (checked before and again at the rename). A crash or an exception
    leaves `final` as it was and removes the parent directories this call created; a replaced
    previous output is removed only once the new one is in place.
    """
    final = check_output(final, kind, overwrite, what)
    created = make_dirs(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the result should look like any other directory
    ok = False
    try:
        yield tmp
        write_marker(tmp, kind)
        check_output(final, kind, overwrite, what)
        replace_dir(final, tmp)
        ok = True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if not ok:
            remove_created(created)


def write_text_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Write a file through a temp file + rename: readers see the old or the new file, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
