"""Prune a dense teacher to given sizes by importance, into the teacher's own class.

Every kept unit keeps its weights (Minitron prunes, it does not merge): the layers with the highest
block importance, then in every kept layer the most important key/value groups (with their query heads)
and FFN neurons, and the most important hidden channels everywhere (embeddings, every projection, every
norm, the head). Kept indices stay in their original order, so keeping everything reproduces the teacher
bit for bit. The result is built on the meta device and takes the sliced tensors as its own (memory grows
with the student: no randomly initialised copy is made).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from m2d_ray.arch.dense import (
    FFN,
    HIDDEN,
    KV,
    DenseAdapter,
    DenseSizes,
    Q,
    get_dense_adapter,
)
from m2d_ray.convert.student import materialise_buffers
from m2d_ray.errors import M2DError
from m2d_ray.models import load_model, load_tokenizer
from m2d_ray.prune.export import export_pruned
from m2d_ray.prune.importance import Importance

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def check_sizes(config, sizes: DenseSizes) -> None:
    """Sizes that make a valid config of the teacher's class: within the teacher, whole key/value groups."""
    adapter = get_dense_adapter(config)
    full, g = adapter.sizes(config), adapter.group_size(config)
    for field in ("hidden", "ffn", "heads", "layers"):
        v, top = getattr(sizes, field), getattr(full, field)
        if not 1 <= v <= top:
            raise M2DError(f"--{field} {v} is outside [1, {top}] (the teacher's {field}); give a size in that range")
    if sizes.heads % g:
        raise M2DError(
            f"--heads {sizes.heads} is not a multiple of {g}, the teacher's query heads per key/value head: "
            f"heads are pruned a whole group at a time; use one of {list(range(g, full.heads + 1, g))}"
        )


def _top(scores: Tensor, k: int) -> Tensor:
    """Indices of the k highest scores, in their original order (ties: the lower index first)."""
    order = torch.argsort(scores, descending=True, stable=True)[:k]
    return order.sort().values


@dataclass(frozen=True)
class Keep:
    """What survives: layers (teacher indices), hidden channels, and per kept layer FFN neurons and the
    row indices of the query and key/value projections."""

    layers: list[int]
    hidden: Tensor
    ffn: dict[int, Tensor]
    q: dict[int, Tensor]
    kv: dict[int, Tensor]

    def index(self, kind: str, layer: int | None) -> Tensor:
        return self.hidden if kind == HIDDEN else {FFN: self.ffn, Q: self.q, KV: self.kv}[kind][layer]


def keep_sets(config, adapter: DenseAdapter, sizes: DenseSizes, imp: Importance) -> Keep:
    g, hd = adapter.group_size(config), adapter.head_dim(config)
    kv_heads = sizes.heads // g
    layers = _top(imp.layers, sizes.layers).tolist()
    groups = imp.groups(g)
    ffn, q, kv = {}, {}, {}
    for i in layers:
        kept = _top(groups[i], kv_heads)
        heads = (kept[:, None] * g + torch.arange(g)).reshape(-1)
        q[i] = (heads[:, None] * hd + torch.arange(hd)).reshape(-1)
        kv[i] = (kept[:, None] * hd + torch.arange(hd)).reshape(-1)
        ffn[i] = _top(imp.ffn[i], sizes.ffn)
    return Keep(layers=layers, hidden=_top(imp.hidden, sizes.hidden), ffn=ffn, q=q, kv=kv)


def pruned_state(teacher: PreTrainedModel, adapter: DenseAdapter, keep: Keep) -> dict[str, Tensor]:
    """The teacher's state dict restricted to the kept units, layers renumbered 0..L'-1."""
    new_index = {old: new for new, old in enumerate(keep.layers)}
    state = {}
    for name, t in teacher.state_dict().items():
        layer, pattern = adapter.split_layer(name)
        if layer is not None and layer not in new_index:
            continue
        for dim, kind in enumerate(adapter.axes(name)):
            if kind is not None:
                t = t.index_select(dim, keep.index(kind, layer).to(t.device))
        state[pattern.format(new_index[layer]) if layer is not None else name] = t.contiguous()
    return state


def prune(teacher: PreTrainedModel, sizes: DenseSizes, importance: Importance) -> PreTrainedModel:
    """The teacher pruned to `sizes` by `importance`: an instance of the teacher's own class, in eval mode."""
    adapter = get_dense_adapter(teacher.config)
    check_sizes(teacher.config, sizes)
    keep = keep_sets(teacher.config, adapter, sizes, importance)
    config = adapter.pruned_config(teacher.config, sizes, keep.layers)
    dtype = next(teacher.parameters()).dtype
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if type(student) is not type(teacher):
        raise RuntimeError(f"pruned model is a {type(student).__name__}, not the teacher's {type(teacher).__name__}")
    state = pruned_state(teacher, adapter, keep)
    student.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        student.tie_weights()
    materialise_buffers(student, teacher)
    return student.eval()


@dataclass(frozen=True)
class PrunedSpec:
    """A pruned student, described: picklable, so a Ray worker can build it where it will train."""

    teacher: str  # the dense teacher: a directory or a hub name
    sizes: DenseSizes
    importance: Importance
    name: str = ""

    def build(self, device: str = "cpu", dtype: torch.dtype | None = None) -> PreTrainedModel:

        teacher, _ = load_model(self.teacher, device=device, dtype=dtype, what="teacher")
        return prune(teacher, self.sizes, self.importance)

    def __call__(self, out: Path) -> None:
        """Build the student and save it at `out` (checked to reload natively): how a stage-2 worker
        materialises the D2D student where it trains, instead of reading it from the driver's disk."""

        info = {"model": self.teacher, "sizes": self.sizes.to_json(), "candidate": self.name}
        export_pruned(self.build(), load_tokenizer(self.teacher), out, self.sizes, self.importance, info)
