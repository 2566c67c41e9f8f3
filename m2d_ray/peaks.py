"""A process's peak memory: what the memory plan (m2d_ray/plan/) is checked against.

VmHWM is the kernel's own high-water mark of this process's resident memory (ru_maxrss, the fallback off
Linux, can carry a parent's across exec); on CUDA, torch's peak of allocated device memory. A reused Ray
worker resets both before a new unit of work (`reset_peaks`), so a peak belongs to one model or student.
"""

from __future__ import annotations

from pathlib import Path


def peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peaks() -> None:
    """Start both high-water marks again from now (writing 5 to clear_refs resets VmHWM, Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peaks() -> dict:
    """{"peak_rss_bytes", "peak_cuda_bytes" (on CUDA)} of this process since the start or the last reset."""
    import torch

    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    return {"peak_rss_bytes": peak_rss(), **({"peak_cuda_bytes": int(cuda)} if cuda else {})}
