"""Parts of a call fitted to a device budget, and a command kept to its share of it.

A call on a lent machine (the GPU acceptance call) has a fixed number of seconds: each part has variants, largest
first, with an estimate of their seconds; `plan` keeps what fits, every required part before any grows; `run_logged`
runs a part's command in its own process group and kills the whole group (Ray's processes with it) past its share.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class TimedOut(Exception):
    """A part's command ran past its share of the budget and was killed."""


@dataclass(frozen=True)
class Variant:
    """One size of a part: a label for the plan, its estimated seconds, and the settings its runner reads."""

    label: str
    est_s: float
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Part:
    name: str
    required: bool
    variants: tuple[Variant, ...]  # largest first
    run: Callable[..., dict]  # (context, variant) -> {"rows": [(row name, figures)], "failed": why or None, ...}


def plan(parts: list[Part], left_s: float) -> tuple[dict[str, int], list[str]]:
    """{part name: variant index} of the parts that fit `left_s` seconds (a part left out is skipped), and one line
    per part saying what it runs, or why it shrank or was skipped. Coverage first, then size, required parts
    before optional ones: each group's parts join at their smallest variant in priority order (the order of
    `parts`) while they fit, then grow towards their largest in the same order."""
    choice: dict[str, int] = {}

    def est(p: Part, i: int) -> float:
        return p.variants[i].est_s

    def total() -> float:
        return sum(est(p, choice[p.name]) for p in parts if p.name in choice)

    for group in ([p for p in parts if p.required], [p for p in parts if not p.required]):
        for p in group:
            if total() + est(p, -1) <= left_s:
                choice[p.name] = len(p.variants) - 1
        for p in group:
            while (
                p.name in choice
                and choice[p.name] > 0
                and total() - est(p, choice[p.name]) + est(p, choice[p.name] - 1) <= left_s
            ):
                choice[p.name] -= 1
    lines = []
    for p in parts:
        if p.name not in choice:
            lines.append(
                f"{p.name}: skipped: its smallest variant ({p.variants[-1].label}) needs ~{est(p, -1):.0f} s, "
                f"{max(0.0, left_s - total()):.0f} s of {left_s:.0f} s are left beside the parts kept"
            )
            continue
        v = p.variants[choice[p.name]]
        shrunk = (
            f" (shrunk from {p.variants[0].label}, ~{est(p, 0):.0f} s, to fit {left_s:.0f} s)" if choice[p.name] else ""
        )
        lines.append(f"{p.name}: {v.label}, ~{v.est_s:.0f} s{shrunk}")
    return choice, lines


@dataclass(frozen=True)
class Share:
    """A part's share of the budget: `seconds` from `started` (a time.monotonic() reading, by default now)."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)


#: the command `run_logged` is running (empty between commands): what a call killed from outside ends first
RUNNING: list[subprocess.Popen] = []


def run_logged(
    cmd: list,
    log: Path,
    share: Share,
    cwd: Path | None = None,
    check: bool = True,
    poll: Callable[[], None] | None = None,
    every_s: float = 2.0,
) -> tuple[int, str]:
    """Run `cmd` in its own process group within its `share` of the budget: (exit status, stdout); stderr to LOG.log,
    stdout to LOG.out. Past the share the whole group is killed (TimedOut); a nonzero exit raises RuntimeError
    naming the log, unless not `check`. `poll()` is called every `every_s` seconds while it runs (a caller rewriting
    what it has so far)."""
    cmd = [str(c) for c in cmd]
    print("$ " + " ".join(cmd), flush=True)
    with open(f"{log}.log", "w") as err, open(f"{log}.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=cwd, start_new_session=True)
        RUNNING.append(proc)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=max(0.1, min(every_s if poll else 1e9, share.left())))
                    break
                except subprocess.TimeoutExpired:
                    if poll is None or share.left() <= 0.1:
                        kill_group(proc)
                        raise TimedOut(f"killed after {share.seconds:.0f} s (the part's share of the budget)") from None
                    poll()
        finally:
            RUNNING.remove(proc)
    stdout = Path(f"{log}.out").read_text()
    if rc and check:
        raise RuntimeError(f"`{' '.join(cmd[:4])} ...` exited {rc}; see {log}.log")
    return rc, stdout


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL to what is left of it once the child has gone or after 10 s (Ray's
    processes share the group, or die with the driver that started them)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
