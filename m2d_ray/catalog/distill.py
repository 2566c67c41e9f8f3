"""The names of stage 2's settings: losses, precision policies, KL kernels, and the value `auto`.

Declared here, without torch, so that reading and checking a config imports none of the modules that implement them
(`distill/losses.py`, `distill/precision.py`, `distill/kernels.py`, imported at the first lookup).
"""

from __future__ import annotations

from m2d_ray.registry import Registry

#: the value of a setting the platform decides (distill.precision, distill.kl_kernel, distill.deepspeed,
#: stage2.targets)
AUTO = "auto"

#: loss name -> (logit divergence, whether hidden-state MSE over all layers is added); losses.py computes them
LOSSES: Registry[tuple[str, bool]] = Registry("loss")
LOSSES.register("fkl")(("fkl", False))
LOSSES.register("rkl")(("rkl", False))
LOSSES.register("fkl+mse")(("fkl", True))

#: distill.precision besides auto (float16 would need loss scaling)
PRECISIONS = Registry.in_module(
    "distill.precision",
    "m2d_ray.distill.precision",
    {
        "bf16-mixed": "bfloat16 compute; float32 master weights, gradients and AdamW moments.",
        "bf16-pure": "Everything in bfloat16, AdamW's moments too (only when asked).",
        "fp32": "Everything in float32 (auto on a CPU).",
    },
)

#: distill.kl_kernel besides auto
KL_KERNELS = Registry.in_module(
    "distill.kl_kernel",
    "m2d_ray.distill.kernels",
    {
        "chunked": "The exact KL chunk by chunk over the tokens, its gradient formed in the forward.",
        "liger": "Liger Kernel's fused linear JSD at beta 0 / 1 (forward / reverse KL); CUDA only.",
    },
)
#: distill.kl_kernel's name of earlier versions for chunked with the student compiled: distill.compile=true now (a
#: config that names it is read as that, with one line; a measured choice of it is chunked's)
COMPILED = "compiled"
#: the kernels that run on CUDA devices only (a config check, before their modules are imported)
CUDA_ONLY_KERNELS = frozenset({"liger"})

#: distill.checkpointing besides auto, in the order of their memory (most first) and of their recompute (least first):
#: auto takes the first whose stage-2 rank fits its device (the plan decides it, stages/stage2.py)
CHECKPOINTING = Registry.in_module(
    "distill.checkpointing",
    "m2d_ray.distill.checkpointing",
    {
        "none": "Every decoder layer keeps its activations for the backward (no recompute).",
        "selective": "Per op (torchtitan's SAC): matmul and attention outputs kept (the FFN's down projection's "
        "not: nothing's backward reads it), norms, rotary and SwiGLU's elementwise ops recomputed.",
        "full": "Each decoder layer keeps its input only and recomputes its whole forward in the backward.",
    },
)


def ambiguous_down(hidden: int, q_width: int, ffn: int) -> bool:
    """Whether selective checkpointing cannot tell the FFN's down projection from another projection of the layer by
    its weight's shape (ffn = q width: the attention's output projection; ffn = hidden: the gate and up projections),
    so it keeps the down projection's output too: what distill/checkpointing.py's policy does and plan/memory.py
    counts."""
    return ffn in (hidden, q_width)


#: distill.gradient_checkpointing (a boolean) of earlier versions: true reads as full, false as none, with one line
RETIRED_CHECKPOINTING = {True: "full", False: "none"}
