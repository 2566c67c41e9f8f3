"""The ways a command fails on purpose: bad input (exit 2), work that produced nothing (exit 1), a full disk (3)."""

from __future__ import annotations

import errno
import re

#: the errors of a filesystem that takes no more (full, over its quota, read-only): errno -> the user's words
FULL = {errno.ENOSPC: "no space left", errno.EDQUOT: "over its quota", errno.EROFS: "read-only"}
#: the same as text, where an error crossed a process (a Ray worker's, a Rust library's "os error 28")
_FULL_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|Read-only file system|\[Errno (?:28|122|30)\]|os error (?:28|122|30)"
)


class M2DError(Exception):
    """Bad input that the user can fix; the message says how. The CLI prints one line and exits 2."""


class RunFailed(Exception):
    """The input was fine but the work failed as a whole (every student failed, …). One line, exit 1."""


class StorageFull(RunFailed):
    """A filesystem the run writes to is full, over its quota or read-only: the stage ends with one line (which path,
    what the plan expected there, how to resume) and exit 3; what was written whole stays, and a resume goes on."""


def full_disk(err: BaseException | str | None) -> str | None:
    """The user's words for a full, over-quota or read-only filesystem behind `err` (its errno anywhere in the chain
    of causes, or its text where it crossed a process), else None."""
    seen = set()
    while isinstance(err, BaseException) and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in FULL:
            return FULL[err.errno]
        if _FULL_TEXT.search(str(err)):
            break
        err = err.__cause__ or err.__context__
    m = _FULL_TEXT.search(str(err)) if err is not None else None
    if m is None:
        return None
    text = m.group(0)
    if "quota" in text or "122" in text:
        return FULL[errno.EDQUOT]
    return FULL[errno.EROFS] if "Read-only" in text or text.endswith("30") or "30]" in text else FULL[errno.ENOSPC]
