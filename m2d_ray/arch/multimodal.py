"""Vision-language checkpoints of an MoE family (Qwen3.5-MoE, Qwen3-VL-MoE, Kimi-K2.5 ...): the language model is
converted by its family's adapter and everything else (the vision tower, the projector) is copied unchanged, so the
student loads with the teacher's own class (`AutoModelForImageTextToText`).

`Multimodal` wraps the language model's adapter: config questions go to the text config, module questions find the
language model's decoder layers through the model's own `get_decoder()`, and the student's config is the teacher's
composite config with its text config made dense. An MoE inside the vision tower is left as it is.
"""

from __future__ import annotations

import copy

from torch import nn

from m2d_ray.arch.base import MoEAdapter, unquantised
from m2d_ray.arch.structure import name_of


def text_config(config):
    """The language model's config of a composite (vision-language) config; the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_composite(config) -> bool:
    return text_config(config) is not config


class Multimodal:
    """The language model's adapter, answering for the whole vision-language model (see the module doc). Not an
    MoEAdapter subclass: every question it does not answer goes to the language model's adapter, not to a default."""

    def __init__(self, inner: MoEAdapter) -> None:
        self.inner = inner
        self.model_types = inner.model_types
        self.student_model_type = inner.student_model_type
        self.exact_dtype, self.exact_tol = inner.exact_dtype, inner.exact_tol
        self.approximation = inner.approximation

    def __getattr__(self, name: str):  # every question the wrapper does not answer itself: the language model's
        return getattr(self.inner, name)

    # ---- config questions: the text config's ------------------------------------------------------------
    def num_experts(self, config) -> int:
        return self.inner.num_experts(text_config(config))

    def top_k(self, config) -> int:
        return self.inner.top_k(text_config(config))

    def renormalizes(self, config) -> bool:
        return self.inner.renormalizes(text_config(config))

    def routed_scale(self, config) -> float:
        return self.inner.routed_scale(text_config(config))

    def check_top_k(self, config, k: int) -> None:
        self.inner.check_top_k(text_config(config), k)

    def set_top_k(self, model: nn.Module, k: int) -> None:
        MoEAdapter.set_top_k(self, model, k)  # the shared rule, over the language model's blocks

    def unstreamable(self, config) -> str | None:
        return self.inner.unstreamable(text_config(config))

    def student_width_multiple(self, config) -> int:
        return self.inner.student_width_multiple(text_config(config))

    def dense_config(self, config, width: int):
        return unquantised(self.student_config(config, width))

    def student_config(self, config, width: int):
        """The teacher's composite config, its text config the language model's dense student."""
        student = copy.deepcopy(config)
        student.text_config = self.inner.student_config(text_config(config), width)
        return student

    # ---- module questions: the language model's decoder ------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_decoder().layers

    def final_norm(self, model: nn.Module) -> nn.Module:
        return model.get_decoder().norm

    def moe_blocks(self, model: nn.Module) -> dict[int, nn.Module]:
        return {i: f for i, layer in enumerate(self.layers(model)) if self.inner.is_moe(f := self.inner.ffn(layer))}

    def student_ffn_state(self, student: nn.Module, layer: int, ffn):
        """The language model's adapter's entries, named as in the whole model (an adapter that writes a causal
        LM's names, `model.layers.N.mlp.`, gets its prefix replaced by the FFN's real one)."""
        prefix = name_of(student, self.inner.ffn(self.layers(student)[layer])) + "."
        state = self.inner.student_ffn_state(_Decoder(student), layer, ffn)
        if all(k.startswith(prefix) for k in state):
            return state
        own = self.inner.ffn_prefix(layer)
        return {prefix + k.removeprefix(own): v for k, v in state.items()}


class _Decoder(nn.Module):
    """A view of a vision-language student whose `model.layers` are its language model's layers, so that an adapter
    written for a causal LM finds them; names are the whole model's."""

    def __init__(self, student: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_student", student)

    def named_modules(self, *args, **kwargs):
        return self._student.named_modules(*args, **kwargs)

    @property
    def model(self):
        return self._student.get_decoder()
