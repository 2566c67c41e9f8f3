"""The teacher's output head: the map from its final hidden state to its logits, per family.

Cached `hidden` targets (distill/targets.py) store the state *after the final norm* (what HF's
`last_hidden_state` is in every family here, and what layer-streaming applies itself) and a student's rank
recomputes the logits as state @ W.T. That is exact only where the head is a bias-free projection: W is
`lm_head.weight`, or the input embedding when the embeddings are tied (a tied checkpoint may store only
one of the two). Every family this package supports (the MoE adapters here and the dense Llama-style
teachers of arch/dense.py) has such a head. A model whose logits are scaled or soft-capped after the
projection is refused by name instead of given wrong targets.
"""

from __future__ import annotations

from torch import nn

from m2d_ray.errors import M2DError

#: config attributes of heads that are not a plain projection (Gemma 2/3's soft-cap, Cohere's scale,
#: Granite's divisor): a cached state times W would not give their logits
NOT_PLAIN = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_plain_head(config) -> None:
    """Refuse a model whose logits are not final state @ W.T (see NOT_PLAIN), naming the attribute."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    odd = [f"{a}={getattr(text, a)}" for a in NOT_PLAIN if getattr(text, a, None) not in (None, 1, 1.0)]
    if odd:
        raise M2DError(
            f"{getattr(config, 'model_type', 'this model')}'s logits are not its final hidden state times its output "
            f"projection ({', '.join(odd)}); use stage2.targets=online or sampled:N"
        )


def head_names(model: nn.Module) -> tuple[str, ...]:
    """In-memory names of W in the order to look for them in a checkpoint: the output projection's weight,
    then, when tied, the input embedding's."""
    names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    out = [f"{names[model.get_output_embeddings()]}.weight"]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text, "tie_word_embeddings", False):
        out.append(f"{names[model.get_input_embeddings()]}.weight")
    return tuple(out)
