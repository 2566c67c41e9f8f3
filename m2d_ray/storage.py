"""A run's storage: what Ray workers read and write, at a place every node reaches.

A run has two places. Its directory on the driver holds what only the driver touches (config, ledgers,
MLflow store, report, logs). Its *storage* holds everything that crosses nodes — initial and distilled
students, Train checkpoints, Tune state, a teacher copied there for the workers: a local path (default:
the run directory itself, so a laptop run is laid out as before), a path every node mounts (NFS/EFS), or
an ``s3://`` / ``gs://`` URI, through ``pyarrow.fs`` as Ray's own ``storage_path`` (query parameters
such as ``?endpoint_override=…`` are kept). A location in storage is a plain string, a *storage URL*.

Directories are stored complete or not at all: their files go first and the marker file
(``m2d_output.json``) last, so `exists` never sees half a directory. Workers read them back through a
node-local cache (``$M2D_CACHE``, default ``~/.cache/m2d``) that is filled once per node.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs

from m2d_ray.artifacts import MARKER

_COPY_BLOCK = 8 << 20


def is_remote(url: str) -> bool:
    """True for a URI (s3://, gs://, …); False for a local or mounted path."""
    return "://" in str(url) and not str(url).startswith("file://")


def join(url: str, *parts: str) -> str:
    """`url`/parts, keeping a URI's query string (``s3://b/run?endpoint_override=…``) at the end."""
    base, sep, query = str(url).partition("?")
    path = "/".join([base.rstrip("/"), *(p.strip("/") for p in parts if p)])
    return path + sep + query


def filesystem(url: str):
    """(pyarrow filesystem, path on it) of a storage URL."""

    if not is_remote(url):
        return pafs.LocalFileSystem(), str(Path(str(url).removeprefix("file://")).expanduser().resolve())
    return pafs.FileSystem.from_uri(url)


def ray_storage(url: str) -> dict:
    """`storage_path` / `storage_filesystem` arguments of Ray Tune's and Train's RunConfig for `url`."""
    fs, path = filesystem(url)
    return {"storage_path": path, "storage_filesystem": fs} if is_remote(url) else {"storage_path": path}


def exists(url: str) -> bool:
    """A complete directory (its marker is written last) or a file is at `url`."""

    fs, path = filesystem(url)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        return fs.get_file_info(f"{path}/{MARKER}").type == pafs.FileType.File
    return info.type == pafs.FileType.File


def put_dir(local: Path, url: str) -> str:
    """Copy directory `local` to `url` (a previous copy is replaced); its marker goes last."""
    fs, path = filesystem(url)
    files = sorted(p for p in Path(local).rglob("*") if p.is_file())
    fs.delete_dir_contents(path, missing_dir_ok=True)
    fs.create_dir(path, recursive=True)
    for f in sorted(files, key=lambda p: p.name == MARKER):
        rel = f.relative_to(local).as_posix()
        if "/" in rel:
            fs.create_dir(f"{path}/{rel.rsplit('/', 1)[0]}", recursive=True)
        with f.open("rb") as src, fs.open_output_stream(f"{path}/{rel}") as dst:
            shutil.copyfileobj(src, dst, _COPY_BLOCK)
    return url


def put_file(local: Path, url: str) -> str:
    """Copy file `local` to `url`, complete or not at all (a local target is written aside and renamed;
    an object store shows an object only once its upload is complete)."""
    fs, path = filesystem(url)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    target = path if is_remote(url) else f"{path}.m2d-tmp-{os.getpid()}"
    with Path(local).open("rb") as src, fs.open_output_stream(target) as dst:
        shutil.copyfileobj(src, dst, _COPY_BLOCK)
    if target != path:
        os.replace(target, path)
    return url


def save_dir(url: str, build: Callable[[Path], object]) -> str:
    """Store the directory that `build(path)` writes at `url` and return `url`.

    Local storage: `build` writes in place (it writes atomically, e.g. through `atomic_dir`). Remote: it
    writes a temp directory that is uploaded, marker last.
    """
    if not is_remote(url):
        build(Path(filesystem(url)[1]))
        return url
    with tempfile.TemporaryDirectory(prefix="m2d-upload-") as tmp:
        local = Path(tmp) / "dir"
        build(local)
        return put_dir(local, url)


def cache_root() -> Path:
    return Path(os.environ.get("M2D_CACHE", "~/.cache/m2d")).expanduser()


def fetch_dir(url: str, without: tuple[str, ...] = ()) -> Path:
    """A local path holding the directory at `url`: the path itself on local or mounted storage, else a
    copy in this node's cache (downloaded once; a partial download is never used). `without`: name endings
    of files left out of the copy (a model's weights, where only its tokenizer is wanted)."""
    fs, path = filesystem(url)
    if not is_remote(url):
        return Path(path)

    dest = cache_root() / "storage" / hashlib.sha256((url + "|".join(("", *without))).encode()).hexdigest()[:24]
    if (dest / MARKER).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        for info in infos:
            if info.type != pafs.FileType.File or info.base_name.endswith(without):
                continue
            target = tmp / info.path[len(path) :].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(info.path) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, _COPY_BLOCK)
        if not (tmp / MARKER).exists():
            raise FileNotFoundError(f"{url} holds no complete m2d directory (no {MARKER})")
        try:
            tmp.rename(dest)
        except OSError:  # another process of this node finished first
            if not (dest / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def local_model(name: str) -> str:
    """What `from_pretrained` can open: a storage URL is fetched (node cache); a path or hub name is kept."""
    return str(fetch_dir(name)) if is_remote(name) else name


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    with fs.open_input_stream(path) as f:
        return f.read()


def write_bytes(url: str, data: bytes) -> None:
    fs, path = filesystem(url)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def open_ranged(url: str):
    """The object at `url` opened for positional reads (pyarrow's RandomAccessFile: `read_at(n, offset)`, `size()`;
    on S3 each read is a ranged GET): a few tensors of a large file without copying the file."""
    fs, path = filesystem(url)
    return fs.open_input_file(path)


def fetch_file(url: str) -> Path:
    """A local path holding the file at `url` (cached per node like `fetch_dir`)."""
    fs, path = filesystem(url)
    if not is_remote(url):
        return Path(path)
    dest = cache_root() / "files" / hashlib.sha256(url.encode()).hexdigest()[:24] / Path(path).name
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        with os.fdopen(fd, "wb") as dst, fs.open_input_stream(path) as src:
            shutil.copyfileobj(src, dst, _COPY_BLOCK)
        os.replace(tmp, dest)
    return dest


def list_names(url: str) -> list[str]:
    """Names of the files directly in the directory at `url` (none when it does not exist)."""

    fs, path = filesystem(url)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)


def delete(url: str) -> None:
    """Remove the file at `url` (gone already is fine)."""

    fs, path = filesystem(url)
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)


def delete_dir(url: str) -> bool:
    """Remove the directory at `url` and everything below it (gone already is fine); True when there was one."""

    fs, path = filesystem(url)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return False
    fs.delete_dir(path)
    return True
