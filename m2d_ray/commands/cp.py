"""`m2d cp NAME DEST`: a shipped config copied out to edit (DEST a file, or a directory that gets NAME.yaml), with
the bases it includes beside it so that the copy reads as the original did. The platform never overwrites what it
did not create: a DEST (or a base) that exists with other content is refused in one line (exit 2).

    the path written, one line (stdout)
"""

from __future__ import annotations

from pathlib import Path

import yaml

from m2d_ray import shipped
from m2d_ray.artifacts import write_text_atomic
from m2d_ray.console import emit, say
from m2d_ray.errors import M2DError


def main(args) -> None:
    source = shipped.named(args.name)
    dest = Path(args.dest).expanduser()
    if dest.is_dir():
        dest = dest / source.name
    copies = [(source, dest)]
    base = source
    while (include := (yaml.safe_load(base.read_text()) or {}).get("include")) is not None:
        base = base.parent / include
        copies.append((base, dest.parent / include))
    for src, to in copies:  # every refusal before any write
        if to.exists() and (to is dest or to.read_text() != src.read_text()):
            raise M2DError(f"{to} exists; m2d cp never overwrites a file: give another DEST or remove it")
    for src, to in reversed(copies):
        if not to.exists():
            to.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(to, src.read_text())
            if to is not dest:
                say(f"{to}: the base {dest.name} includes, copied beside it")
    emit(str(dest))
