"""P7: the platform's stage-2 training step against a hand-written PyTorch loop, same models, same batches, for
each of stage 2's teacher outputs (`--targets`): the online teacher, its cached final hidden states, its cached
samples.

A random-weight Qwen3-MoE teacher of the preset's shape and its random-FFN dense student (the `random-ffn`
baseline: teacher attention, fresh FFN of width k x d_expert) are built in memory, nothing read or
written. For each targets mode, three paths then take turns in this process on one device, one step each per
round (each going first in turn), every one from the same initial student and on the same batches:

    platform            m2d_ray.distill.step.DistillStep, what stage 2 runs: plain torch (no DeepSpeed)
    platform_deepspeed  the same step with DeepSpeed ZeRO-2 (world of 1)
    reference           this file's plain loop, the same update (backward, clip, fused AdamW, the same parameter
                        groups and warm-up/cosine schedule) from the whole [tokens x vocab] logits:
                          online      teacher(ids).logits under no_grad, full-vocabulary forward KL (F.kl_div)
                          hidden      the teacher's logits as cached hidden states @ its head, the same KL
                          sampled:N   -sum_j w_j log p_s(j) + const over the N cached draws (Sparse Logit Sampling)

Cached targets (`hidden`, `sampled:N`) are made before the clock by the teacher and `distill.targets.teacher_targets`
on the device, kept in host memory (pinned on CUDA) as stage 2's loader keeps them, and copied to the device
inside each timed step, by every path alike. Only steady-state steps are timed (after --warmup steps; no
evaluation or checkpoint inside); a path's tokens/s is tokens per step / its median step time. Correct first: a
mode's first-step losses must agree across its paths (same weights, same data), else the script exits 1 after
printing everything. FLOPs per token are the bill's (m2d_ray/plan/cost.py: stage2_flops): the student's forward
and backward plus the teacher's forward (online) or its output head (hidden; nothing for sampled). MFU = FLOPs
per token x tokens/s over the device's matmul rate in the training dtype (bf16 on CUDA, float32 on CPU),
measured in the same run (before and after the steps, the higher of the two).

Output: one JSON line per mode as it finishes ({"mode": ...}), then one line with all of them under "targets".

    python benchmarks/p7_distill_throughput.py                # CPU preset, online (< 5 min on 2 cores)
    python benchmarks/p7_distill_throughput.py --preset h100 --targets online,hidden,sampled:64
                                                              # the issue's 2.52B teacher -> 0.40B student, 8 x 2048
                                                              tokens, bf16
    python benchmarks/p7_distill_throughput.py --preset smoke --targets online,hidden,sampled:8   # plumbing, seconds
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import cpu_model, machine_line  # noqa: E402

#: model shape, batch and timing of each preset (the teacher is Qwen3-MoE; student width = top_k x expert width)
PRESETS = {
    "cpu": dict(
        device="cpu",
        hidden=256,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=64,
        experts=16,
        expert_width=128,
        top_k=4,
        vocab=4096,
        seq_len=256,
        batch=4,
        warmup=2,
        steps=12,
    ),
    "h100": dict(
        device="cuda",
        hidden=2048,
        layers=8,
        heads=16,
        kv_heads=4,
        head_dim=128,
        experts=64,
        expert_width=768,
        top_k=8,
        vocab=4096,
        seq_len=2048,
        batch=8,
        warmup=3,
        steps=10,
    ),
    "smoke": dict(
        device="cpu",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        experts=8,
        expert_width=32,
        top_k=2,
        vocab=512,
        seq_len=64,
        batch=2,
        warmup=1,
        steps=2,
    ),
}


def build_models(p: dict, dtype: torch.dtype):
    """(teacher Teacher, initial student) on the preset's device, the way stage 2 loads them."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from m2d_ray.arch import get_adapter
    from m2d_ray.convert.baselines import RANDOM_BASELINES
    from m2d_ray.models import Teacher

    config = Qwen3MoeConfig(
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        head_dim=p["head_dim"],
        num_experts=p["experts"],
        moe_intermediate_size=p["expert_width"],
        num_experts_per_tok=p["top_k"],
        intermediate_size=p["top_k"] * p["expert_width"],
        max_position_embeddings=p["seq_len"],
        tie_word_embeddings=False,
        norm_topk_prob=True,
    )
    kwargs = {"experts_implementation": "eager"} if p["device"] == "cpu" else {}  # as models.load_model on CPU
    torch.manual_seed(0)
    with torch.device(p["device"]):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs).eval()
    for w in model.parameters():
        w.requires_grad_(False)
    teacher = Teacher(name="random", model=model, tokenizer=None, adapter=get_adapter(config))
    student = RANDOM_BASELINES["random-ffn"](teacher, seed=0)
    if p["device"] == "cuda":
        from m2d_ray.distill.gpu import attention_implementation

        student.set_attn_implementation(attention_implementation())
    student.config.use_cache = False
    return teacher, student


def init_process_group(device: str) -> None:
    """A world of one for DeepSpeed (outside Ray Train it would look for MPI)."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


def platform_path(student, teacher, cfg, device: str, dtype: torch.dtype, spec=None, head=None):
    """DistillStep: online (`teacher`), or from cached targets of `spec` (hidden: with the teacher's `head`)."""
    from m2d_ray.distill.step import DistillStep

    trainer = DistillStep(
        student, teacher if spec is None else None, cfg, device, world=1, dtype=dtype, targets=spec, head=head
    )
    return (lambda batch: trainer.step([_to(batch, device)])), trainer.take_loss


def _to(batch, device: str):
    return (
        {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        if isinstance(batch, dict)
        else batch.to(device, non_blocking=True)
    )


def reference_path(student, teacher, cfg, device: str, dtype: torch.dtype, spec=None, head=None):
    """A hand-written loop: the whole logits, the mode's loss on them (F.kl_div / a gather), fused AdamW."""
    decay = [w for w in student.parameters() if w.ndim >= 2]
    rest = [w for w in student.parameters() if w.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        fused=True,
    )
    from m2d_ray.distill.step import lr_factor

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    losses: list[torch.Tensor] = []

    def loss_of(batch) -> torch.Tensor:
        ids = batch["tokens"] if isinstance(batch, dict) else batch
        s = student(input_ids=ids, use_cache=False).logits
        V = s.shape[-1]
        ls = F.log_softmax(s.float().view(-1, V), -1)
        if spec is not None and spec.mode == "sampled":
            w = batch["counts"].float().view(ls.shape[0], -1)
            w = w / w.sum(-1, keepdim=True).clamp_min(1.0)
            return (
                (w * (batch["logp"].float().view_as(w) - ls.gather(1, batch["ids"].view_as(w).long()))).sum(-1).mean()
            )
        with torch.no_grad():
            t = (batch["hidden"] @ head.T) if spec is not None else teacher(input_ids=ids, use_cache=False).logits
        return F.kl_div(ls, F.log_softmax(t.float().view(-1, V), -1), log_target=True, reduction="batchmean")

    def step(batch):
        loss = loss_of(_to(batch, device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
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


def run_mode(text: str, p: dict, teacher, student0, ids: list, cfg, names: list[str], dtype: torch.dtype) -> dict:
    """One targets mode: every path from the same initial student on the same batches, in turns; its figures."""
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.targets import parse_targets

    device = p["device"]
    spec = parse_targets(text)
    if spec is not None and spec.mode not in ("hidden", "sampled"):
        raise SystemExit(
            f"--targets {text}: P7 compares online, hidden and sampled:N (its plain loop has no top-K loss)"
        )
    head = teacher.model.get_output_embeddings().weight.detach()
    batches = mode_batches(ids, teacher.model, spec, pin=device == "cuda")
    builders = {
        "platform": lambda s: platform_path(s, teacher.model, cfg, device, dtype, spec, head),
        "platform_deepspeed": lambda s: platform_path(
            s, teacher.model, DistillConfig(**{**cfg.__dict__, "deepspeed": True}), device, dtype, spec, head
        ),
        "reference": lambda s: reference_path(s, teacher.model, cfg, device, dtype, spec, head),
    }
    paths = {n: builders[n](copy.deepcopy(student0).to(device).train()) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i, batch in enumerate(batches):
        for n in names[i % len(names) :] + names[: i % len(names)]:  # each path goes first in turn
            step, take_loss = paths[n]
            sync()
            t = time.perf_counter()
            step(batch)
            sync()
            if i >= p["warmup"]:
                times[n].append(time.perf_counter() - t)
            losses[n].append(take_loss())
    del paths, batches
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    tokens = p["batch"] * p["seq_len"]
    tps = {n: tokens / statistics.median(ts) for n, ts in times.items()}
    first = [losses[n][0] for n in names]
    platform = max((tps[n] for n in ("platform", "platform_deepspeed") if n in tps), default=None)
    return {
        "mode": text,
        "platform_tokens_per_s": tps.get("platform"),
        "platform_deepspeed_tokens_per_s": tps.get("platform_deepspeed"),
        "reference_tokens_per_s": tps.get("reference"),
        "ratio": platform / tps["reference"] if platform and "reference" in tps else None,
        "flops_per_token": mode_flops(teacher, student0, spec, p["seq_len"]),
        "step_s": {n: [round(t, 4) for t in ts] for n, ts in times.items()},
        "loss_first": dict(zip(names, first)),
        "loss_last": {n: losses[n][-1] for n in names},
        "losses_agree": max(first) - min(first)
        <= (2e-2 if dtype == torch.bfloat16 else 1e-4) * max(abs(x) for x in first),
    }


def add_mfu(m: dict, rate: float) -> dict:
    """The mode's MFU (its best platform path) and the plain loop's, against the matmul rate `rate`."""
    platform = max(filter(None, (m["platform_tokens_per_s"], m["platform_deepspeed_tokens_per_s"])), default=None)
    m["mfu"] = platform * m["flops_per_token"] / rate if platform else None
    m["reference_mfu"] = (
        m["reference_tokens_per_s"] * m["flops_per_token"] / rate if m["reference_tokens_per_s"] else None
    )
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--targets", default="online", help="comma-separated: online, hidden, sampled:N (default: online)")
    ap.add_argument("--steps", type=int, help="timed steps per path (default: the preset's)")
    ap.add_argument("--warmup", type=int, help="untimed steps per path first (default: the preset's)")
    ap.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    ap.add_argument("--paths", default="platform,platform_deepspeed,reference")
    a = ap.parse_args()
    p = dict(PRESETS[a.preset])
    p["steps"], p["warmup"] = a.steps or p["steps"], a.warmup if a.warmup is not None else p["warmup"]
    if a.threads:
        torch.set_num_threads(a.threads)
    device = p["device"]
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--preset {a.preset} needs a CUDA device")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # what stage 2 trains in
    print(machine_line(), file=sys.stderr)

    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.flops import matmul_rate

    t0 = time.perf_counter()
    teacher, student0 = build_models(p, dtype)
    rate = matmul_rate(device, dtype)
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
        f"built in {time.perf_counter() - t0:.1f} s; {len(names)} paths x {p['warmup']} warm-up + {p['steps']} timed "
        "steps",
        file=sys.stderr,
    )
    modes = {}
    for text in [t.strip() for t in a.targets.split(",") if t.strip()]:
        modes[text] = add_mfu(run_mode(text, p, teacher, student0, ids, cfg, names, dtype), rate)
        print(
            json.dumps(modes[text]), flush=True
        )  # MFU against the rate before the steps (a caller killed later keeps it)
    rate = max(rate, matmul_rate(device, dtype))  # before and after the steps: the best this run saw
    for m in modes.values():
        add_mfu(m, rate)
    out = {
        "preset": a.preset,
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else f"{cpu_model()} ({torch.get_num_threads()} threads)",
        "dtype": str(dtype).removeprefix("torch."),
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
    bad = {t: m["loss_first"] for t, m in modes.items() if not m["losses_agree"]}
    if bad:
        raise SystemExit(f"first-step losses differ: {bad}")


if __name__ == "__main__":
    main()
