"""The ways a command fails on purpose: bad input (exit 2), work that produced nothing (exit 1), a full disk (3)."""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator

#: the errors of a filesystem that takes no more (full, over its quota, read-only): errno -> the user's words
FULL = {errno.ENOSPC: "no space left", errno.EDQUOT: "over its quota", errno.EROFS: "read-only"}
#: the same as text, where an error crossed a process (a Ray worker's traceback, a Rust library's "os error 28")
_FULL_TEXT = {
    errno.ENOSPC: re.compile(r"No space left on device|\[Errno 28\]|os error 28"),
    errno.EDQUOT: re.compile(r"Disk quota exceeded|\[Errno 122\]|os error 122"),
    errno.EROFS: re.compile(r"Read-only file system|\[Errno 30\]|os error 30"),
}


class M2DError(Exception):
    """Bad input that the user can fix; the message says how. The CLI prints one line and exits 2."""


class RunFailed(Exception):
    """The input was fine but the work failed as a whole (every student failed, …). One line, exit 1."""


class StorageFull(RunFailed):
    """A filesystem the run writes to is full, over its quota or read-only: the stage ends with one line (which path,
    what the plan expected there, how to resume) and exit 3; what was written whole stays, and a resume goes on."""


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or during, each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def full_disk(err: BaseException | str | None) -> str | None:
    """The user's words for a full, over-quota or read-only filesystem behind `err` (its errno anywhere in the chain
    of causes, or its text where it crossed a process), else None."""
    chain = list(causes(err)) if isinstance(err, BaseException) else []
    codes = {e.errno for e in chain if isinstance(e, OSError)}
    texts = [str(e) for e in chain] if chain else [str(err or "")]
    for code, pattern in _FULL_TEXT.items():
        if code in codes or any(pattern.search(t) for t in texts):
            return FULL[code]
    return None
