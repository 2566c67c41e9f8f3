"""What the last GPU acceptance call measured (m2d_ray/measured_gpu.json), as the code reads it.

The figures that a CPU cannot give and the plan and the trainer need: the stage-2 step's efficiency per targets mode
(`plan.efficiency`), the fastest exact KL kernel per mode (`distill.kl_kernel: auto`), each unit's start-up on a GPU
(`plan.gpu_*_s`), the whole tiny run's stage walls the bill is held to (tests/unit/test_plan_measured_gpu.py), the
student's attention implementation measured fastest on the card (distill/gpu.py), and the acceptance call's own parts'
seconds (its planner's priors). `benchmarks/gpu/acceptance.py` writes a file of this
form (WORK/measured_gpu.json) from what it measured; copying it over this one is how a GPU session updates them, so
that no figure is copied by hand.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from importlib import resources

FILE = "measured_gpu.json"


@dataclass(frozen=True)
class GpuMeasured:
    source: str  # the call, the card and the day
    device: str  # the card, as torch names it
    efficiency: dict  # targets mode (online, hidden, topk, sampled) -> the step's share of the data-sheet bf16 peak
    #: exact targets mode (online, hidden) -> {kernel: what auto uses, device, loss, temperature, path, tokens}
    kl_kernel: dict
    start_s: dict  # a unit's start-up on a GPU: actor, trial, student, model (seconds)
    run: dict  # the whole tiny run: its overrides of experiments/tiny.yaml and its stages' walls (walls_s)
    parts_s: dict  # the acceptance call's parts, seconds each took (its priors)
    attention: dict  # the student's attention measured fastest: {implementation, device, tokens_per_s} ({}: none)

    @classmethod
    def from_dict(cls, raw: dict) -> GpuMeasured:
        names = {f.name for f in fields(cls)}
        missing, extra = names - set(raw), set(raw) - names
        if missing or extra:
            raise ValueError(f"{FILE}: missing {sorted(missing)}, unknown {sorted(extra)}")
        return cls(**raw)


@functools.cache
def gpu() -> GpuMeasured:
    return GpuMeasured.from_dict(json.loads(resources.files("m2d_ray").joinpath(FILE).read_text()))
