"""What every config key is made of: `setting` (its default and one-line doc, written once), and the closed sets a
key takes, declared once as types from their registries (the loader checks a value against them with "did you mean":
config/loading.py; the reference shows them)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Literal

from m2d_ray.catalog.distill import AUTO, CHECKPOINTING, KL_KERNELS, LOSSES, PRECISIONS
from m2d_ray.catalog.evaluate import SETS
from m2d_ray.registry import Registry

Auto = Literal[AUTO]
PrecisionName = Literal[(AUTO, *PRECISIONS)]
KernelName = Literal[(AUTO, *KL_KERNELS)]
CheckpointingName = Literal[(AUTO, *CHECKPOINTING)]
LossName = Literal[tuple(LOSSES)]
QuestionSet = Literal[SETS]
#: a closed set made from a registry -> that registry, whose one line (with "did you mean") the loader gives
REGISTRIES: dict[Any, Registry] = {
    PrecisionName: PRECISIONS,
    KernelName: KL_KERNELS,
    CheckpointingName: CHECKPOINTING,
    LossName: LOSSES,
}


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A config key: its default (or `factory`) and its one-line doc, written once here. The doc is the field's
    `metadata["doc"]`, which `m2d --help` (cli.py) and the generated reference (docs/hooks/reference.py) read."""
    return field(default=default, default_factory=factory, metadata={"doc": doc})


def docs(cls: type) -> dict[str, str]:
    """Each field of a config dataclass -> its one-line doc (a nested section's is its class docstring)."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def default(cls: type, name: str) -> Any:
    """The default of `cls`'s field `name` (its factory's value for a mapping or a nested section)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def names(registry) -> str:
    """A registry's names for a field's doc: the docs' lists are the catalog's, never typed again."""
    return ", ".join(registry)


def plain(obj: Any) -> Any:
    """A config as YAML writes it: tuples as lists, all the way down."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj
