"""Name -> implementation registries with "did you mean" suggestions for typos."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from m2d_ray.errors import M2DError

T = TypeVar("T")


class Registry(Generic[T]):
    """A small ordered mapping from names to implementations: every method family (scorings, groupings,
    scalings, baselines, losses) and the architecture adapters (by `config.model_type`).

    Lookup of an unknown name raises `M2DError` with the closest known names, so a typo on the
    command line or in a YAML file gets an actionable one-line message.

    To add one: write the function (or adapter class) next to its kind and decorate it,
    ``@SCORINGS.register("my-score")``; nothing else lists the names (configs, the CLI's help and the
    error messages read them from the registry), and tests that loop over a registry pick it up.
    """

    def __init__(self, kind: str, message: str | None = None) -> None:
        """`message`: the unknown-name line, formatted with name, kind, hint (" (did you mean 'x'?)") and names."""
        self.kind = kind
        self.message = message
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise M2DError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(str(name), self._items, n=2, cutoff=0.4)
        if self.message is not None:
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return self.message.format(name=name, kind=self.kind, hint=hint, names=", ".join(sorted(self._items)))
        hint = f" did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return f"unknown {self.kind} {name!r};{hint} choose from: {', '.join(self._items)}"

    def check(self, name: str) -> str:
        """Validate a name without fetching it (for configs)."""
        self[name]
        return name

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def names(self) -> list[str]:
        return list(self._items)
