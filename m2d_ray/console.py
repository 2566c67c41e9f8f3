"""What the user sees: the platform's own lines on the terminal, every library's output in a log file.

A command runs inside `session()`. File descriptors 1 and 2 — where Ray, Tune, Ray Data, MLflow,
DeepSpeed, transformers and C++ cores write, from Python or not — are sent through a pipe into the log
(and, with --verbose, to the terminal as well); Python warnings are logged and summarised once at the end.
Platform code talks to the user through `say` (a line on the real stderr, copied to the log), `emit`
(the command's result on the real stdout) and `progress` (a live bar when stderr is a terminal).
Outside a session (library use, tests) these write to sys.stderr / sys.stdout as usual.

The log starts in the temp directory; `keep_logs_in(dir)` moves it next to the run it belongs to once
the command has created that run. A command that fails on bad input leaves no log behind; an
unexpected failure keeps it and says where it is (it is what a user sends in a bug report).
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO, TypeVar

from tqdm.auto import tqdm

from m2d_ray.errors import M2DError

T = TypeVar("T")


class _Session:
    def __init__(self, command: str, verbose: bool) -> None:
        self.verbose = verbose
        self.out = _user_stream(sys.stdout)
        self.err = _user_stream(sys.stderr)
        self.name = f"m2d-{command}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        fd, path = tempfile.mkstemp(prefix=f"{self.name[:-4]}-", suffix=".log")
        self.log_path = Path(path)
        self.log = os.fdopen(fd, "ab", buffering=0)
        self.kept = False  # moved into a run directory (keep_logs_in): never deleted
        self.lock = threading.Lock()
        self.warnings: collections.Counter[str] = collections.Counter()
        self.at_line_start = True

    def write_log(self, data: bytes) -> None:
        with self.lock:
            if not self.log.closed and data:
                self.log.write(data)
                self.at_line_start = data.endswith(b"\n")

    def write_line(self, line: str) -> None:
        """A platform line on a line of its own: library output may have left a partial line in the log."""
        with self.lock:
            if not self.log.closed:
                self.log.write(("" if self.at_line_start else "\n").encode() + f"[m2d] {line}\n".encode())
                self.at_line_start = True


_session: _Session | None = None
last_log: Path | None = None  # the log the last session kept (for the CLI's "see the log" line)


def _user_stream(stream: TextIO) -> TextIO:
    """A private handle on what the user sees: a duplicate of its descriptor (fd 1/2 get redirected),
    or the stream object itself when it has none (pytest's capsys)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return stream
    stream.flush()
    return os.fdopen(
        os.dup(fd), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8", errors="replace"
    )


def active() -> bool:
    return _session is not None


def _user_err() -> TextIO:
    return _session.err if _session else sys.stderr


def say(message: str) -> None:
    """One platform line for the user (stderr, above any live progress bar), also written to the log."""

    tqdm.write(message, file=_user_err())
    if _session is not None:
        _session.write_line(message)


def note(message: str) -> None:
    """A platform line for the log only (details behind a one-line error, kept when the log is)."""
    if _session is not None:
        _session.write_line(message)


def emit(message: str) -> None:
    """The command's result (stdout): the one line a script reads."""
    print(message, file=_session.out if _session else sys.stdout, flush=True)


def bar(total: int | None, desc: str, unit: str = "it"):
    """A live progress bar on the user's stderr when it is a terminal (a silent no-op bar otherwise)."""

    stream = _user_err()
    tty = bool(getattr(stream, "isatty", lambda: False)())
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not tty, leave=False, dynamic_ncols=True)


def progress(items: Iterable[T], total: int | None = None, desc: str = "", unit: str = "it") -> Iterator[T]:
    """`items`, with a live progress bar while they are consumed (see `bar`)."""
    with bar(total, desc, unit) as b:
        for item in items:
            yield item
            b.update()


def log_path() -> Path | None:
    return _session.log_path if _session else None


def keep_logs_in(directory: str | Path) -> Path | None:
    """Move this command's log into `directory` (RUN_DIR/logs) and keep it there; returns its new path."""
    s = _session
    if s is None:
        return None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / s.name
    with s.lock:
        if dest != s.log_path:  # copy + reopen: the run directory may be on another file system
            new = open(dest, "ab", buffering=0)
            with open(s.log_path, "rb") as old:
                shutil.copyfileobj(old, new)
            s.log.close()
            s.log_path.unlink(missing_ok=True)
            s.log, s.log_path = new, dest
        s.kept = True
    return dest


def _pump(read_fd: int, s: _Session, echo: int | None) -> None:
    """Copy everything written to the redirected descriptors into the log (and to the terminal when verbose)."""
    while chunk := os.read(read_fd, 65536):
        s.write_log(chunk)
        if echo is not None:
            with contextlib.suppress(OSError):
                os.write(echo, chunk)
    os.close(read_fd)


@contextlib.contextmanager
def session(command: str, verbose: bool = False) -> Iterator[None]:
    """Run a command with library output in its log; on exit, summarise warnings and tidy the log.

    A block that raises keeps the log unless the exception is bad input (M2DError): that costs nothing.
    """

    global _session
    if _session is not None:  # nested (a command calling another): the outer session owns the output
        yield
        return
    s = _Session(command, verbose)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    read_fd, write_fd = os.pipe()
    echo = os.dup(s.err.fileno()) if verbose and _has_fd(s.err) else None
    pump = threading.Thread(target=_pump, args=(read_fd, s, echo), daemon=True, name="m2d-console")
    pump.start()
    for fd in (1, 2):
        os.dup2(write_fd, fd)
    os.close(write_fd)
    old_streams = sys.stdout, sys.stderr
    sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")
    old_showwarning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        s.warnings[f"{category.__name__}: {str(message).splitlines()[0][:160]}"] += 1
        s.write_log(warnings.formatwarning(message, category, filename, lineno, line).encode())

    warnings.showwarning = showwarning
    _session = s
    failed: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        failed = exc
        raise
    finally:
        _session = None
        warnings.showwarning = old_showwarning
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr = old_streams
        for fd, dup in saved.items():
            os.dup2(dup, fd)  # closes the pipe's write ends held by 1 and 2: the pump sees EOF
            os.close(dup)
        pump.join(timeout=5)
        if echo is not None:
            os.close(echo)
        _finish(s, failed, M2DError)


def _has_fd(stream: TextIO) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False


def _finish(s: _Session, failed: BaseException | None, bad_input: type) -> None:
    """Summarise warnings; keep the log of a run or of an unexpected failure, drop the rest."""
    global last_log
    keep = s.kept or (failed is not None and not isinstance(failed, (bad_input, KeyboardInterrupt, SystemExit)))
    last_log = s.log_path if keep else None
    if s.warnings and failed is None:
        n = sum(s.warnings.values())
        top = "; ".join(f"{c}x {m}" if c > 1 else m for m, c in s.warnings.most_common(3))
        more = f" (+{len(s.warnings) - 3} more kinds)" if len(s.warnings) > 3 else ""
        where = f", all in {s.log_path}" if keep else ""
        line = f"m2d: {n} library warning{'s' * (n > 1)}{where}: {top}{more}"
        print(line, file=s.err, flush=True)
        s.write_line(line)
    s.log.close()
    if not keep:
        s.log_path.unlink(missing_ok=True)
    for stream in (s.out, s.err):
        if stream not in (sys.stdout, sys.stderr) and _has_fd(stream):
            with contextlib.suppress(Exception):
                stream.close()
