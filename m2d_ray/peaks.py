"""A process's peak memory: what the memory plan (m2d_ray/plan/) is checked against.

VmHWM is the kernel's own high-water mark of this process's resident memory (ru_maxrss, the fallback off
Linux, can carry a parent's across exec); on CUDA, torch's peak of allocated device memory. Work resets both
when it starts (`reset_peaks`: a reused Ray worker's earlier peak is not this model's) and reports, besides the
process's whole peak, its peak above what the process held then (`peak_work_bytes`: the interpreter and its
libraries are not the work's, and not what the plan counts).
"""

from __future__ import annotations

import resource
from pathlib import Path

# Imported inside functions: torch and transformers' modelling code (reset_peaks: loaded before a work's window opens,
# by the workers that build a model; `m2d plan` reads the stages without them).


def proc_kib(path: str, field: str) -> int | None:
    """A "Field: N kB" line of a /proc file in bytes (None off Linux)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> int:
    hwm = proc_kib("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_base: int | None = None  # resident memory when the work started (reset_peaks)


def reset_peaks() -> None:
    """Start both high-water marks again from now (writing 5 to clear_refs resets VmHWM, Linux >= 4.0). Every caller
    builds a model next: transformers' modelling code (~140 MiB of a process, imported where a model is first built)
    is loaded first, so that the work's peak is the work's and not the library's."""
    import torch
    import transformers.modeling_utils  # noqa: F401

    global _base
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _base = proc_kib("/proc/self/status", "VmRSS")
    except OSError:
        _base = None

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peaks() -> dict:
    """{"peak_rss_bytes", "peak_work_bytes" (after a reset), "peak_cuda_bytes" (on CUDA)} of this process since the
    start or the last reset."""
    import torch

    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    rss = peak_rss()
    return {
        "peak_rss_bytes": rss,
        **({"peak_work_bytes": max(0, rss - _base)} if _base is not None else {}),
        **({"peak_cuda_bytes": int(cuda)} if cuda else {}),
    }
