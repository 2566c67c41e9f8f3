"""MoE families whose routing or experts the method cannot express, each with what it would need; refused by name
before any work (no "did you mean" towards an unrelated family, nothing written)."""

from __future__ import annotations

import transformers

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


def refuse(model_type: str | None) -> None:
    """Raise M2DError for a family the method cannot express."""
    if model_type in CANNOT:
        raise M2DError(
            f"model_type {model_type!r} cannot be converted by the method: {CANNOT[model_type]}; use a family "
            "the reference page 'MoE families' lists as converted"
        )


def missing_release(model_type: str) -> str | None:
    """One line for a model type the installed transformers does not know but a later release does."""
    if model_type not in SINCE:
        return None
    return (
        f"model_type {model_type!r} needs transformers>={SINCE[model_type]} (installed: {transformers.__version__}): "
        f"pip install 'transformers>={SINCE[model_type]}'"
    )
