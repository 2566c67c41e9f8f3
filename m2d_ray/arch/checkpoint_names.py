"""Where each in-memory tensor of a model lives in its checkpoint, read from transformers' own conversion mapping
(`conversion_mapping.get_model_conversion_mapping`): the renamings it applies on load and the converters that fuse
per-expert tensors (`MergeModulelist` over experts, then `Concatenate` of gate and up). The lazy teacher reads a
tensor by these names without loading the model, exactly as `from_pretrained` would assemble it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

# Imported inside functions: transformers' conversion mapping and loading ops (they load its integrations and
# torch._dynamo, seconds that `m2d plan` does not need).

_EXPERT = re.compile(r"(?<=\.)(\d+)(?=\.)")


@dataclass(frozen=True)
class Stored:
    """An in-memory tensor's checkpoint keys: one key as is, or per-expert key templates ('{e}' = expert) stacked
    over experts and concatenated along dim 1 in this order."""

    key: str | None = None
    templates: tuple[str, ...] = ()
    dim: int = 1  # of the concatenation, or of the split
    part: tuple[int, int] | None = None  # (start, length) along `dim` of `key`: one of the tensors it is split into
    interleaved: bool = False  # `key` holds (gate, up) interleaved along `dim`: de-interleaved on read
    swap: tuple[int, int] | None = None  # `key` stored with these two dims swapped (transposed back on read)
    unread: str = ""  # why the tensor cannot be read lazily (said when it is asked for)
    #: (operations, source patterns, target patterns, this tensor's target) of a transformers converter run on read
    #: over `sources` ((pattern, checkpoint key) of each source the checkpoint has): `_by_ops`
    ops: tuple | None = None
    sources: tuple[tuple[str, str], ...] = ()
    per_expert: bool = False  # the ops work expert by expert: only the experts asked for are read


class _Absent:
    """An op the installed transformers does not have."""


def _template(key: str, expert: str) -> str:
    """The key with its expert index (the last `.N.` equal to `expert`) as '{e}'."""
    spans = [m.span() for m in _EXPERT.finditer(key) if m.group(1) == expert]
    a, b = spans[-1]
    return key[:a] + "{e}" + key[b:]


def checkpoint_map(model: nn.Module, keys: Iterable[str]) -> dict[str, Stored]:
    """In-memory name -> its checkpoint keys, for every checkpoint key transformers' mapping renames or fuses."""
    from transformers import core_model_loading as loading
    from transformers.conversion_mapping import get_model_conversion_mapping

    # the ops the installed release has (5.17 has no Split): one it lacks matches no converter
    Concatenate, Interleave, MergeModulelist, Split, Transpose = (
        getattr(loading, n, _Absent) for n in ("Concatenate", "Interleave", "MergeModulelist", "Split", "Transpose")
    )
    WeightConverter, WeightRenaming = loading.WeightConverter, loading.WeightRenaming
    dot_natural_key, rename_source_key = loading.dot_natural_key, loading.rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict(keep_vars=True)
    groups: dict[str, list[tuple[str | None, str]]] = {}
    for key in sorted(keys, key=dot_natural_key):
        new, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if new in meta and new != key or pattern is not None:
            groups.setdefault(new, []).append((pattern, key))
    out: dict[str, Stored] = {}
    for new, items in groups.items():
        if len(items) == 1 and items[0][0] is None:
            out[new] = Stored(key=items[0][1])
            continue
        conv = next(c for c in converters if items[0][0] in c.source_patterns)
        ops = {type(op) for op in conv.operations}
        if ops == {Split} and len(items) == 1:
            out.update(_split(new, items[0][1], conv, meta))
            continue
        if ops == {Transpose} and len(items) == 1:
            op = conv.operations[0]
            out[new] = Stored(key=items[0][1], swap=(op.dim0, op.dim1))
            continue
        if ops == {Interleave} and len(items) == 1:
            out[new] = Stored(key=items[0][1], dim=conv.operations[0].dim, interleaved=True)
            continue
        if {type(op).__name__ for op in conv.operations} == {"Inkling2UnpadVocab"} and len(items) == 1:
            out[new] = Stored(key=items[0][1], dim=0, part=(0, meta[new].shape[0]))  # the padded rows dropped
            continue
        if MergeModulelist not in ops and not ops <= {Concatenate}:  # the converter's own ops, run on read
            out.update(_by_ops(new, items, conv, Interleave))
            continue
        if not ops <= {MergeModulelist, Concatenate}:
            names = ", ".join(sorted(o.__name__ for o in ops))
            out[new] = Stored(unread=f"{new}: its checkpoint layout ({names}) is not read; load the teacher whole")
            continue
        templates = []
        for pattern in conv.source_patterns:
            first = next((k for p, k in items if p == pattern), None)
            if first is not None:
                templates.append(_template(first, "0") if MergeModulelist in ops else first)
        dims = [op.dim for op in conv.operations if isinstance(op, Concatenate)]
        out[new] = Stored(templates=tuple(dict.fromkeys(templates)), dim=dims[0] if dims else 1)
    return out


def _by_ops(new: str, items: list[tuple[str | None, str]], conv, interleave_cls) -> dict[str, Stored]:
    """The tensors transformers assembles on load with operations of its own (Inkling2-loop's NVFP4 and MXFP8 experts
    dequantised, its message queries merged, Kimi-K2.5's vision qkv split and permuted for its rotary embedding):
    those very operations, run on read on the sources the checkpoint has, for each of the converter's targets. Where
    each works expert by expert (the dequantisation, an interleave below the expert axis), only the experts asked for
    are read."""
    first = next((t for t in conv.target_patterns if t in new), conv.target_patterns[0])
    per_expert = all(
        type(op).__name__ == "Inkling2LoopDequantizeExperts" or (isinstance(op, interleave_cls) and op.dim >= 1)
        for op in conv.operations
    )
    ops = (tuple(conv.operations), tuple(conv.source_patterns), tuple(conv.target_patterns))
    sources = tuple((pattern, key) for pattern, key in items)
    return {
        new.replace(first, target): Stored(key=items[0][1], ops=(*ops, target), sources=sources, per_expert=per_expert)
        for target in conv.target_patterns
    }


def _split(new: str, key: str, conv, meta: dict) -> dict[str, Stored]:
    """The in-memory tensors one checkpoint tensor is split into along the op's dim, each sized as its parameter."""
    dim = conv.operations[0].dim
    out, start = {}, 0
    for target in conv.target_patterns:
        name = new.replace(conv.target_patterns[0], target)
        length = meta[name].shape[dim]
        out[name] = Stored(key=key, dim=dim, part=(start, length))
        start += length
    return out
