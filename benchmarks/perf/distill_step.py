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
from benchmarks.perf.paper_step import rehearsal_lines
from workshop.local_group import free_port
from workshop.random_models import STEP_PRESETS, teacher_and_student
from workshop.step_paths import (
    checkpointing_of,
    compile_note,
    fitting_paths,
    in_turns,
    one_at_a_time,
    path_micro_batch,
    path_peaks,
    path_plan_bytes,
    path_tokens,
    planned_levers,
)


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


def builders(teacher, cfg, device: str, precision, spec, head, kernels: list[str], levers: list[str] = ()) -> dict:
    """Path name -> a function of a fresh student giving (step, take_loss). Every path checkpoints the student as
    cfg.checkpointing says; a lever path changes one thing of the platform's step (`lever_path`)."""
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
    for lever in levers:
        out[f"lever:{lever}"] = lambda s, lever=lever: lever_path(
            s, teacher.model, cfg, with_, lever, device, precision, spec, head
        )
    return {n: _checkpointed(make, cfg.checkpointing) for n, make in out.items()}


def _checkpointed(make, policy: str):
    """A path builder whose fresh student is first checkpointed as `policy` says (a lever may set its own after)."""
    from m2d_ray.distill import checkpointing

    def build(student):
        checkpointing.apply(student, policy)
        return make(student)

    return build


#: the levers of a fast step P7 measures one at a time against the platform's own step (`--levers`):
#: ckpt:POLICY  activation checkpointing none / selective / full instead of the plan's
#: compile      the decoder layers compiled one by one (distill.compile), the head eager
#: attn:IMPL    the student's attention implementation (sdpa, flash_attention_2)
LEVERS = ("ckpt:none", "ckpt:selective", "ckpt:full", "compile", "attn:sdpa", "attn:flash_attention_2")


def lever_path(student, teacher, cfg, with_, lever: str, device: str, precision, spec, head):
    """The platform's step (chunked KL) with one lever changed; a lever named with a smaller micro-batch
    ("ckpt:selective@1x2048": the plan's rank fits only there) trains on that part of each batch."""
    from m2d_ray.distill import checkpointing

    lever, at, mb = lever.partition("@")
    if at:
        sequences, _, length = mb.partition("x")
        step, take_loss = lever_path(student, teacher, cfg, with_, lever, device, precision, spec, head)
        return (lambda batch: step(shrink(batch, int(sequences), int(length)))), take_loss
    if lever not in LEVERS:
        raise SystemExit(f"--levers: unknown lever {lever!r} (known: {', '.join(LEVERS)})")
    what, _, value = lever.partition(":")
    if what == "ckpt":
        for layer in checkpointing.decoder_layers(student):
            layer.gradient_checkpointing = False
        checkpointing.apply(student, value)
        return platform_path(
            student, teacher, with_(kl_kernel="chunked", checkpointing=value), device, precision, spec, head
        )
    if what == "attn":
        student.set_attn_implementation(value)
        return platform_path(student, teacher, with_(kl_kernel="chunked"), device, precision, spec, head)
    return platform_path(student, teacher, with_(kl_kernel="chunked", compile=True), device, precision, spec, head)


def shrink(batch, sequences: int, length: int):
    """The first `sequences` sequences of a batch, each cut to its first `length` tokens (a causal model's targets of
    a prefix are the prefix's): token ids [B, L] or a cached-targets dict of [B, L, ...] tensors."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[:sequences, :length].contiguous()

    return {k: cut(v) for k, v in batch.items()} if isinstance(batch, dict) else cut(batch)


def attention_choice(tps: dict, gaps: dict, tol: float, student0) -> dict | None:
    """The student's attention implementation whose step was fastest among the platform's own and the `attn:` levers
    that agree with it (what distill/gpu.py's attention_implementation reads back from measured_gpu.json on the same
    card); None where no attention lever ran."""
    ran = {n: n.removeprefix("lever:attn:") for n in tps if n.startswith("lever:attn:") and gaps.get(n, 1.0) <= tol}
    if not ran or "platform" not in tps:
        return None
    ran["platform"] = student0.config._attn_implementation
    best = max(ran, key=tps.get)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"implementation": ran[best], "device": device, "tokens_per_s": {ran[n]: tps[n] for n in ran}}


def attention_ops(student0, p: dict) -> list[str]:
    """The attention ops one forward of the student dispatches to on the preset's device (one sequence, no gradient):
    on a GPU whether SDPA took its flash, cuDNN or efficient kernel for the student's grouped key/value heads, or its
    math path (a [T x T] matrix a head, which no memory plan counts)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if ("attention" in name or "softmax" in name) and name not in seen:
                seen.append(name)
            return func(*args, **(kwargs or {}))

    model = copy.deepcopy(student0).to(p["device"]) if p.get("one_path_at_a_time") else student0
    ids = torch.zeros(1, p["seq_len"], dtype=torch.long, device=p["device"])
    with torch.no_grad(), Record():
        model.base_model(input_ids=ids, use_cache=False)
    return seen


def default_levers(device: str) -> str:
    """Every lever that can run here: attention implementations only on a GPU, flash_attention_2 where flash-attn is
    installed."""
    import importlib.util

    if device != "cuda":
        return "ckpt:none,ckpt:selective,ckpt:full,compile"
    flash = importlib.util.find_spec("flash_attn") is not None
    return ",".join(lv for lv in LEVERS if lv != "attn:flash_attention_2" or flash)


def run_mode(
    text: str,
    p: dict,
    teacher,
    student0,
    ids: list,
    cfg,
    names: list[str],
    precision,
    kernels,
    levers=(),
    progress=None,
) -> dict:
    """One targets mode: every path from the same initial student on the same batches, in turns (or one path after
    the other where the preset holds one at a time: the paper student's); its figures. `progress(figures)` is told
    each path's figures as it finishes (one path at a time: a caller killed later keeps them)."""
    from m2d_ray.distill.targets import parse_targets

    device = p["device"]
    spec = parse_targets(text)
    if spec is not None and spec.mode not in ("hidden", "sampled"):
        raise SystemExit(
            f"--targets {text}: P7 compares online, hidden and sampled:N (its plain loop has no top-K loss)"
        )
    head = teacher.model.get_output_embeddings().weight.detach()
    batches = mode_batches(ids, teacher.model, spec, pin=device == "cuda")
    make = builders(teacher, cfg, device, precision, spec, head, kernels, levers)
    low = precision.dtype != torch.float32
    spread_path = low  # the bf16 path's own spread against float32 admits kernels
    names = [n for n in names if n in make] + [n for n in make if n.startswith(("platform:", "lever:"))]
    # bf16-mixed's spread (its step in float32) admits kernels; not at the paper preset (`no_fp32_spread`: the paper
    # student's float32 step needs ~2x its memory: its levers are held to the tolerance, and on the CPU to the
    # spread by tests/unit/test_levers.py)
    spread_path = spread_path and not p.get("no_fp32_spread")
    names += ["platform_fp32"] if spread_path and "platform_fp32" not in names else []
    run = one_at_a_time if p.get("one_path_at_a_time") else in_turns
    times, losses, peaks, failed = run(names, make, student0, batches, p, progress or (lambda figures: None))
    names = [n for n in names if n not in failed]
    del batches
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    tokens = p["batch"] * p["seq_len"]
    tps = {n: path_tokens(n, p) / statistics.median(ts) for n, ts in times.items()}
    base = "platform" if "platform" in losses else None  # a failed platform leaves the others' speed, no gap
    # a path at a smaller micro-batch learns from other tokens: its trajectory is not the platform's (no gap)
    same = [n for n in names if "@" not in n]
    gaps = {n: trajectory_gap(losses[n], losses[base]) for n in same} if base else {}
    spread = gaps.get("platform_fp32") if spread_path else None
    tol = 2e-2 if low else 1e-4  # what every path must agree within (else exit 1)
    admit = spread if spread_path and spread is not None else tol  # a kernel's admission: bf16's own spread
    agreeing = [n for n in gaps if n == "platform" or (n.startswith("platform:") and gaps[n] <= admit)]
    best = max(agreeing, key=tps.get) if agreeing else None
    try:
        head_s = head_kl_seconds(p, cfg, precision, student0, teacher, make_kernel(cfg.kl_kernel), device)
    except Exception as e:  # noqa: BLE001 - the head's own timing is one more figure, not the part's
        failed["head_kl"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:240]}"
        head_s = None
    return {
        "mode": text,
        "platform_tokens_per_s": tps.get("platform"),
        "platform_deepspeed_tokens_per_s": tps.get("platform_deepspeed"),
        "reference_tokens_per_s": tps.get("reference"),
        "ratio": tps["platform"] / tps["reference"] if {"platform", "reference"} <= set(tps) else None,
        "deepspeed_ratio": tps["platform_deepspeed"] / tps["reference"]
        if {"reference", "platform_deepspeed"} <= set(tps)
        else None,
        "kl_kernel": (best.partition(":")[2] or "chunked") if best else None,
        "auto_tokens_per_s": tps[best] if best else None,
        "flops_per_token": mode_flops(teacher, student0, spec, p["seq_len"]),
        "path_flops_per_token": {  # a path at another sequence length: its attention's own share
            n: mode_flops(teacher, student0, spec, path_micro_batch(n, p)[1]) for n in tps if "@" in n
        },
        "micro_batch": {n: "{} x {}".format(*path_micro_batch(n, p)) for n in tps},
        "tokens_per_s": tps,
        "peak_step_bytes": peaks if device == "cuda" else None,
        "step_s": {n: [round(t, 4) for t in ts] for n, ts in times.items()},
        "losses": losses,
        "gap": gaps,
        "tolerance": tol,
        "bf16_spread": spread,
        "kernel_admission": admit,
        "head_kl_s": head_s,
        "head_kl_share": head_s * tps["platform"] / tokens if "platform" in tps and head_s else None,
        "measured_at": {"loss": cfg.loss, "temperature": cfg.temperature, "path": "plain", "tokens": tokens},
        "loss_first": {n: ls[0] for n, ls in losses.items()},
        "loss_last": {n: ls[-1] for n, ls in losses.items()},
        "losses_agree": max((g for n, g in gaps.items() if n != "platform_fp32"), default=0.0) <= tol,
        "kernels_failed": failed,
        "attention": attention_choice(tps, gaps, tol, student0),
        "compile_note": compile_note(names, cfg.checkpointing),
    }


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
    dtypes only; nothing is computed or allocated). A CPU call proves here what a GPU would first fail at. For the
    paper preset also its whole student under each checkpointing beside the plan (benchmarks/perf/paper_step.py)."""
    head = _head_rehearsal(p)
    if "teacher_layers" not in p:
        return head
    from benchmarks.perf import paper_step

    return {**head, "student": paper_step.meta_rehearsal(p)}


def _head_rehearsal(p: dict) -> dict:
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


def add_mfu(m: dict, rate: float, peak: float | None = None) -> dict:
    """The mode's MFU (what distill.kl_kernel=auto would run: the platform with the mode's kl_kernel) and the plain
    loop's, against the matmul rate `rate` measured in this run, and against the device's data-sheet bf16 peak
    (`peak`, default `datasheet_peak()`; None on a CPU): the measured rate is ~0.8 of the data sheet on an H100/H200,
    so the two figures differ by that much and each is said with what it is against."""
    peak = peak if peak is not None else datasheet_peak()
    for key, tps in (("mfu", m["auto_tokens_per_s"]), ("reference_mfu", m["reference_tokens_per_s"])):
        m[key] = tps * m["flops_per_token"] / rate if tps else None
        m[f"{key}_datasheet"] = tps * m["flops_per_token"] / peak if tps and peak else None
    flops = m.get("path_flops_per_token") or {}
    m["lever_mfu_datasheet"] = {
        n: t * flops.get(n, m["flops_per_token"]) / peak
        for n, t in m["tokens_per_s"].items()
        if peak and n.startswith("lever:")
    }
    m["matmul_rate_vs_datasheet"] = rate / peak if peak else None
    return m


def datasheet_peak() -> float | None:
    """The data-sheet dense bf16 peak of this process's GPU (accelerators.GPU_PEAK_BF16, by the longest type name in
    the device's name); None on a CPU or an unlisted card."""
    from m2d_ray.accelerators import GPU_PEAK_BF16

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    key = next((k for k in sorted(GPU_PEAK_BF16, key=len, reverse=True) if k in name), None)
    return GPU_PEAK_BF16[key] if key else None


def beside_plan(m: dict, plans: dict, policy: str) -> dict:
    """Each path's step peak beside the plan's bytes for the same work (its checkpointing: a ckpt lever's own, else
    the decided one), where the preset has a plan."""
    if not plans:
        return m
    m["plan_path_bytes"] = {n: path_plan_bytes(n, plans, policy) for n in m["peak_step_bytes"] or {}}
    m["peak_vs_plan"] = {n: b / m["plan_path_bytes"][n] for n, b in (m["peak_step_bytes"] or {}).items()}
    m["plan_rank_bytes"] = plans["decided"]["rank_bytes"]
    m["checkpointing"] = policy
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
    ap.add_argument("--targets", help="comma-separated: online, hidden, sampled:N (default: the preset's, else online)")
    ap.add_argument(
        "--levers",
        help=f"levers timed one at a time beside the platform's step, comma-separated ({', '.join(LEVERS)}; default: "
        "on the paper preset every one that can run here, else none)",
    )
    ap.add_argument("--steps", type=int, help="timed steps per path (default: the preset's)")
    ap.add_argument("--warmup", type=int, help="untimed steps per path first (default: the preset's)")
    ap.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    ap.add_argument("--paths", default="platform,platform_deepspeed,reference")
    ap.add_argument("--precision", default="auto", help="distill.precision (default auto: bf16-mixed on a GPU, fp32)")
    ap.add_argument(
        "--meta-rehearsal",
        choices=sorted(STEP_PRESETS),
        help="first run the head's GPU branch on meta tensors at this preset's head and tokens, and for the paper "
        "preset its whole student under each checkpointing beside the plan (a CPU rehearsal)",
    )
    ap.add_argument(
        "--kernels",
        default=None,
        help="exact-KL kernels timed beside chunked, comma-separated (default: on a GPU every one that imports here)",
    )
    ap.add_argument(
        "--plan-only",
        action="store_true",
        help="print the preset's checkpointing and what `m2d plan` says of each policy's rank (on a CPU: at an "
        "H200's 141 GB) as one JSON line, and stop (no model is built)",
    )
    ap.add_argument(
        "--gpu-memory",
        type=float,
        help="with --plan-only: plan for a card of this many GB (default: this GPU's, on a CPU an H200's 141)",
    )
    ap.add_argument(
        "--no-fp32-spread",
        action="store_true",
        help="no float32 path beside bf16-mixed (the paper preset's way: it would need ~2x the memory)",
    )
    ap.add_argument(
        "--one-path-at-a-time",
        action="store_true",
        help="build, train and free each path in turn (the paper preset's way) instead of taking turns step by step",
    )
    ap.add_argument(
        "--json-out",
        help="also write the figures to this JSON file, rewritten as each mode finishes: meta_rehearsal, modes, final",
    )
    a = ap.parse_args()
    p = dict(STEP_PRESETS[a.preset])
    p["steps"], p["warmup"] = a.steps or p["steps"], a.warmup if a.warmup is not None else p["warmup"]
    p["one_path_at_a_time"] = p.get("one_path_at_a_time") or a.one_path_at_a_time
    p["no_fp32_spread"] = p.get("no_fp32_spread") or a.no_fp32_spread
    if a.threads:
        torch.set_num_threads(a.threads)
    device = p["device"]
    names = [n for n in a.paths.split(",") if n]
    if a.plan_only:
        memory = int(a.gpu_memory * 10**9) if a.gpu_memory else None
        policy, plans = checkpointing_of(p, device, memory)
        asked = a.levers if a.levers is not None else default_levers(device)
        levers, skipped = planned_levers([lv for lv in asked.split(",") if lv], policy, plans)
        every = names + [f"lever:{lv}" for lv in levers]
        peaks = path_peaks(every, plans, p, policy)
        kept, left_out = fitting_paths(every, peaks, plans)
        out = {
            "preset": a.preset,
            "checkpointing": policy,
            "plan": plans,
            "levers": levers,
            "levers_skipped": skipped,
            "paths": kept,
            "paths_left_out": left_out,
            "planned_peak_bytes": peaks,
        }
        print(json.dumps(out))
        write_json(a.json_out, out)
        return
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--preset {a.preset} needs a CUDA device")
    bad = [lv for lv in (a.levers or "").split(",") if lv and lv.partition("@")[0] not in LEVERS]
    if bad:
        raise SystemExit(f"--levers: unknown {', '.join(bad)} (known: {', '.join(LEVERS)})")
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.flops import matmul_rate
    from m2d_ray.distill.precision import for_device

    record: dict = {"modes": {}}  # what --json-out holds so far (a caller that kills this run keeps it)
    if a.meta_rehearsal:
        record["meta_rehearsal"] = meta_rehearsal(STEP_PRESETS[a.meta_rehearsal])
        print(json.dumps({"meta_rehearsal": record["meta_rehearsal"]}), flush=True)
        for line in rehearsal_lines(record["meta_rehearsal"].get("student") or {"policies": {}}):
            print(line, file=sys.stderr)
        write_json(a.json_out, record)
    precision = for_device(a.precision, device)  # what stage 2 trains in
    kernels = [k for k in (default_kernels(device) if a.kernels is None else a.kernels).split(",") if k]
    levers = a.levers if a.levers is not None else default_levers(device) if "teacher_layers" in p else ""
    levers = [lv for lv in levers.split(",") if lv]
    policy, plans = checkpointing_of(p, device)
    levers, skipped = planned_levers(levers, policy, plans)
    peaks = path_peaks(names + [f"lever:{lv}" for lv in levers], plans, p, policy)
    kept, left_out = fitting_paths(names + [f"lever:{lv}" for lv in levers], peaks, plans)
    names, levers = [n for n in names if n in kept], [lv for lv in levers if f"lever:{lv}" in kept]
    for n, why in left_out.items():
        print(f"[{n}] left out, never attempted: {why}", file=sys.stderr, flush=True)
    record["plan"] = plans
    record["paths_left_out"], record["planned_peak_bytes"] = left_out, peaks
    print(machine_line(), file=sys.stderr)
    t0 = time.perf_counter()
    teacher, student0 = teacher_and_student(p, precision.dtype)
    if p.get("one_path_at_a_time"):  # the initial student waits on the host: each path copies it to the device
        student0 = student0.to("cpu")
    rate = matmul_rate(device, precision.dtype)
    n_steps = p["warmup"] + p["steps"]
    cfg = DistillConfig(
        steps=n_steps,
        warmup_steps=max(1, n_steps // 4),
        batch_size=p["batch"],
        seq_len=p["seq_len"],
        deepspeed=False,
        checkpointing=policy,
    )
    record["attention_ops"] = attention_ops(student0, p)
    print(f"attention dispatches to {', '.join(record['attention_ops'])}", file=sys.stderr)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, p["vocab"], (p["batch"], p["seq_len"]), generator=gen).to(device) for _ in range(n_steps)]
    if "platform_deepspeed" in names:
        init_process_group(device)
    print(
        f"built in {time.perf_counter() - t0:.1f} s; {precision.name}; checkpointing {policy}; {len(names)} paths + "
        f"kernels {kernels or '-'} + levers {levers or '-'} x {p['warmup']} warm-up + {p['steps']} timed steps"
        + (", one path at a time" if p.get("one_path_at_a_time") else ""),
        file=sys.stderr,
    )
    modes = {}
    for text in [t.strip() for t in (a.targets or p.get("targets", "online")).split(",") if t.strip()]:

        def progress(figures: dict, text=text) -> None:  # each finished path's figures, before the mode's end
            write_json(a.json_out, record | {"modes": modes, "running": {"mode": text, **figures}})

        m = run_mode(text, p, teacher, student0, ids, cfg, names, precision, kernels, levers, progress)
        m = {**m, "levers_skipped": skipped, "paths_left_out": left_out, "planned_peak_bytes": peaks}
        modes[text] = add_mfu(beside_plan(m, plans, policy), rate)
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
        "attention_ops": record["attention_ops"],
        "plan": plans,
    }
    print(machine_line(), file=sys.stderr)
    print(json.dumps(out))
    write_json(a.json_out, record | {"modes": modes, "final": out})
    bad = {t: {n: round(g, 5) for n, g in m["gap"].items()} for t, m in modes.items() if not m["losses_agree"]}
    if bad:
        raise SystemExit(f"loss trajectories differ beyond their tolerance (largest relative gap per path): {bad}")


if __name__ == "__main__":
    main()
