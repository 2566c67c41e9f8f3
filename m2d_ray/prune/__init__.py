"""Dense-to-dense (Minitron) pruning: the paper's D2D baseline at matched parameters (plain torch).

importance.py  one calibration pass -> per-unit importance (FFN neurons, head groups, hidden channels, layers)
prune.py       importance + sizes -> the teacher's own class at those sizes; `PrunedSpec` (picklable) builds it
search.py      candidate shapes at a parameter budget, scored by pre-distillation perplexity; the best promoted
export.py      save + reload check; command.py: `m2d prune-dense`
"""

from m2d_ray.arch.dense import DenseSizes
from m2d_ray.prune.importance import Importance, collect_importance
from m2d_ray.prune.prune import PrunedSpec, check_sizes, prune
from m2d_ray.prune.search import (
    SearchResult,
    candidates,
    count_params,
    moe_student_params,
    search,
)

__all__ = [
    "DenseSizes",
    "Importance",
    "collect_importance",
    "PrunedSpec",
    "check_sizes",
    "prune",
    "SearchResult",
    "candidates",
    "count_params",
    "moe_student_params",
    "search",
]
