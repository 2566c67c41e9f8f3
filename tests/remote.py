"""A `ray job submit` command line as it travels: the submitting shell (a laptop's, or KubeRay's submitter pod's) parses
it and expands what it sees unquoted; `ray job submit` joins the arguments after `--` with `shlex.join` (Ray 2.60's
job CLI); the head's job supervisor runs that string with a shell (`shell=True`). What the driver gets is what ran
through both shells, each with its own $HOME."""

from __future__ import annotations

import shlex
import subprocess

LAPTOP_HOME, HEAD_HOME = "/laptop/home", "/home/ubuntu"


def _argv(script: str, home: str) -> list[str]:
    out = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", script],
        env={"HOME": home, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\0")[:-1]


def submitted(command: str, laptop_home: str = LAPTOP_HOME) -> list[str]:
    """The arguments of `ray job submit` after `--`, as the submitting shell passes them."""
    args = _argv(f"ray() {{ printf '%s\\0' \"$@\"; }}\n{command}", laptop_home)
    assert args[:2] == ["job", "submit"] and "--" in args, args
    return args[args.index("--") + 1 :]


def on_head(command: str, laptop_home: str = LAPTOP_HOME, head_home: str = HEAD_HOME) -> list[str]:
    """The driver's argv on the head: the entrypoint Ray builds (shlex.join), run by the head's shell."""
    entrypoint = shlex.join(submitted(command, laptop_home))
    return _argv(f"printf '%s\\0' {entrypoint}", head_home)
