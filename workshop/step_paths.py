"""The paths of the stage-2 step benchmark and the paper student's plan, apart from the benchmarks that time them:
how each path runs (alone, or in turns) with any path's failure said and left out, which paths the plan says fit a
card, and the acceptance table's lever row. benchmarks/perf/distill_step.py, paper_step.py and gpu/acceptance.py
import them from here; tests check them here without importing a benchmark."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

#: float32 [tokens x vocabulary] buffers the plain loop holds at its peak (the student's logits and their
#: log-softmax, the teacher's logits and theirs, kl_div's output, the logits' gradient): 6 x 16,384 x 151,936 x 4 B =
#: 56 GiB, what an H100 saw the loop's logits peak at at the paper's micro-batch (issue 68). Its plan is the platform's
#: path less the chunked KL's buffers plus these.
REFERENCE_LOGITS = 6


#: the parts of the plan's stage-2 rank that a P7 path holds itself (the teacher's head, the cached targets and the
#: CUDA context are the benchmark's, held before any path)
PATH_PARTS = ("student", "grads", "optimizer", "activations", "kl")

PAPER_CONFIG = REPO / "m2d_ray" / "experiments" / "qwen3_30b_a3b.yaml"


PAPER_MODEL = REPO / "m2d_ray" / "experiments" / "configs" / "Qwen--Qwen3-30B-A3B"


ONE_RANK = ("distill.workers=1", "distill.deepspeed=false", "distill.accelerator=null", "stage2.targets=hidden")


POLICIES = ("none", "selective", "full")


def paper_plan(gpu_memory: int, overrides: tuple[str, ...] = ()) -> dict:
    """What `m2d plan experiments/qwen3_30b_a3b.yaml` says of one stage-2 rank of the paper student on one GPU of
    `gpu_memory` bytes: the checkpointing it decides, the rank's bytes and its parts."""
    from m2d_ray.config import load_config
    from m2d_ray.pipeline import STAGES, plan_run
    from m2d_ray.plan.run_plan import Devices

    cfg = load_config(PAPER_CONFIG, [*ONE_RANK, *overrides])
    plan = plan_run(cfg, Devices(gpu_memory=int(gpu_memory)), model=str(PAPER_MODEL), stages=STAGES.only("stage2"))
    row = next(s for s in plan.stages if s.name == "stage2")
    return {
        "checkpointing": plan.decided.get("distill.checkpointing", cfg.distill.checkpointing),
        "rank_bytes": row.per_device,
        "capacity_bytes": row.capacity,
        "parts": dict(row.parts),
        "notes": list(plan.notes),
    }


def in_turns(
    names: list[str], make: dict, student0, batches: list, p: dict, progress=None
) -> tuple[dict, dict, dict, dict]:
    """Every path built first, then one step each per batch, each going first in turn: (step seconds after the
    warm-up, losses, each path's largest step peak above what it held, the paths that failed and why)."""
    device, cuda = p["device"], p["device"] == "cuda"
    failed: dict[str, str] = {}  # a kernel that cannot run here: recorded, and the others go on
    paths = {}
    for n in names:
        with _kernel_failure(n, failed):
            paths[n] = make[n](copy.deepcopy(student0).to(device).train())
    names = [n for n in names if n not in failed]
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, int] = {n: 0 for n in names}
    for i, batch in enumerate(batches):
        for n in names[i % len(names) :] + names[: i % len(names)]:  # each path goes first in turn
            if n in failed:
                continue
            step, take_loss = paths[n]
            held = _window(cuda)
            t = time.perf_counter()
            with _kernel_failure(n, failed):
                step(batch)
            if n in failed:
                paths.pop(n)
                continue
            if cuda:
                torch.cuda.synchronize()
                peaks[n] = max(peaks[n], torch.cuda.max_memory_allocated() - held)
            if i >= p["warmup"]:
                times[n].append(time.perf_counter() - t)
            losses[n].append(take_loss())
    kept = [n for n in names if n not in failed]
    return {n: times[n] for n in kept}, {n: losses[n] for n in kept}, {n: peaks[n] for n in kept}, failed


def one_at_a_time(
    names: list[str], make: dict, student0, batches: list, p: dict, progress=None
) -> tuple[dict, dict, dict, dict]:
    """Each path alone on the device, one after the other (the paper student's optimizer state alone is ~60 GB):
    built from the same initial student, every batch, then freed. A path's peak is the most the allocator held
    from its build to its last step above what it held before it (its student, gradients, optimizer state,
    activations and the KL's buffers: what the plan's rank counts besides the teacher's head and the cached
    targets); a path that fails (out of memory, a kernel that cannot run) is recorded and the others go on."""
    cuda = p["device"] == "cuda"
    failed: dict[str, str] = {}
    times: dict[str, list[float]] = {}
    losses: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    for n in names:
        held = _window(cuda)
        with _kernel_failure(n, failed):
            times[n], losses[n] = _alone(make[n], student0, batches, p)
            peaks[n] = torch.cuda.max_memory_allocated() - held if cuda else 0
        gc.collect()  # the path's student, optimizer and activations go with its frame
        if cuda:
            torch.cuda.empty_cache()
        if progress:
            progress(path_figures(times, losses, peaks, failed, p))
    return times, losses, peaks, failed


def compile_note(names: list[str], policy: str) -> str | None:
    """Why a compiled path's checkpointed layers ran eagerly (distill.checkpointing.compose_problem), where one ran
    under a checkpointing; None where compile and checkpoint composed."""
    from m2d_ray.distill.checkpointing import compose_problem

    compiled = [n for n in names if n in ("platform_compiled", "lever:compile")]
    return compose_problem() if compiled and policy != "none" else None


def path_figures(times: dict, losses: dict, peaks: dict, failed: dict, p: dict) -> dict:
    """The paths finished so far: tokens/s (at each path's own micro-batch), losses, step peak; and those that
    failed, with why."""
    return {
        "tokens_per_s": {n: path_tokens(n, p) / statistics.median(ts) for n, ts in times.items() if ts},
        "losses": dict(losses),
        "peak_step_bytes": dict(peaks) if p["device"] == "cuda" else None,
        "paths_failed": dict(failed),
    }


def _alone(make, student0, batches: list, p: dict) -> tuple[list[float], list[float]]:
    """One path built from a copy of `student0` on the device and trained on every batch: its step seconds after the
    warm-up and its losses (everything it held is freed with this frame)."""
    step, take_loss = make(copy.deepcopy(student0).to(p["device"]).train())
    ts, ls = [], []
    for i, batch in enumerate(batches):
        t = time.perf_counter()
        step(batch)
        if p["device"] == "cuda":
            torch.cuda.synchronize()
        if i >= p["warmup"]:
            ts.append(time.perf_counter() - t)
        ls.append(take_loss())
    return ts, ls


def _window(cuda: bool) -> int:
    """Open a peak window on the device: what the allocator holds now (0 on a CPU)."""
    if not cuda:
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


@contextlib.contextmanager
def _kernel_failure(name: str, failed: dict[str, str]):
    """Any path that raises (a kernel, a lever, the compiled student, the plain loop, the platform itself) is recorded
    in `failed` with its one line and left out; the part goes on with the other paths and keeps their figures (what
    the GPU's libraries or memory cannot run must not hide every other figure)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - recorded, said, and the path is left out
        failed[name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:240]}"
        print(f"[{name}] FAILED, left out: {failed[name]}", flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def checkpointing_of(p: dict, device: str, memory: int | None = None) -> tuple[str, dict]:
    """The preset's activation checkpointing and what the plan says of it: `auto` (the paper preset) is what
    `m2d plan experiments/qwen3_30b_a3b.yaml` decides at one rank for this GPU's memory (or `memory` bytes), with the
    plan's rank for each policy; a preset without it trains with none (no plan to compare). A policy whose rank does
    not fit is also planned at the smaller micro-batches (`smaller_micro_batches`), largest first, down to the first
    that fits: its rank and its path's bytes at each."""
    if p.get("checkpointing") != "auto":
        return p.get("checkpointing", "none"), {}

    if memory is None:
        memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 141 * 10**9
    decided = paper_plan(memory)
    plans = {policy: paper_plan(memory, (f"distill.checkpointing={policy}",)) for policy in POLICIES}
    for policy, x in plans.items():  # what a P7 path holds itself of the rank the plan counts
        x["path_bytes"] = _path_bytes(x)
        if x["rank_bytes"] > x["capacity_bytes"]:  # its rank at the smaller micro-batches
            x["rank_by_micro_batch"], x["path_by_micro_batch"] = {}, {}
            for sequences, seq_len in smaller_micro_batches(p):
                y = paper_plan(
                    memory,
                    (
                        f"distill.checkpointing={policy}",
                        f"distill.batch_size={sequences}",
                        f"distill.seq_len={seq_len}",
                    ),
                )
                mb = micro_batch(sequences, seq_len)
                x["rank_by_micro_batch"][mb], x["path_by_micro_batch"][mb] = y["rank_bytes"], _path_bytes(y)
                if y["rank_bytes"] <= y["capacity_bytes"]:  # the largest that fits: no smaller one is run
                    break
    return decided["checkpointing"], {"decided": decided, "policies": plans, "gpu_memory": memory}


def _path_bytes(x: dict) -> int:
    return sum(v for k, v in x["parts"].items() if k in PATH_PARTS)


#: the shortest sequence a path is planned at below the preset's (a micro-batch of one sequence, halved down to this)
MIN_SEQ_LEN = 1024


def smaller_micro_batches(p: dict) -> list[tuple[int, int]]:
    """(sequences, tokens a sequence) below the preset's micro-batch, largest first: fewer of its sequences, then one
    sequence of half its length, halved again down to MIN_SEQ_LEN (the paper's 4 x 4096: 3, 2, 1 x 4096, 1 x 2048,
    1 x 1024)."""
    out = [(b, p["seq_len"]) for b in range(p["batch"] - 1, 0, -1)]
    length = p["seq_len"] // 2
    while length >= MIN_SEQ_LEN:
        out.append((1, length))
        length //= 2
    return out


def micro_batch(sequences: int, seq_len: int) -> str:
    """A micro-batch's name in a path's and the table's: "1x2048"."""
    return f"{sequences}x{seq_len}"


def path_micro_batch(name: str, p: dict) -> tuple[int, int]:
    """(sequences, tokens a sequence) path `name` trains on: a lever run at a smaller micro-batch says it after "@"
    ("lever:ckpt:selective@1x2048"), every other path the preset's."""
    _, at, mb = name.partition("@")
    if not at:
        return p["batch"], p["seq_len"]
    sequences, _, length = mb.partition("x")
    return int(sequences), int(length)


def path_tokens(name: str, p: dict) -> int:
    """The tokens of one step of path `name` (its tokens/s are these over its step's seconds)."""
    sequences, length = path_micro_batch(name, p)
    return sequences * length


#: a checkpointing lever asked as "ckpt:POLICY@fit" runs, where its rank does not fit at the preset's micro-batch, at
#: the largest smaller one whose rank fits (smaller_micro_batches), named with it: "ckpt:selective@1x2048"
FIT = "fit"


def planned_levers(levers: list[str], policy: str, plans: dict) -> tuple[list[str], dict[str, str]]:
    """The levers worth a device's time, and why the others are left out: a checkpointing lever that is the
    platform's own policy (the platform path runs it), or whose rank the plan says does not fit the device (it would
    only fail for want of memory); a lever asked "@fit" whose rank fits at a smaller micro-batch is kept at the largest
    that fits, named with it (its row says which)."""
    keep, skipped = [], {}
    for asked in levers:
        lever, _, at = asked.partition("@")
        value = lever.removeprefix("ckpt:")
        plan = (plans.get("policies") or {}).get(value) if lever.startswith("ckpt:") else None
        if lever.startswith("ckpt:") and value == policy:
            skipped[lever] = "the platform's own checkpointing"
        elif plan and plan["rank_bytes"] > plan["capacity_bytes"]:
            smaller = plan.get("rank_by_micro_batch") or {}
            fits = [mb for mb, b in smaller.items() if b <= plan["capacity_bytes"]]  # the first: the largest
            if fits and at == FIT:
                keep.append(f"{lever}@{fits[0]}")
                continue
            skipped[lever] = (
                f"the plan's rank needs {plan['rank_bytes'] / 2**30:.1f} GiB of {plan['capacity_bytes'] / 2**30:.1f}"
                + (
                    f"; at micro-batch {', '.join(f'{mb}: {b / 2**30:.1f}' for mb, b in smaller.items())}: "
                    + (
                        f"{fits[0]} would fit (asked without @{FIT}: the paths share the preset's)"
                        if fits
                        else "none fits"
                    )
                    if smaller
                    else ""
                )
            )
        else:  # a micro-batch named outright ("@1x2048") is kept as asked
            keep.append(lever if at in ("", FIT) else asked)
    return keep, skipped


def path_peaks(names: list[str], plans: dict, p: dict, policy: str) -> dict[str, int]:
    """Each path's planned peak on the device, where the preset has a plan: the plan's rank for the path's
    checkpointing (a ckpt lever's own, at its micro-batch where it names one, else the decided one), the plain loop's
    with its whole logits instead of the chunked KL; what the benchmark holds besides the path (the teacher's head,
    the cached targets, the CUDA context) included. {} without a plan."""
    if not plans:
        return {}
    pol = plans["policies"]
    out = {}
    for n in names:
        name, _, mb = n.partition("@")
        x = pol[name.removeprefix("lever:ckpt:") if name.startswith("lever:ckpt:") else policy]
        b = x["rank_by_micro_batch"][mb] if mb else x["rank_bytes"]
        if n == "reference":
            b += REFERENCE_LOGITS * p["batch"] * p["seq_len"] * p["vocab"] * 4 - x["parts"]["kl"]
        out[n] = int(b)
    return out


def path_plan_bytes(name: str, plans: dict, policy: str) -> int:
    """What path `name` holds itself by the plan (its checkpointing's, at its micro-batch): its peak's reference."""
    base, _, mb = name.partition("@")
    x = plans["policies"][base.removeprefix("lever:ckpt:") if base.startswith("lever:ckpt:") else policy]
    return x["path_by_micro_batch"][mb] if mb else x["path_bytes"]


def fitting_paths(names: list[str], peaks: dict, plans: dict) -> tuple[list[str], dict[str, str]]:
    """The paths whose planned peak fits the device's capacity (the plan's), and one line for each left out: never
    attempted, a path that cannot fit is a lost minute, not a figure."""
    if not plans:
        return list(names), {}
    cap = plans["decided"]["capacity_bytes"]
    over = {
        n: f"planned peak {peaks[n] / 2**30:.1f} GiB over the card's {cap / 2**30:.1f}" for n in names if peaks[n] > cap
    }
    return [n for n in names if n not in over], over


def lever_figures(r: dict) -> str:
    """Each lever's tok/s against the platform's, its MFU against the data sheet, its trajectory gap and its peak
    beside the plan's bytes for it; a lever run at a smaller micro-batch says which (its tokens are not the
    platform's: no gap); the paths that failed or were left out, with why."""
    base = r.get("platform_tokens_per_s")
    sheet = r.get("lever_mfu_datasheet") or {}
    plan = r.get("peak_vs_plan") or {}
    mbs = r.get("micro_batch") or {}

    def name_of(n: str) -> str:
        lever, at, _ = n.removeprefix("lever:").partition("@")
        return f"{lever} at micro-batch {mbs.get(n, n.partition('@')[2])} (the largest its rank fits)" if at else lever

    out = [
        f"{name_of(n)} {t:,.0f} tok/s ({t / base:.2f}x"
        + (f", MFU {sheet[n]:.1%} of the data sheet" if n in sheet else "")
        + (f", gap {r['gap'].get(n, math.nan):.1e}" if "@" not in n else ", no gap: other tokens than the platform's")
        + (f", peak {plan[n]:.2f}x the plan" if n in plan else "")
        + ")"
        for n, t in r.get("tokens_per_s", {}).items()
        if n.startswith("lever:") and base
    ]
    if "platform" in plan:
        at = f", micro-batch {mbs['platform']}" if "platform" in mbs else ""
        out.insert(0, f"platform ({r.get('checkpointing')}{at}) peak {plan['platform']:.2f}x the plan's path")
    if r.get("attention"):
        out.append(f"attention: {r['attention']['implementation']} fastest")
    if r.get("compile_note"):  # the compiled row is an eager one: said, so the table marks it
        out.append(f"COMPILE DID NOT COMPOSE WITH CHECKPOINTING: {r['compile_note']}")
    out += [f"{n} left out ({why})" for n, why in (r.get("levers_skipped") or {}).items()]
    out += [
        f"{n.removeprefix('lever:')} left out, never attempted ({why})"
        for n, why in (r.get("paths_left_out") or {}).items()
        if n.startswith("lever:")
    ]
    return "; ".join(out)
