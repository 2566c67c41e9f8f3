"""P7: the platform's stage-2 training step against a hand-written PyTorch loop, same models, same batches, same
numerics, for each of stage 2's teacher outputs (`--targets`): the online teacher, its cached final hidden states, its
cached samples; and, per mode, every exact-KL kernel a GPU may make faster (`--kernels`, distill/kernels.py).

A random-weight Qwen3-MoE teacher of the preset's shape and its random-FFN dense student (the `random-ffn`
baseline: teacher attention, fresh FFN of width k x d_expert) are built in memory, nothing read or
written. For each targets mode, the paths then take turns in this process on one device, one step each per
round (each going first in turn), every one from the same initial student and on the same batches:

    platform            m2d_ray.distill.step.DistillStep, what stage 2 runs at one rank: plain torch, chunked KL
    platform:KERNEL     the same step with distill.kl_kernel=KERNEL (liger), exact modes only
    platform_compiled   the same step with distill.compile (the student's loss module compiled), chunked KL
    platform_deepspeed  the same step with DeepSpeed ZeRO-2 (world of 1): what the paper configs run
    reference           this file's plain loop, the same update (backward, clip, fused AdamW, the same parameter
                        groups and warm-up/cosine schedule) from the whole [tokens x vocab] float32 logits:
                          online      the teacher's final states @ its head under no_grad, the forward KL (F.kl_div)
                          hidden      the teacher's logits as cached hidden states @ its head, the same KL
                          sampled:N   -sum_j w_j log p_s(j) + const over the N cached draws (Sparse Logit Sampling)

Every path trains in the platform's precision policy (`--precision`, default auto: bf16-mixed on a GPU, fp32 on a
CPU; distill/precision.py): with bf16-mixed the model computes in bfloat16 and the loop, like the platform, steps
float32 master weights and moments and rounds them into the model, so a ratio compares the same work.

Cached targets (`hidden`, `sampled:N`) are made before the clock by the teacher and `distill.targets.teacher_targets`
on the device, kept in host memory (pinned on CUDA) as stage 2's loader keeps them, and copied to the device
inside each timed step, by every path alike. Only steady-state steps are timed (after --warmup steps, which also pay a
compiled kernel's compilation; no evaluation or checkpoint inside); a path's tokens/s is tokens per step / its median
step time, its peak the most the CUDA allocator held during one of its steps above what it held before it. Correct
first: every path's whole loss trajectory must agree with the platform's (its largest difference at any step, relative
to the platform's mean loss, within 1e-4 in float32, 2% in bfloat16: Adam's first step is blind to a gradient's
scale, so a first-step check proves little), else the script exits 1 after printing everything. FLOPs per token are
the bill's (plan/cost.py stage2_flops): the student's forward and backward plus the teacher's forward (online) or
its output head (hidden; nothing for sampled). MFU = FLOPs per token x tokens/s over the device's matmul rate in the
training dtype, measured in the same run (before and after the steps, the higher of the two). Per mode, `kl_kernel`
names the fastest platform kernel whose trajectory agrees with chunked: what distill.kl_kernel=auto should use on
this GPU, at this loss (forward KL), temperature (1) and path (plain, one rank), all recorded with it ("measured_at").
In a low-precision policy a kernel is admitted only within the policy's own spread: the same platform step in float32
(`platform_fp32`, same teacher) runs beside the others, and a kernel's gap to chunked must not exceed chunked's gap
to it ("bf16_spread"). Per mode P7 also times the head and the KL alone (the platform's loss, forward and backward,
through the real heads at the preset's tokens: "head_kl_s", "head_kl_share" of the platform's step) and prints one
line with that share, the spread and each path's step peak.

Output: one JSON line per mode as it finishes ({"mode": ...}), then one line with all of them under "targets".

    python -m benchmarks.perf.distill_step                # CPU preset, online, float32 (< 5 min on 2 cores)
    python -m benchmarks.perf.distill_step --precision bf16-mixed --steps 20 --warmup 0   # a GPU's numerics on CPU
    python -m benchmarks.perf.distill_step --preset h100 --targets online,hidden,sampled:64
                                                              # the issue's 2.52B teacher -> 0.40B student, 8 x 2048
                                                              tokens, bf16-mixed, kernels chunked, liger
    python -m benchmarks.perf.distill_step --preset smoke --targets online,hidden,sampled:8   # plumbing, seconds
    python -m benchmarks.perf.distill_step --preset head --targets online --paths platform,reference
                                                              # the paper student's head (V 151,936, d 2048), 4096
                                                              tokens: the head + KL's share of the step, each
                                                              kernel's step peak, bf16-mixed's spread vs fp32
    python -m benchmarks.perf.distill_step --preset head-cpu --paths platform --threads 2   # that share on a CPU
    python -m benchmarks.perf.distill_step --preset smoke --precision bf16-mixed --meta-rehearsal head
                                                              # the GPU branch of the head at its real shapes, on
                                                              meta tensors (numerics.tensor_cores forced)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import cpu_model, machine_line, write_json
from workshop.local_group import free_port
from workshop.random_models import STEP_PRESETS, teacher_and_student


def init_process_group(device: str) -> None:
    """A world of one for DeepSpeed (outside Ray Train it would look for MPI)."""
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


def platform_path(student, teacher, cfg, device: str, precision, spec=None, head=None):
    """DistillStep: online (`teacher`), or from cached targets of `spec` (hidden: with the teacher's `head`)."""
    from m2d_ray.distill.step import DistillStep

    trainer = DistillStep(
        student, teacher if spec is None else None, cfg, device, 1, precision, targets=spec, head=head
    )
    return (lambda batch: trainer.step([_to(batch, device)])), trainer.take_loss


def _to(batch, device: str):
    return (
        {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        if isinstance(batch, dict)
        else batch.to(device, non_blocking=True)
    )


def reference_path(student, teacher, cfg, device: str, precision, spec=None, head=None):
    """A hand-written loop: the whole float32 logits, the mode's loss on them (F.kl_div / a gather), fused AdamW; with
    master weights (bf16-mixed), on float32 copies of the weights, rounded into the bfloat16 model after each step."""
    from m2d_ray.distill.step import lr_factor
    from m2d_ray.numerics import logits

    student.to(precision.dtype)
    weights = list(student.parameters())
    trained = [w.detach().float().clone().requires_grad_() for w in weights] if precision.masters else weights
    opt = torch.optim.AdamW(
        [
            {"params": [m for w, m in zip(weights, trained) if w.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [m for w, m in zip(weights, trained) if w.ndim < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        fused=True,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    losses: list[torch.Tensor] = []
    w_s = student.get_output_embeddings().weight

    def loss_of(batch) -> torch.Tensor:
        ids = batch["tokens"] if isinstance(batch, dict) else batch
        h = student.base_model(input_ids=ids, use_cache=False).last_hidden_state
        ls = F.log_softmax(logits(h.flatten(0, 1), w_s), -1)
        if spec is not None and spec.mode == "sampled":
            w = batch["counts"].float().view(ls.shape[0], -1)
            w = w / w.sum(-1, keepdim=True).clamp_min(1.0)
            return (
                (w * (batch["logp"].float().view_as(w) - ls.gather(1, batch["ids"].view_as(w).long()))).sum(-1).mean()
            )
        with torch.no_grad():
            h_t = batch["hidden"] if spec is not None else teacher.base_model(input_ids=ids).last_hidden_state
            t = logits(h_t.flatten(0, 1).to(head.dtype), head)
        return F.kl_div(ls, F.log_softmax(t, -1), log_target=True, reduction="batchmean")

    def step(batch):
        loss = loss_of(_to(batch, device))
        loss.backward()
        if precision.masters:
            for w, m in zip(weights, trained):
                m.grad, w.grad = w.grad.float(), None
        torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if precision.masters:
            with torch.no_grad():
                for w, m in zip(weights, trained):
                    w.copy_(m)
        losses.append(loss.detach())

    return step, lambda: float(losses.pop())


def mode_batches(ids: list[torch.Tensor], teacher, spec, pin: bool) -> list:
    """The batches a mode trains on: the ids themselves (online), or dicts of the ids and their cached targets
    (made here by the teacher on the device, then kept in host memory, as stage 2's loader keeps them)."""
    if spec is None:
        return ids
    from m2d_ray.distill.step import teacher_outputs
    from m2d_ray.distill.targets import teacher_targets

    out = []
    for i, x in enumerate(ids):
        h, _ = teacher_outputs(teacher, x, False)
        t = teacher_targets(h, teacher.get_output_embeddings().weight.detach(), spec, first_block=i * x.shape[0])
        batch = {"tokens": x.cpu(), **{k: v.cpu() for k, v in t.items()}}
        out.append({k: v.pin_memory() for k, v in batch.items()} if pin else batch)
    return out


def mode_flops(teacher, student, spec, seq_len: int) -> float:
    """The bill's FLOPs of one training token (plan/cost.py stage2_flops): student forward and backward, plus the
    teacher's forward (online) or its head (hidden)."""
    from m2d_ray.distill.flops import flops_per_token

    f = flops_per_token(teacher.model, teacher.adapter, student, seq_len, teacher_forward=spec is None)
    if spec is not None and spec.mode == "hidden":
        f += 2.0 * teacher.model.get_output_embeddings().weight.numel()
    return f


def trajectory_gap(a: list[float], b: list[float]) -> float:
    """The largest difference between two loss trajectories at any step, relative to `b`'s mean size (a sampled
    estimate may cross zero: a step's own loss is no scale)."""
    return max(abs(x - y) for x, y in zip(a, b)) / max(statistics.fmean(abs(y) for y in b), 1e-12)


def builders(teacher, cfg, device: str, precision, spec, head, kernels: list[str]) -> dict:
    """Path name -> a function of a fresh student giving (step, take_loss)."""
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.precision import PRECISIONS

    def with_(**kw):
        return DistillConfig(**{**cfg.__dict__, **kw})

    out = {
        "platform": lambda s: platform_path(
            s, teacher.model, with_(kl_kernel="chunked"), device, precision, spec, head
        ),
        "platform_deepspeed": lambda s: platform_path(
            s, teacher.model, with_(deepspeed=True, kl_kernel="chunked"), device, precision, spec, head
        ),
        "reference": lambda s: reference_path(s, teacher.model, cfg, device, precision, spec, head),
        "platform_fp32": lambda s: platform_path(
            s, teacher.model, with_(kl_kernel="chunked"), device, PRECISIONS["fp32"], spec, head
        ),
        "platform_compiled": lambda s: platform_path(  # distill.compile: the student's loss module compiled
            s, teacher.model, with_(kl_kernel="chunked", compile=True), device, precision, spec, head
        ),
    }
    for k in kernels if spec is None or spec.exact else []:  # top-K / sampled targets have no kernels
        out[f"platform:{k}"] = lambda s, k=k: platform_path(
            s, teacher.model, with_(kl_kernel=k), device, precision, spec, head
        )
    return out


def run_mode(text: str, p: dict, teacher, student0, ids: list, cfg, names: list[str], precision, kernels) -> dict:
    """One targets mode: every path from the same initial student on the same batches, in turns; its figures."""
    from m2d_ray.distill.targets import parse_targets

    device = p["device"]
    spec = parse_targets(text)
    if spec is not None and spec.mode not in ("hidden", "sampled"):
        raise SystemExit(
            f"--targets {text}: P7 compares online, hidden and sampled:N (its plain loop has no top-K loss)"
        )
    head = teacher.model.get_output_embeddings().weight.detach()
    batches = mode_batches(ids, teacher.model, spec, pin=device == "cuda")
    make = builders(teacher, cfg, device, precision, spec, head, kernels)
    spread_path = precision.dtype != torch.float32  # the bf16 path's own spread against float32 admits kernels
    names = [n for n in names if n in make] + [n for n in make if n.startswith("platform:")]
    names += ["platform_fp32"] if spread_path and "platform_fp32" not in names else []
    failed: dict[str, str] = {}  # a kernel that cannot run here: recorded, and the others go on
    paths = {}
    for n in names:
        with _kernel_failure(n, failed):
            paths[n] = make[n](copy.deepcopy(student0).to(device).train())
    names = [n for n in names if n not in failed]
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, int] = {n: 0 for n in names}
    cuda = device == "cuda"
    for i, batch in enumerate(batches):
        for n in names[i % len(names) :] + names[: i % len(names)]:  # each path goes first in turn
            if n in failed:
                continue
            step, take_loss = paths[n]
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated()
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
    names = [n for n in names if n not in failed]
    times, losses = {n: times[n] for n in names}, {n: losses[n] for n in names}
    peaks = {n: peaks[n] for n in names}
    del paths, batches
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    tokens = p["batch"] * p["seq_len"]
    tps = {n: tokens / statistics.median(ts) for n, ts in times.items()}
    gaps = {n: trajectory_gap(losses[n], losses["platform"]) for n in names}
    spread = gaps.get("platform_fp32") if spread_path else None
    tol = 2e-2 if spread_path else 1e-4  # what every path must agree within (else exit 1)
    admit = spread if spread_path else tol  # what a kernel must agree within to be chosen: bf16's own spread
    agreeing = [n for n in names if n == "platform" or (n.startswith("platform:") and gaps[n] <= admit)]
    best = max(agreeing, key=tps.get)
    head_s = head_kl_seconds(p, cfg, precision, student0, teacher, make_kernel(cfg.kl_kernel), device)
    return {
        "mode": text,
        "platform_tokens_per_s": tps.get("platform"),
        "platform_deepspeed_tokens_per_s": tps.get("platform_deepspeed"),
        "reference_tokens_per_s": tps.get("reference"),
        "ratio": tps["platform"] / tps["reference"] if "reference" in tps else None,
        "deepspeed_ratio": tps["platform_deepspeed"] / tps["reference"]
        if {"reference", "platform_deepspeed"} <= set(tps)
        else None,
        "kl_kernel": best.partition(":")[2] or "chunked",
        "auto_tokens_per_s": tps[best],
        "flops_per_token": mode_flops(teacher, student0, spec, p["seq_len"]),
        "tokens_per_s": tps,
        "peak_step_bytes": peaks if cuda else None,
        "step_s": {n: [round(t, 4) for t in ts] for n, ts in times.items()},
        "losses": losses,
        "gap": gaps,
        "tolerance": tol,
        "bf16_spread": spread,
        "kernel_admission": admit,
        "head_kl_s": head_s,
        "head_kl_share": head_s * tps["platform"] / tokens if "platform" in tps else None,
        "measured_at": {"loss": cfg.loss, "temperature": cfg.temperature, "path": "plain", "tokens": tokens},
        "loss_first": {n: ls[0] for n, ls in losses.items()},
        "loss_last": {n: ls[-1] for n, ls in losses.items()},
        "losses_agree": max(g for n, g in gaps.items() if n != "platform_fp32") <= tol,
        "kernels_failed": failed,
    }


@contextlib.contextmanager
def _kernel_failure(name: str, failed: dict[str, str]):
    """A kernel path (`platform:KERNEL`) or the compiled student (`platform_compiled`) that raises is recorded in
    `failed` with its one line and left out; the part goes on with the other paths (what the GPU's libraries cannot
    run must not hide every other figure). Any other path's failure is the part's."""
    if not (name.startswith("platform:") or name == "platform_compiled"):
        yield
        return
    try:
        yield
    except Exception as e:  # noqa: BLE001 - recorded, said, and the kernel is left out
        failed[name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:240]}"
        print(f"[{name}] FAILED, left out: {failed[name]}", flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def make_kernel(name: str):
    from m2d_ray.distill.kernels import KL_KERNELS

    return KL_KERNELS["chunked" if name == "auto" else name]


def head_kl_seconds(p: dict, cfg, precision, student0, teacher, kernel, device: str) -> float:
    """Seconds of the head and the KL alone at the preset's tokens: the platform's loss (chunked) forward and backward
    from hidden states (random, in the policy's dtype) through the student's and the teacher's real heads, the median
    of 3 after one untimed; the step's share of it is what the body cannot hide."""
    tokens = p["batch"] * p["seq_len"]
    g = torch.Generator(device=device).manual_seed(2)
    h = torch.randn(tokens, p["hidden"], generator=g, device=device).to(precision.dtype).requires_grad_()
    h_t = torch.randn(tokens, p["hidden"], generator=g, device=device).to(teacher.model.dtype)
    w_s = student0.get_output_embeddings().weight.detach().to(device, precision.dtype).requires_grad_()
    w_t = teacher.model.get_output_embeddings().weight.detach()
    times = []
    for _ in range(4):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        kernel.kl(h, w_s, h_t, w_t, kind="fkl", temperature=cfg.temperature, chunk=cfg.loss_chunk).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        h.grad = w_s.grad = None
    return statistics.median(times[1:])


def meta_rehearsal(p: dict) -> dict:
    """The GPU branch of the head's numerics (numerics.tensor_cores forced) on `meta` tensors at the preset's head and
    tokens: the platform's chunked loss and the plain loop's logits, forward and backward, in bfloat16 (shapes and
    dtypes only; nothing is computed or allocated). A CPU call proves here what a GPU would first fail at."""
    from m2d_ray import numerics
    from m2d_ray.distill.losses import chunked_kl

    tokens, d, v = p["batch"] * p["seq_len"], p["hidden"], p["vocab"]

    def bf16(*shape, grad=False):
        return torch.empty(*shape, device="meta", dtype=torch.bfloat16).requires_grad_(grad)

    seam, numerics.tensor_cores = numerics.tensor_cores, lambda t: True
    try:
        h, w = bf16(tokens, d, grad=True), bf16(v, d, grad=True)
        chunked_kl(h, w, bf16(tokens, d), bf16(v, d)).backward()
        platform = (tuple(h.grad.shape), tuple(w.grad.shape), str(w.grad.dtype))
        h.grad = w.grad = None
        z = numerics.logits(h, w)
        F.kl_div(F.log_softmax(z, -1), F.log_softmax(z.detach(), -1), log_target=True, reduction="batchmean").backward()
        reference = (tuple(h.grad.shape), tuple(w.grad.shape), str(w.grad.dtype))
    finally:
        numerics.tensor_cores = seam
    return {"tokens": tokens, "vocab": v, "hidden": d, "platform_grads": platform, "reference_grads": reference}


def add_mfu(m: dict, rate: float) -> dict:
    """The mode's MFU (what distill.kl_kernel=auto would run: the platform with the mode's kl_kernel) and the plain
    loop's, against the matmul rate `rate`."""
    m["mfu"] = m["auto_tokens_per_s"] * m["flops_per_token"] / rate
    m["reference_mfu"] = (
        m["reference_tokens_per_s"] * m["flops_per_token"] / rate if m["reference_tokens_per_s"] else None
    )
    return m


def summary_line(m: dict) -> str:
    """One line per mode: the head and the KL's share of the platform's step, the kernel admission and each path's
    step peak (on a GPU)."""
    share = f"{m['head_kl_share']:.0%}" if m.get("head_kl_share") is not None else "-"
    spread = f"; bf16-mixed vs fp32 {m['bf16_spread']:.2e} admits kernels" if m.get("bf16_spread") is not None else ""
    peaks = m.get("peak_step_bytes") or {}
    peak = "; step peaks " + ", ".join(f"{n} {b / 2**30:.1f} GiB" for n, b in peaks.items()) if peaks else ""
    return (
        f"[{m['mode']}] head + KL {m['head_kl_s'] * 1e3:.1f} ms = {share} of the platform's step{spread}; "
        f"auto: {m['kl_kernel']}{peak}"
    )


def default_kernels(device: str) -> str:
    """Every kernel that can run here besides chunked (the platform path itself); none on a CPU by default (a
    compilation takes longer than the CPU preset's steps; name them to try)."""
    from m2d_ray.distill.kernels import KL_KERNELS

    if device != "cuda":
        return ""
    return ",".join(k for k in KL_KERNELS if k != "chunked" and not KL_KERNELS[k].unavailable(device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(STEP_PRESETS), default="cpu")
    ap.add_argument("--targets", default="online", help="comma-separated: online, hidden, sampled:N (default: online)")
    ap.add_argument("--steps", type=int, help="timed steps per path (default: the preset's)")
    ap.add_argument("--warmup", type=int, help="untimed steps per path first (default: the preset's)")
    ap.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    ap.add_argument("--paths", default="platform,platform_deepspeed,reference")
    ap.add_argument("--precision", default="auto", help="distill.precision (default auto: bf16-mixed on a GPU, fp32)")
    ap.add_argument(
        "--meta-rehearsal",
        choices=sorted(STEP_PRESETS),
        help="first run the head's GPU branch on meta tensors at this preset's head and tokens (a CPU rehearsal)",
    )
    ap.add_argument(
        "--kernels",
        default=None,
        help="exact-KL kernels timed beside chunked, comma-separated (default: on a GPU every one that imports here)",
    )
    ap.add_argument(
        "--json-out",
        help="also write the figures to this JSON file, rewritten as each mode finishes: meta_rehearsal, modes, final",
    )
    a = ap.parse_args()
    p = dict(STEP_PRESETS[a.preset])
    p["steps"], p["warmup"] = a.steps or p["steps"], a.warmup if a.warmup is not None else p["warmup"]
    if a.threads:
        torch.set_num_threads(a.threads)
    device = p["device"]
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--preset {a.preset} needs a CUDA device")
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.flops import matmul_rate
    from m2d_ray.distill.precision import for_device

    record: dict = {"modes": {}}  # what --json-out holds so far (a caller that kills this run keeps it)
    if a.meta_rehearsal:
        record["meta_rehearsal"] = meta_rehearsal(STEP_PRESETS[a.meta_rehearsal])
        print(json.dumps({"meta_rehearsal": record["meta_rehearsal"]}), flush=True)
        write_json(a.json_out, record)
    precision = for_device(a.precision, device)  # what stage 2 trains in
    kernels = [k for k in (default_kernels(device) if a.kernels is None else a.kernels).split(",") if k]
    print(machine_line(), file=sys.stderr)
    t0 = time.perf_counter()
    teacher, student0 = teacher_and_student(p, precision.dtype)
    rate = matmul_rate(device, precision.dtype)
    n_steps = p["warmup"] + p["steps"]
    cfg = DistillConfig(
        steps=n_steps, warmup_steps=max(1, n_steps // 4), batch_size=p["batch"], seq_len=p["seq_len"], deepspeed=False
    )
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, p["vocab"], (p["batch"], p["seq_len"]), generator=gen).to(device) for _ in range(n_steps)]
    names = [n for n in a.paths.split(",") if n]
    if "platform_deepspeed" in names:
        init_process_group(device)
    print(
        f"built in {time.perf_counter() - t0:.1f} s; {precision.name}; {len(names)} paths + kernels {kernels or '-'} x "
        f"{p['warmup']} warm-up + {p['steps']} timed steps",
        file=sys.stderr,
    )
    modes = {}
    for text in [t.strip() for t in a.targets.split(",") if t.strip()]:
        modes[text] = add_mfu(run_mode(text, p, teacher, student0, ids, cfg, names, precision, kernels), rate)
        print(
            json.dumps(modes[text]), flush=True
        )  # MFU against the rate before the steps (a caller killed later keeps it)
        print(summary_line(modes[text]), file=sys.stderr, flush=True)
        write_json(a.json_out, record | {"modes": modes})
    rate = max(rate, matmul_rate(device, precision.dtype))  # before and after the steps: the best this run saw
    for m in modes.values():
        add_mfu(m, rate)
    out = {
        "preset": a.preset,
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else f"{cpu_model()} ({torch.get_num_threads()} threads)",
        "precision": precision.name,
        "dtype": str(precision.dtype).removeprefix("torch."),
        "teacher_params": sum(w.numel() for w in teacher.model.parameters()),
        "student_params": sum(w.numel() for w in student0.parameters()),
        "tokens": p["batch"] * p["seq_len"],
        "timed_steps": p["steps"],
        "matmul_flops_per_s": rate,
        "peak_memory_bytes": torch.cuda.max_memory_allocated()
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "targets": modes,
    }
    print(machine_line(), file=sys.stderr)
    print(json.dumps(out))
    write_json(a.json_out, record | {"modes": modes, "final": out})
    bad = {t: {n: round(g, 5) for n, g in m["gap"].items()} for t, m in modes.items() if not m["losses_agree"]}
    if bad:
        raise SystemExit(f"loss trajectories differ beyond their tolerance (largest relative gap per path): {bad}")


if __name__ == "__main__":
    main()
