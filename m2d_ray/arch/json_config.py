"""A model's config.json read as plain JSON (`read`), for the families whose plan is arithmetic (arch/counts.py): what
`m2d plan` reads without a transformers config class, each of which imports torch (`configuration_utils` ->
`modeling_rope_utils`: about 2 s and 300 MB a plan). A family not listed here, a vision-language config, or a file
that is not one config returns None, and the caller reads the config with transformers as before.

    PlainConfig     config.json's fields as attributes, each field it leaves out as the family's class defaults it
    DEFAULTS        per model type, those defaults (the fields a plan reads; `head_dim` derived as every attention does)
    MOE             per MoE model type, what its adapter answers from the config (E, k) and its dense student's type
    PlainAdapter    that adapter's answers for a plan (`plan/shapes.py`), the student built as `copy_config` builds it
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

#: model type -> the fields a plan reads, as transformers' config class (5.25) defaults them where config.json leaves
#: them out; tests/unit/test_json_config.py holds each to its class. `head_dim`, absent, is hidden // heads (`_derive`).
DEFAULTS: dict[str, dict] = {
    "qwen3_moe": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
    },
    "qwen3": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
}

#: model type -> {field: the other name its config class reads and writes it under} (its `attribute_map`): a
#: config.json may give either; the plain config answers to both
ALIASES: dict[str, dict[str, str]] = {"qwen3_moe": {"num_experts": "num_local_experts"}}

#: fields a dense student takes from its teacher whatever the family (the checkpoint's dtype)
CARRIED = ("dtype", "torch_dtype")


@dataclass(frozen=True)
class Moe:
    """An MoE family the plan reads as JSON: its adapter (arch/<family>.py) reads E from `experts` and k from
    `top_k`, pads no student width (multiple 1), approximates nothing, and builds its dense student as
    `copy_config(<student's class>, teacher, intermediate_size=width)`."""

    student: str
    experts: str
    top_k: str = "num_experts_per_tok"


MOE: dict[str, Moe] = {"qwen3_moe": Moe("qwen3", "num_experts")}


class PlainConfig(SimpleNamespace):
    """A config's fields as attributes (what the plan reads of a transformers config, by getattr)."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def _derive(fields: dict) -> dict:
    if fields.get("head_dim") is None and fields.get("num_attention_heads"):
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return fields


def plain(fields: dict) -> PlainConfig | None:
    """`fields` (a config.json's) with its family's defaults filled, or None for a family not in DEFAULTS or a
    composite config (a vision-language one: its towers are counted on the meta device)."""
    model_type = fields.get("model_type")
    if model_type not in DEFAULTS or "text_config" in fields or "vision_config" in fields:
        return None
    given = {k: v for k, v in fields.items() if v is not None or k not in DEFAULTS[model_type]}
    for name, other in ALIASES.get(model_type, {}).items():
        if other in given and name not in given:
            given[name] = given[other]
    merged = _derive({**DEFAULTS[model_type], **given})
    for name, other in ALIASES.get(model_type, {}).items():
        merged[other] = merged[name]
    return PlainConfig(**merged)


def read(directory: str | Path) -> PlainConfig | None:
    """`directory`/config.json as a PlainConfig; None where the plan must read it with transformers (no such file,
    not JSON, a family this module does not know)."""
    try:
        fields = json.loads((Path(directory).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return plain(fields) if isinstance(fields, dict) else None


def dense_student(config: PlainConfig, width: int) -> PlainConfig:
    """The dense student of an MoE config of MOE at FFN `width`: the student class's fields taken from the teacher
    (its defaults where the teacher has none), `head_dim` derived when the teacher leaves it out, no quantisation
    (a student is never stored quantised): as arch/base.copy_config and MoEAdapter.dense_config build it."""
    student = MOE[config.model_type].student
    teacher = config.to_dict()
    fields = {**DEFAULTS[student], **{k: teacher[k] for k in DEFAULTS[student] if k in teacher}}
    fields["head_dim"] = teacher.get("head_dim") or teacher["hidden_size"] // teacher["num_attention_heads"]
    carried = {k: teacher[k] for k in CARRIED if k in teacher}
    return PlainConfig(**{**fields, **carried, "model_type": student, "intermediate_size": width})


class PlainAdapter:
    """What a plan asks an MoE family's adapter, answered from a PlainConfig (tests/unit/test_json_config.py holds
    each answer to the family's adapter)."""

    approximation = ""

    def __init__(self, moe: Moe) -> None:
        self.moe = moe

    def num_experts(self, config) -> int:
        return int(getattr(config, self.moe.experts))

    def top_k(self, config) -> int:
        return int(getattr(config, self.moe.top_k))

    def student_width_multiple(self, config) -> int:
        return 1

    def dense_config(self, config, width: int) -> PlainConfig:
        return dense_student(config, width)


def adapter_of(config) -> PlainAdapter | None:
    """The plain adapter of a PlainConfig of an MoE family in MOE; None for anything else."""
    moe = MOE.get(getattr(config, "model_type", None)) if isinstance(config, PlainConfig) else None
    return PlainAdapter(moe) if moe else None
