"""The student's decoder layers, one by one: their activation checkpointing (`distill.checkpointing`: what each layer
keeps for its backward and what it recomputes there) and their compilation (`distill.compile`).

    none       every activation kept (the most memory, no recompute)
    selective  per op, torchtitan's selective activation checkpointing (SAC): the outputs of the matmuls and of the
               attention kernel are kept, the norms, rotary embeddings and SwiGLU's elementwise ops are recomputed
               from them in the backward: about half of `none`'s memory (plan/memory.py) for a few percent of time
               (elementwise work only; no matmul runs twice)
    full       each layer keeps its input only and runs its whole forward again in the backward (a fourth forward)

Applied through transformers' own checkpointing of each decoder layer (non-reentrant `torch.utils.checkpoint`), with
SAC's policy as its `context_fn`, so the parameter names, save_pretrained and the checkpoints are the model's own. A
layer compiled on its own (distill.compile, `compile_layers`) moves that same checkpoint call inside its compiled
function, as torchtitan does: Dynamo traces the checkpoint as its operator and applies SAC's policy at trace time.
`auto` is decided by the plan before any work (pipeline.decide_checkpointing): the least recompute whose rank fits its
device.

`compile_layers` compiles each decoder layer on its own (torchtitan's per-block compile): one graph a layer, the
checkpoint inside it, and the output head and its exact KL left eager, so
that the head's products keep their bfloat16 tensor-core path with float32 accumulation (numerics.py) instead of
whatever a compiler makes of a float32 widening of a [V, d] head.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from m2d_ray.arch.counts import layer_attention_widths
from m2d_ray.catalog.distill import AUTO, CHECKPOINTING, ambiguous_down

# Imported inside functions: transformers' modelling code (a worker that imports this module may build no model).

#: the ops whose outputs SAC keeps: the matmuls (nn.Linear's at dispatch; not bmm: no Linear's backward needs a
#: product's output) and every attention kernel SDPA or flash-attn dispatches to on a GPU or a CPU; all others are
#: recomputed, and so is the FFN's down projection (`sac_policy`)
_SAVED_NAMES = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "flash_attn._flash_attn_forward.default",
    "flash_attn._flash_attn_varlen_forward.default",
)


def saved_ops() -> frozenset:
    """The op overloads of `_SAVED_NAMES` this torch, and flash-attn where it is imported, has: looked up again once
    flash-attn is imported (its ops exist only then), so a first call before its import does not leave it out."""
    return _saved_ops("flash_attn" in sys.modules)


@functools.cache
def _saved_ops(flash_imported: bool) -> frozenset:
    found = set()
    for name in _SAVED_NAMES:
        namespace, op, overload = name.split(".")
        try:
            found.add(getattr(getattr(getattr(torch.ops, namespace), op), overload))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


#: the matmul ops whose weight `sac_policy` reads to tell the down projection (the weight is the last argument)
_MATMULS = ("aten.mm.default", "aten.addmm.default")


def sac_policy(ctx, op, *args, down: tuple[int, int] | None = None, **kwargs) -> CheckpointPolicy:
    """Keep the matmuls' and the attention's outputs, but the FFN's down projection (its transposed weight [ffn,
    hidden] is `down`): only the residual add reads it, whose backward needs no input. Recompute everything else."""
    if op not in saved_ops():
        return CheckpointPolicy.PREFER_RECOMPUTE
    if down is not None and str(op) in _MATMULS and tuple(args[-1].shape) == down:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def down_projection(model: nn.Module) -> tuple[int, int] | None:
    """The shape of the down projection's transposed weight as a matmul sees it, [ffn, hidden]; None where another
    projection of the layer has the same shape (ffn = q width: the attention's output, ffn = hidden: the gate and up
    projections; they cannot be told apart by shape, and the down projection is kept too: `ambiguous_down`)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ffn, hidden = getattr(config, "intermediate_size", None), config.hidden_size
    qs = {row[0] for row in layer_attention_widths(config)}
    return None if not ffn or any(ambiguous_down(hidden, q, ffn) for q in qs) else (ffn, hidden)


def _enable(model: nn.Module, kwargs: dict) -> None:
    """transformers' checkpointing of every decoder layer with these `torch.utils.checkpoint` arguments
    (`activation_checkpointing_enable` from transformers 5.24, `gradient_checkpointing_enable` before)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _none(model: nn.Module) -> None:
    return None


def _selective(model: nn.Module) -> None:
    policy = functools.partial(sac_policy, down=down_projection(model))
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    _enable(model, {"use_reentrant": False, "context_fn": context})


def _full(model: nn.Module) -> None:
    _enable(model, {"use_reentrant": False})


for _name, _fn in (("none", _none), ("selective", _selective), ("full", _full)):
    CHECKPOINTING.register(_name)(_fn)


def without_plan(device: str | torch.device) -> str:
    """What `auto` means where no plan decided it (`m2d distill`, a DistillJob built by hand): full on a GPU (the
    least memory), none on a CPU (host memory is the plan's least concern there)."""
    return "full" if torch.device(device).type == "cuda" else "none"


def apply(model: nn.Module, name: str, device: str | torch.device = "cpu") -> str:
    """Checkpoint `model`'s decoder layers as `distill.checkpointing` names; `auto`, which `m2d run` and `m2d sweep`
    decide in their plan before any work, reads as `without_plan(device)` here. The policy applied."""
    if name == AUTO:
        name = without_plan(device)
    CHECKPOINTING[name](model)
    return name


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules transformers checkpoints (every family's, by its base class)."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # modelling code: where a model exists

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


#: the Dynamo setting under which a checkpointed layer's forward side effects are not replayed by its recompute
#: (torch >= 2.10): transformers' forward sets a context variable (its kernel hub's active functions, its output
#: capture) that Dynamo otherwise refuses inside the checkpoint ("HOP: Unsafe side effect": a graph break, and the
#: layer runs eagerly). torchtitan sets it for the same reason; the set and reset pair in one forward: nothing is lost.
SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def compose_problem() -> str | None:
    """Why this torch cannot compile a checkpointed layer whole (one line), or None."""

    if not hasattr(torch._dynamo.config, SIDE_EFFECTS):
        return (
            f"torch {torch.__version__} lacks torch._dynamo.config.{SIDE_EFFECTS}: transformers' forward side effect "
            "breaks the compiled graph at the checkpoint, so a checkpointed layer runs eagerly"
        )
    return None


def compile_layers(model: nn.Module, backend) -> int:
    """torch.compile each decoder layer in place as torchtitan does: the checkpoint inside, the compile outside (the
    checkpointed block is compiled, so Dynamo traces the checkpoint as its operator and applies SAC's policy at trace
    time: `selective` stays selective, and the backward's recompute is compiled too). transformers' own checkpoint
    of the layer (inside its forward from 5.24, around it in `__call__` before) is turned off and the same
    `torch.utils.checkpoint` call, with the same arguments, is made inside the compiled function instead: on either
    version the checkpoint sits inside one graph. Names and state dicts are unchanged (the module's own
    `_compiled_call_impl`, as `nn.Module.compile`). The number compiled."""

    if hasattr(torch._dynamo.config, SIDE_EFFECTS):
        setattr(torch._dynamo.config, SIDE_EFFECTS, True)  # read when a layer is traced, at its first call
    layers = decoder_layers(model)
    for layer in layers:
        ckpt = layer._gradient_checkpointing_func if layer.gradient_checkpointing else None
        layer.gradient_checkpointing = False
        layer._compiled_call_impl = torch.compile(_checkpointed(layer, ckpt), backend=backend, dynamic=False)
    return len(layers)


def _checkpointed(layer: nn.Module, ckpt):
    """The layer's call, inside `ckpt` (transformers' partial of torch.utils.checkpoint) when it trains with
    gradients, as transformers checkpoints it (keyword arguments bound, tensors positional)."""
    call = layer._call_impl
    if ckpt is None:
        return call

    def run(*args, **kwargs):
        if layer.training and torch.is_grad_enabled():
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            return ckpt(functools.partial(call, **kwargs), *args)
        return call(*args, **kwargs)

    return run
