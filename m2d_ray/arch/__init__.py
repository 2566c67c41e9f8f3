"""Architecture adapters, registered by `config.model_type`: the only place with model-specific names."""

from __future__ import annotations

import difflib

from m2d_ray.arch.base import MoEAdapter
from m2d_ray.errors import M2DError

_ADAPTERS: dict[str, MoEAdapter] = {}


def register(cls: type[MoEAdapter]) -> type[MoEAdapter]:
    for model_type in cls.model_types:
        _ADAPTERS[model_type] = cls()
    return cls


def supported_types() -> list[str]:
    return sorted(_ADAPTERS)


def get_adapter(config) -> MoEAdapter:
    """The adapter for a transformers config; a one-line error lists the supported types."""
    model_type = getattr(config, "model_type", None)
    if model_type in _ADAPTERS:
        return _ADAPTERS[model_type]
    close = difflib.get_close_matches(str(model_type), _ADAPTERS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise M2DError(
        f"model_type {model_type!r} is not a supported Mixture-of-Experts model{hint}; "
        f"supported: {', '.join(supported_types())}"
    )


# Importing the family modules registers them.
from m2d_ray.arch import qwen3_moe  # noqa: E402,F401
from m2d_ray.arch import deepseek_v2, deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe  # noqa: E402,F401
