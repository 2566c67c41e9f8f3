"""GPU types as Ray names them (its `accelerator_type:<GPU>` resource) and the memory CUDA reports for each:
what a stage pins itself to (ray.data_accelerator, ray.trial_accelerator, distill.accelerator,
stage3.accelerator) and what the memory plan reads a node type's GPU memory from."""

from __future__ import annotations

import difflib

from m2d_ray.errors import M2DError

# Imported inside functions: psutil (optional: without it the host's memory is unknown).

MiB = 1 << 20
#: the most GPUs of one node where nothing says otherwise (stage3.gpus_per_node, a cluster's node types): a p5.48xlarge,
#: a DGX
GPUS_PER_NODE = 8
#: total memory CUDA reports for each accelerator type (nvidia-smi's MiB)
GPU_MEMORY = {
    "T4": 15_360 * MiB,
    "V100": 16_160 * MiB,
    "A10G": 23_028 * MiB,
    "L4": 22_491 * MiB,
    "L40S": 46_068 * MiB,
    "A100": 40_960 * MiB,
    "A100-40G": 40_960 * MiB,
    "A100-80G": 81_920 * MiB,
    "H100": 81_559 * MiB,
    "H200": 143_771 * MiB,
}
#: dense bf16 tensor-core FLOP/s of each GPU's data sheet (fp16 where it has no bf16: T4, V100; SXM parts;
#: B200 for pricing the paper's own figure, not a type a stage can pin): what a plan's time divides by
GPU_PEAK_BF16 = {
    "T4": 65e12,
    "V100": 125e12,
    "A10G": 125e12,
    "L4": 121e12,
    "L40S": 362e12,
    "A100": 312e12,
    "A100-40G": 312e12,
    "A100-80G": 312e12,
    "H100": 989e12,
    "H200": 989e12,
    "B200": 2250e12,
}
#: the prefix of Ray's accelerator resource; a request pins itself with a sliver of it
RESOURCE = "accelerator_type:"
PIN = 0.001


def check_accelerator(name: str | None, what: str) -> None:
    """A known accelerator type, or None (any GPU)."""
    if name is not None and name not in GPU_MEMORY:
        close = difflib.get_close_matches(name, list(GPU_MEMORY), n=1, cutoff=0.4)
        raise M2DError(
            f"{what}={name!r} is not a GPU type m2d knows the memory of;"
            + (f" did you mean {close[0]}?" if close else "")
            + f" choose from: {', '.join(GPU_MEMORY)}"
        )


def pin(accelerator: str | None) -> dict[str, float]:
    """The Ray resources that keep a task on nodes with that GPU ({} for any)."""
    return {RESOURCE + accelerator: PIN} if accelerator else {}


#: the custom resource a cluster's spot node types carry (cluster.yaml, k8s/raycluster.yaml); a request that wants
#: spot capacity asks for a sliver of it, as a GPU pin does
SPOT = "spot"


def spot(wanted: bool) -> dict[str, float]:
    """The Ray resources that keep a task on spot nodes ({} when it may run anywhere)."""
    return {SPOT: PIN} if wanted else {}


def host_available() -> int | None:
    """This machine's available memory in bytes (None where psutil cannot say)."""
    try:
        import psutil

        return psutil.virtual_memory().available
    except Exception:
        return None
