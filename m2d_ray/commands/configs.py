"""`m2d configs`: the example configs shipped with the package, one a line with what it is (its first comment);
`m2d run NAME`, `m2d plan NAME` read one by name from any directory, `m2d cp NAME DEST` copies one out to edit
(torchtune's `tune ls` / `tune cp`).

    NAME  what it is          one line per shipped config (stdout)
"""

from __future__ import annotations

from m2d_ray import shipped
from m2d_ray.console import emit


def main(args) -> None:
    found = shipped.configs()
    width = max(map(len, found))
    for name, path in found.items():
        emit(f"{name:<{width}}  {shipped.first_comment(path)}")
