"""Shared helpers of the benchmarks: machine description, timing, matmul reference rate."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TEACHER_DIR = SHARED / "teachers" / "qwen3moe-wiki4"
WIKI_VALID = SHARED / "data" / "wikitext-2" / "wiki.valid.tokens"
WIKI_TEST = SHARED / "data" / "wikitext-2" / "wiki.test.raw"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_busy(seconds: float = 0.5) -> float:
    """Fraction of all cores busy over `seconds` (from /proc/stat): what other processes are using."""

    def read():
        vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return idle, sum(vals)

    try:
        i0, t0 = read()
        time.sleep(seconds)
        i1, t1 = read()
        return 1.0 - (i1 - i0) / max(t1 - t0, 1)
    except (OSError, IndexError, ValueError):
        return float("nan")


def write_json(path: str | Path | None, obj) -> None:
    """`obj` as JSON at `path`, written under a temporary name and renamed (whoever reads it, even after this process
    was killed, finds a whole file); nothing when `path` is None. How a benchmark hands its figures to a caller."""
    if path is None:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def machine_line() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    load += f", busy-now={cpu_busy():.0%} of {os.cpu_count()} cores"
    dev = f", cuda={torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (
        f"cpu={cpu_model()!r}, nproc={os.cpu_count()}, torch={torch.__version__}, threads={torch.get_num_threads()}, "
        f"loadavg={load}, date={time.strftime('%Y-%m-%d %H:%M:%S %Z')}{dev}"
    )


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def best_time(fn: Callable[[], object], repeats: int, device: str = "cpu", warmup: int = 0) -> tuple[float, object]:
    """Best wall time (s) over `repeats` calls, and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, device: str = "cpu", warmup: int = 0
) -> dict[str, tuple[float, object]]:
    """Best wall time of each function over `repeats` rounds, the functions taking turns within a round
    (so a burst of load from another process hits every path alike rather than one of them)."""
    best = {name: (float("inf"), None) for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            out = fn()
            sync(device)
            dt = time.perf_counter() - t
            best[name] = (min(best[name][0], dt), out)
    return best


def matmul_gflops(
    n: int = 2048, dtype: torch.dtype = torch.float32, device: str = "cpu", iters: int = 10, repeats: int = 3
) -> float:
    """Plain n x n @ n x n rate (best of `repeats` runs of `iters` products), GFLOP/s."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)

    def run():
        for _ in range(iters):
            c = a @ b
        return c

    t, _ = best_time(run, repeats, device, warmup=1)
    return iters * 2 * n**3 / t / 1e9


def python_m(module: str) -> list[str]:
    """The command that runs benchmark `module` (its `__spec__.name`) in a fresh Python: benchmarks are modules of a
    package, run with -m from the repository's root (a child inherits the parent's working directory)."""
    return [sys.executable, "-m", module]
