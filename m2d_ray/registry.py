"""Name -> implementation registries with "did you mean" suggestions for typos, whose names and one-line docs are
known before their implementations are imported."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from m2d_ray.errors import M2DError

T = TypeVar("T")


class Registry(Generic[T]):
    """A small ordered mapping from names to implementations: every method family (scorings, groupings,
    scalings, baselines, losses) and the architecture adapters (by `config.model_type`).

    Lookup of an unknown name raises `M2DError` with the closest known names, so a typo on the
    command line or in a YAML file gets an actionable one-line message.

    **Lazy entries.** A registry is declared where it is cheap to import (a package's `__init__`, beside the
    config that names it) with each built-in entry's name, the module that implements it and a one-line doc:
    ``Registry.in_module("scoring", "m2d_ray.scoring.methods", {"sf": "Top-K experts by selection frequency."})``.
    Names, docs, "did you mean" and config checks need nothing more, so `m2d --help`, `m2d plan` and every
    process that only reads a config import no torch. The first lookup of a name imports its module, which
    registers the implementation as before, ``SCORINGS.register("sf")(fn)``; `tests/unit/test_imports.py` checks
    that every declared name is registered by its module and nothing else is.

    To add one outside the package: decorate it, ``@SCORINGS.register("my-score")``, in a module you import
    before the run; configs, the CLI's help and the error messages read the registry.
    """

    def __init__(
        self, kind: str, message: str | None = None, *, lazy: Mapping[str, tuple[str, str]] | None = None
    ) -> None:
        """`message`: the unknown-name line, formatted with name, kind, hint (" (did you mean 'x'?)") and names.
        `lazy`: name -> (the module whose import registers it, its one-line doc)."""
        self.kind = kind
        self.message = message
        self._lazy: dict[str, tuple[str, str]] = dict(lazy or {})
        self._items: dict[str, T] = {}

    @classmethod
    def in_module(cls, kind: str, module: str, docs: Mapping[str, str], message: str | None = None) -> Registry[T]:
        """A registry whose built-in entries are all registered by `module`: name -> its one-line doc."""
        return cls(kind, message, lazy={name: (module, doc) for name, doc in docs.items()})

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def __getitem__(self, name: str) -> T:
        if name not in self._items and name in self._lazy:
            importlib.import_module(self._lazy[name][0])
            if name not in self._items:
                raise RuntimeError(f"{self._lazy[name][0]} does not register the declared {self.kind} {name!r}")
        try:
            return self._items[name]
        except KeyError:
            raise M2DError(self.unknown_message(name)) from None

    def load_all(self) -> dict[str, T]:
        """Every entry's implementation, imported (for tests and the generated reference)."""
        return {n: self[n] for n in self}

    def doc(self, name: str) -> str:
        """The entry's one-line doc, without importing it where it is declared lazily."""
        if name in self._lazy:
            return self._lazy[name][1]
        return (getattr(self[name], "__doc__", None) or "").strip().split("\n\n")[0].replace("\n", " ")

    def declared(self) -> dict[str, str]:
        """Lazily declared name -> the module that registers it."""
        return {n: m for n, (m, _) in self._lazy.items()}

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(str(name), self.names(), n=2, cutoff=0.4)
        if self.message is not None:
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return self.message.format(name=name, kind=self.kind, hint=hint, names=", ".join(sorted(self.names())))
        hint = f" did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return f"unknown {self.kind} {name!r};{hint} choose from: {', '.join(self.names())}"

    def check(self, name: str) -> str:
        """Validate a name without importing it (for configs)."""
        if name not in self:
            raise M2DError(self.unknown_message(name))
        return name

    def __contains__(self, name: object) -> bool:
        return name in self._lazy or name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def names(self) -> list[str]:
        return [*self._lazy, *(n for n in self._items if n not in self._lazy)]
