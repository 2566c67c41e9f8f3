"""`m2d families`: every MoE family m2d converts, one a line with its student and how exact it is, then every family
it refuses with why (the reference page *MoE families* is the same table).

    MODEL_TYPE  student; exact to / what differs      one line per family (stdout)
"""

from __future__ import annotations

from m2d_ray.arch import family_rows
from m2d_ray.console import emit


def main(args) -> None:
    rows = family_rows()
    width = max(len(r[0]) for r in rows)
    for name, _, student, exact in rows:
        emit(f"{name:<{width}}  {student}; {exact}")
