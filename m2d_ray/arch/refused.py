"""MoE families whose routing or experts the method cannot express, each with what it would need; refused by name
before any work (no "did you mean" towards an unrelated family, nothing written)."""

from __future__ import annotations

import transformers
from packaging.version import Version

from m2d_ray.errors import M2DError

#: model type -> why the method (score, group, merge, concatenate into one dense FFN) cannot express it
CANNOT: dict[str, str] = {
    "phimoe": "its sparsemixer router (top-2 with threshold masking) has no one-expert or dense form: a dense student "
    "would need a dense twin class",
    "zaya": "its router keeps a skip class (a zero expert) and a state carried across layers: the method merges "
    "real experts only",
    "longcat_flash": "its zero experts output their input (identity experts) and its MoE is a shortcut over two "
    "sublayers: no dense FFN reproduces them",
    "jetmoe": "its attention is itself a mixture of experts (mixture of attention heads): the method converts FFN "
    "experts only",
    "doge": "its experts are single neurons chosen by product keys: merging needs experts that are FFNs",
    "dbrx": "its experts (w1, v1, w2 of [E*I, d]) are not a transformers experts module, and its dense student would "
    "need a dense DBRX class that transformers does not have",
    "inkling_text": "its router normalises the shared experts together with the routed ones (a token-dependent share "
    "of the shared experts): a dense student cannot keep that share",
}

#: families of a newer transformers than the installed one: model type -> the first release that has it
SINCE: dict[str, str] = {"ergo": "5.25", "kolibri1_1": "5.25", "minicpm5_moe": "5.25", "param2moe": "5.25"}

#: the release every family here was read from and is tested against (the suite's pin)
READ_AGAINST = "5.25"

#: families an older release builds otherwise (its experts not yet transformers' decorated kind, other checkpoint
#: names, a router returning probabilities for logits): model type -> the oldest release m2d has run it on. Run on
#: 5.0, 5.17 and 5.25 (tests/unit/test_families.py and test_arch.py under each); a family not listed runs on all three
#: where the release has it.
READS_FROM: dict[str, str] = {
    **dict.fromkeys(
        (
            "afmoe",
            "deepseek_v2",  # 5.0's router returns other outputs
            "deepseek_v3",
            "dots1",
            "ernie4_5_moe",
            "flex_olmo",
            "glm4_moe",
            "glm4_moe_lite",
            "hunyuan_v1_moe",
            "jamba",
            "lfm2_moe",
            "minimax",
            "minimax_m2",
            "olmoe",  # 5.0's routers return probabilities where 5.17's return logits
            "qwen2_moe",
            "qwen3_moe",
            "qwen3_next",
            "qwen3_vl_moe",
            "solar_open",
        ),
        "5.17",
    ),
    **dict.fromkeys(("aria_text", "granitemoe", "granitemoehybrid", "granitemoeshared", "nemotron_h"), "5.25"),
}


def refuse(model_type: str | None) -> None:
    """Raise M2DError for a family the method cannot express, or one the installed transformers builds otherwise."""
    if (line := older_release(model_type)) is not None:
        raise M2DError(line)
    if model_type in CANNOT:
        raise M2DError(
            f"model_type {model_type!r} cannot be converted by the method: {CANNOT[model_type]}; use a family "
            "the reference page 'MoE families' lists as converted"
        )


def missing_release(model_type: str, known: bool = False) -> str | None:
    """One line for a model type the installed transformers does not know but a later release does: the release
    that added it where SINCE says, else (a family m2d converts: `known`) the one m2d reads it from."""
    release = SINCE.get(model_type) or (READ_AGAINST if known else None)
    if release is None:
        return None
    return (
        f"model_type {model_type!r} needs transformers>={release} (installed: {transformers.__version__}): "
        f"pip install 'transformers>={release}'"
    )


def older_release(model_type: str | None) -> str | None:
    """One line for a family the installed transformers builds otherwise than the releases m2d has run it on."""
    release = READS_FROM.get(model_type or "")
    if release is None or Version(transformers.__version__) >= Version(release):
        return None
    return (
        f"model_type {model_type!r}: transformers {transformers.__version__} builds its layer otherwise than the "
        f"releases m2d runs it on (>={release}): pip install 'transformers>={release}'"
    )
