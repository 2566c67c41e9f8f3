"""Architecture adapters, registered by `config.model_type`: the only place with model-specific names.

A config is matched by its model type, else by the class transformers builds for it (`architectures`, or the auto
mapping of its config class): `sarvam_mla` is built as `DeepseekV3ForCausalLM` and converted as deepseek_v3. A family
the method cannot express is refused in one line that says why (`refused.py`); no "did you mean" points a known MoE
at an unrelated family.

The family modules (torch, transformers' config and model classes) are imported at the registry's first lookup, not
with the package: `m2d plan` reads the arithmetic modules here (counts.py, json_config.py) and imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import transformers

from m2d_ray.arch.refused import CANNOT, refuse
from m2d_ray.errors import M2DError
from m2d_ray.registry import Registry

if TYPE_CHECKING:
    from m2d_ray.arch.base import MoEAdapter

# Imported inside functions: the family modules, transformers' auto classes and the vision-language wrapper (torch:
# the package is read by `m2d plan`, which counts a known family's parameters by arithmetic).


class _Adapters(Registry):
    """The adapters' registry, filled by importing the family modules at its first lookup (each registers itself)."""

    _loaded = False

    def _load(self) -> None:
        if not _Adapters._loaded:
            _Adapters._loaded = True  # first: a family module's own lookups during its import find what is there
            _register_families()

    def __getitem__(self, name: str):
        self._load()
        return super().__getitem__(name)

    def __contains__(self, name: object) -> bool:
        self._load()
        return super().__contains__(name)

    def names(self) -> list[str]:
        self._load()
        return super().names()


ADAPTERS: Registry[MoEAdapter] = _Adapters(
    "Mixture-of-Experts model", "model_type {name!r} is not a supported {kind}{hint}; supported: {names}"
)


def register(cls: type[MoEAdapter]) -> type[MoEAdapter]:
    """Class decorator of a family module: one adapter instance under each of its `model_types`."""
    for model_type in cls.model_types:
        ADAPTERS.register(model_type)(cls())
    return cls


def supported_types() -> list[str]:
    return sorted(ADAPTERS)


def family_of(config) -> str | None:
    """The supported model type that converts `config`: its own, else the one whose class transformers builds
    for it (a config-only family such as sarvam_mla or param2moe), else its language model's (a vision-language
    checkpoint); None when none is supported."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        return family_of(text)
    model_type = getattr(config, "model_type", None)
    if model_type in ADAPTERS:
        return model_type
    for cls in _classes(config):
        owner = getattr(getattr(cls, "config_class", None), "model_type", None)
        if owner in ADAPTERS:
            return owner
    return None


def _classes(config) -> list:
    """The causal-LM classes transformers would build for `config` (named ones first)."""
    from transformers import AutoModelForCausalLM

    named = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or []]
    try:
        auto = [AutoModelForCausalLM._model_mapping[type(config)]]
    except Exception:  # noqa: BLE001 - no causal-LM class for it: nothing more to find
        auto = []
    return [c for c in named + auto if c is not None]


def get_adapter(config) -> MoEAdapter:
    """The adapter for a transformers config; a family the method cannot express, one the installed transformers
    lacks, or an unknown type each get one line."""
    from m2d_ray.arch.multimodal import Multimodal

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:  # a vision-language checkpoint: its language model converted, the rest copied
        refuse(getattr(config, "model_type", None))
        return Multimodal(get_adapter(text))
    model_type = getattr(config, "model_type", None)
    refuse(model_type)
    family = family_of(config)
    if family is None:  # no "did you mean": a near name is another family, not this one
        raise M2DError(
            f"model_type {model_type!r} is not a Mixture-of-Experts family m2d converts; `m2d families` lists the "
            f"{len(supported_types())} it does and why others are refused"
        )
    return ADAPTERS[family]


def family_rows() -> list[tuple[str, str, str, str]]:
    """(model type, adapter, student, exact to / what differs) of each family m2d converts, then (model type,
    "refused", "-", why) of each it refuses: `m2d families` and the reference page."""
    from m2d_ray.arch import families

    rows = []
    for name in sorted(ADAPTERS):
        a = ADAPTERS[name]
        if isinstance(a, families.StructuredAdapter):
            f = a.family
            kind = "same class, every layer dense" if f.student == "dense" else "same class, one expert"
            how = f"read from its structure; router scores: {f.scores}"
            exact = "float32 round-off (its experts compute in float32)" if f.float32 else "float64 round-off"
        else:
            kind, how, exact = f"{a.student_model_type} (own module)", f"arch/{name}.py", "float64 round-off"
        exact = f"the method's FFN, which approximates the block: {a.approximation}" if a.approximation else exact
        rows.append((name, how, kind, exact))
    return rows + [(name, "refused", "-", why) for name, why in sorted(CANNOT.items())]


MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def mtp_left_out(config) -> str | None:
    """The one line on a teacher's multi-token-prediction layers, which transformers does not load and m2d does not
    convert (the student has none: it decodes without them); None when the config counts none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = next(((k, n) for k in MTP_KEYS if isinstance(n := getattr(text, k, None), int) and n > 0), None)
    if found is None:
        return None
    key, n = found
    return (
        f"{config.model_type}: the checkpoint's multi-token-prediction layer{'s' * (n > 1)} ({key}={n}) left out: "
        "transformers does not load it and the student has none (it decodes without speculation)"
    )


def auto_class(config):
    """The transformers auto class whose `from_config` / `from_pretrained` builds the model as its checkpoint's own
    class: the image-text-to-text one for a vision-language config, the causal LM one otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForPreTraining

    from m2d_ray.arch.multimodal import is_composite

    if is_composite(config) and type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    if _pretraining_causal_lm(config):  # mistral4: transformers maps its causal LM as its pretraining model only
        return AutoModelForPreTraining
    return AutoModelForCausalLM


def _pretraining_causal_lm(config) -> bool:
    from transformers import AutoModelForPreTraining

    try:
        return AutoModelForPreTraining._model_mapping[type(config)].__name__.endswith("ForCausalLM")
    except Exception:  # noqa: BLE001 - no pretraining class for it
        return False


def _register_families() -> None:
    """Importing the family modules registers them; the structured families and those with a module of their own
    that subclasses the structured adapter (Llama 4, Gemma 4, DeepSeek-V4) are registered here."""
    from m2d_ray.arch import (  # noqa: F401
        deepseek_v2,
        deepseek_v3,
        deepseek_v4,
        families,
        gemma4,
        gpt_oss,
        llama4,
        mixtral,
        olmoe,
        qwen2_moe,
        qwen3_moe,
    )

    for family in families.FAMILIES:
        ADAPTERS.register(family.model_type)(families.StructuredAdapter(family))
    for module, adapter in (
        (llama4, llama4.Llama4Adapter),
        (gemma4, gemma4.Gemma4Adapter),
        (deepseek_v4, deepseek_v4.DeepseekV4Adapter),
    ):
        ADAPTERS.register(module.FAMILY.model_type)(adapter())


__all__ = [
    "family_rows",
    "mtp_left_out",
    "ADAPTERS",
    "M2DError",
    "auto_class",
    "family_of",
    "get_adapter",
    "register",
    "supported_types",
]
