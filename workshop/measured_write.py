"""m2d_ray/measured_gpu.json as a GPU acceptance call measured it: the writer of what m2d_ray/measured.py reads.

The acceptance call (benchmarks/gpu/acceptance.py) hands its parts' result dicts here; what a part measured replaces
the packaged figure, what no part measured is carried over, and the GPU start-ups are fit on the whole run's walls
(plan/fit.py) by pricing that run on the machine it ran on. A key the file did not hold yet (a new targets mode's
efficiency) is taken when it names a known mode; anything else is refused, so the file keeps the form the code reads.
"""

from __future__ import annotations

import dataclasses

from m2d_ray import shipped
from m2d_ray.accelerators import GPU_PEAK_BF16
from m2d_ray.catalog.targets import MODES
from m2d_ray.config import load_config
from m2d_ray.measured import GpuMeasured, gpu
from m2d_ray.pipeline import plan_run
from m2d_ray.plan.devices import RESOURCE, NodeType
from m2d_ray.plan.fit import fit_starts
from m2d_ray.plan.run_plan import Devices

#: the efficiency keys the plan reads: stage 2's targets modes by kind, and the forward passes of the other stages
EFFICIENCY_KEYS = ("online", *MODES, "forward")
#: the demo config the acceptance call runs whole (the shipped one)
DEMO = shipped.named("tiny")


def accelerator_of(device: str | None) -> str | None:
    """The accelerator type (accelerators.GPU_PEAK_BF16's key) a torch device name names, e.g. NVIDIA H200 -> H200."""
    return next((k for k in sorted(GPU_PEAK_BF16, key=len, reverse=True) if device and k in device), None)


def run_walls(m: GpuMeasured, starts: dict[str, float] | None = None) -> dict[str, float]:
    """{stage: seconds} of the bill of the whole tiny run `m` ran, planned on the node it ran on (its CPUs, its GPUs
    of its type, one node), with `starts` as plan.gpu_start_s (default: the config's)."""
    r = m.run
    cfg = load_config(DEMO, [f"ray.num_cpus={r['cpus']}", *r["overrides"]])
    if starts is not None:
        cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, gpu_start_s=starts))
    gpus = {"GPU": float(r["gpus"]), RESOURCE + accelerator_of(m.device): 1.0}
    node = NodeType("this machine", {"CPU": float(r["cpus"]), **gpus}, max_workers=1)
    return {s.name: s.seconds for s in plan_run(cfg, Devices(nodes=(node,))).cost.stages}


def fitted_starts(m: GpuMeasured) -> dict[str, float]:
    """plan.gpu_start_s fit on the run's measured walls (plan/fit.py)."""
    return fit_starts(lambda starts: run_walls(m, starts), m.run["walls_s"], list(gpu().start_s))


def efficiencies(measured: dict[str, float]) -> dict[str, float]:
    """The efficiency keys of what a call measured per targets mode (`sampled:64` is kept as its kind, `sampled`),
    each a fraction of the peak to 3 digits (what a step's spread supports); a mode the plan does not read, or a
    figure outside (0, 1], is refused."""
    out = {m.partition(":")[0]: round(float(x), 3) for m, x in measured.items()}
    bad = {m: x for m, x in out.items() if m not in EFFICIENCY_KEYS or not 0 < x <= 1}
    if bad:
        raise ValueError(f"efficiency: {bad} (known modes: {', '.join(EFFICIENCY_KEYS)}; a fraction of the peak)")
    return out


def measured_file(results: dict, device: str | None, when: str) -> dict:
    """measured_gpu.json as the call whose `results` (its results.json: env, parts' dicts) measured it."""
    old, parts = gpu(), results["parts"]
    p7, paper, run = parts.get("P7", {}), parts.get("P7-paper", {}), parts.get("run", {})
    kernel = parts.get("P7-head", {}).get("kl_kernel") or p7.get("kl_kernel") or {}  # the real head's, first
    # plan.efficiency: the paper student's step where it ran (its mode), the h100 preset's for the other modes
    eff = {
        m: x["efficiency"]
        for part in (p7, paper)
        for m, x in ((part.get("efficiency") or {}).get("modes") or {}).items()
    }
    eff = efficiencies(eff)
    new = GpuMeasured(
        source=f"benchmarks/gpu/acceptance.py on {device}, {when} ({results['env']})",
        device=device or old.device,
        efficiency={**old.efficiency, **eff},
        kl_kernel={**old.kl_kernel, **kernel},
        start_s=dict(old.start_s),
        run=dict(old.run),
        parts_s={
            **old.parts_s,
            # a part's planned time from its last successful run only: a failure's seconds say nothing of its length
            **{n: {k: x[k] for k in ("variant", "seconds")} for n, x in parts.items() if x.get("status") == "ok"},
        },
        attention=parts.get("P7-paper", {}).get("attention") or old.attention,
    )
    if run.get("walls") and run.get("status") == "ok":
        walls = {k: round(v, 1) for k, v in run["walls"].items()}
        new = dataclasses.replace(new, run={**run["machine"], "overrides": run["overrides"], "walls_s": walls})
        new = dataclasses.replace(new, start_s={**old.start_s, **fitted_starts(new)})
    return dataclasses.asdict(new)


def prior(part: str, variant: str, guess: float) -> float:
    """A variant's estimated seconds: what the last call measured of it (measured_gpu.json's "parts_s", when it ran
    the variant of that name), else `guess`."""
    seen = gpu().parts_s.get(part)
    return float(seen["seconds"]) if seen and seen.get("variant") == variant else guess
