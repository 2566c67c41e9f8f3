"""The two ways a command fails on purpose: bad input (exit 2) and a run that produced nothing (exit 1)."""


class M2DError(Exception):
    """Bad input that the user can fix; the message says how. The CLI prints one line and exits 2."""


class RunFailed(Exception):
    """The input was fine but the work failed as a whole (every student failed, …). One line, exit 1."""
