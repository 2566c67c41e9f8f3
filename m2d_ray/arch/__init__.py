"""Architecture adapters, registered by `config.model_type`: the only place with model-specific names."""

from __future__ import annotations

from m2d_ray.arch.base import MoEAdapter
from m2d_ray.registry import Registry

ADAPTERS: Registry[MoEAdapter] = Registry(
    "Mixture-of-Experts model", "model_type {name!r} is not a supported {kind}{hint}; supported: {names}"
)


def register(cls: type[MoEAdapter]) -> type[MoEAdapter]:
    """Class decorator of a family module: one adapter instance under each of its `model_types`."""
    for model_type in cls.model_types:
        ADAPTERS.register(model_type)(cls())
    return cls


def supported_types() -> list[str]:
    return sorted(ADAPTERS)


def get_adapter(config) -> MoEAdapter:
    """The adapter for a transformers config; a one-line error lists the supported types."""
    return ADAPTERS[getattr(config, "model_type", None)]


# Importing the family modules registers them.
from m2d_ray.arch import (  # noqa: E402,F401
    deepseek_v2,
    deepseek_v3,
    gpt_oss,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,  # noqa: E402,F401
)
