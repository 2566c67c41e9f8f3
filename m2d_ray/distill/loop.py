"""The per-worker distillation loop: plain torch (+ DeepSpeed when asked), no Ray.

One call trains one student against its frozen teacher, both in this process:
    load teacher (optionally with expanded top-k' routing) and student -> AdamW + warm-up/cosine
    -> [DeepSpeed ZeRO-2 engine] -> steps of packed blocks (gradient accumulation)
    -> every `eval_every` steps: validation CE / perplexity, a checkpoint, a report
    -> after the last step: the student exported natively (rank 0) and reported as `student_path`.
The host (Ray Train in trainer.py, or a test) supplies rank/world, where reports go and which
checkpoint to resume from; a resumed run continues at the checkpoint's step with the same data.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from m2d_ray.config import DistillConfig
from m2d_ray.distill.data import train_batches
from m2d_ray.distill.losses import LOSSES, chunked_kl, hidden_mse
from m2d_ray.evaluate.perplexity import window_nll, windows

STATE_FILE = "m2d_state.pt"  # plain-torch checkpoint (DeepSpeed writes its own layout next to it)
DS_TAG = "state"
EXTRAS = ("val_ppl_initial", "curve")  # saved with every checkpoint besides the training state


@dataclass(frozen=True)
class DistillJob:
    """What to distil: teacher and initial student directories, hyper-parameters, where the student goes."""

    teacher: str
    student: str
    cfg: DistillConfig
    eval_data: str
    out: str | None = None  # exported student directory (written by rank 0 after the last step)
    device: str = "cpu"
    stop_file: str | None = None  # early stop requested from outside (ASHA): the run ends cleanly at the next step


@dataclass
class WorkerIO:
    """The host's side: rank, world, a report sink and the checkpoint to resume from (None = fresh)."""

    rank: int = 0
    world: int = 1
    report: Callable[[dict, Path | None], None] = lambda metrics, ckpt: None
    restore: Path | None = None


def lr_factor(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up to lr, then cosine down to min_lr at the last step (a multiplier of lr)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    low = cfg.min_lr / cfg.lr
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))


def ds_config(cfg: DistillConfig, dtype: torch.dtype) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage, "overlap_comm": False, "contiguous_gradients": True},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only (norm gains and biases are not shrunk towards zero)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def distill_loss(student, teacher, ids: Tensor, mask: Tensor, cfg: DistillConfig) -> Tensor:
    """The configured loss on one batch: chunked KL on logits (+ hidden-state MSE over all layers)."""
    kind, with_mse = LOSSES[cfg.loss]
    with torch.no_grad():
        t_out = teacher.base_model(input_ids=ids, attention_mask=mask, output_hidden_states=with_mse, use_cache=False)
    s_out = student.base_model(input_ids=ids, attention_mask=mask, output_hidden_states=with_mse, use_cache=False)
    valid = mask.bool()
    loss = chunked_kl(
        s_out.last_hidden_state[valid], student.get_output_embeddings().weight,
        t_out.last_hidden_state[valid], teacher.get_output_embeddings().weight,
        kind=kind, temperature=cfg.temperature, chunk=cfg.loss_chunk,
    )
    if with_mse:
        loss = loss + cfg.mse_weight * hidden_mse(s_out.hidden_states, t_out.hidden_states, mask)
    return loss


def validate(model, windows: Tensor, masks: Tensor, io: WorkerIO, cfg: DistillConfig, device: str) -> dict:
    """Cross-entropy and perplexity on the validation windows (this rank's share, summed over ranks)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    mine = list(range(io.rank, windows.shape[0], io.world))
    for s in range(0, len(mine), cfg.eval_batch_size):
        sel = mine[s : s + cfg.eval_batch_size]
        t, c = window_nll(model, windows[sel], masks[sel], cfg.loss_chunk)
        total, count = total + t, count + c
    if io.world > 1 and dist.is_initialized():
        buf = torch.tensor([total, float(count)], dtype=torch.float64)
        dist.all_reduce(buf)
        total, count = float(buf[0]), int(buf[1])
    model.train(was_training)
    loss = total / max(count, 1)
    ppl = math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf
    return {"val_loss": loss if math.isfinite(loss) else math.inf, "val_ppl": ppl, "val_tokens": count}


def validation_windows(tokenizer, spec: str, seq_len: int, max_tokens: int | None) -> tuple[Tensor, Tensor]:
    from m2d_ray.data.text import load_text, tokenize

    return windows(tokenize(tokenizer, load_text(spec), max_tokens=max_tokens), seq_len)


def _load_models(job: DistillJob, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from m2d_ray.models import load_teacher

    teacher = load_teacher(job.teacher, dtype=dtype, device=job.device)
    if job.cfg.teacher_topk is not None:
        teacher.adapter.set_top_k(teacher.model, job.cfg.teacher_topk)
    for p in teacher.model.parameters():
        p.requires_grad_(False)
    kwargs = {"dtype": dtype}
    if job.device == "cuda":
        from m2d_ray.distill.gpu import attention_implementation

        kwargs["attn_implementation"] = attention_implementation()
    student = AutoModelForCausalLM.from_pretrained(job.student, **kwargs).to(job.device)
    if job.cfg.gradient_checkpointing:
        student.gradient_checkpointing_enable()
    student.config.use_cache = False
    return teacher, student.train()


def _allreduce_grads(model: torch.nn.Module, world: int) -> None:
    """Plain-torch data parallelism (no DeepSpeed): average gradients over ranks."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def _mean_over_ranks(x: float, io: WorkerIO) -> float:
    if io.world > 1 and dist.is_initialized():
        buf = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(buf)
        return float(buf[0]) / io.world
    return x


def stop_requested(job: DistillJob, io: WorkerIO) -> bool:
    """Rank 0 looks for the stop file and every rank gets its answer (ranks must stop at the same step)."""
    if job.stop_file is None:
        return False
    flag = torch.tensor([float(io.rank == 0 and os.path.exists(job.stop_file))])
    if io.world > 1 and dist.is_initialized():
        dist.all_reduce(flag)
    return bool(flag.item())


def run_distill(job: DistillJob, io: WorkerIO) -> dict:
    """Train `job.student` for cfg.steps (from the restored step on); returns the last report's metrics."""
    cfg = job.cfg
    torch.manual_seed(cfg.seed)
    dtype = torch.bfloat16 if job.device == "cuda" else torch.float32
    teacher, student = _load_models(job, dtype)
    tokenizer = teacher.tokenizer
    opt = torch.optim.AdamW(_param_groups(student, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    engine = None
    if cfg.deepspeed:
        import deepspeed

        engine, opt, _, sched = deepspeed.initialize(model=student, optimizer=opt, lr_scheduler=sched, config=ds_config(cfg, dtype))
    step, extra = _restore(io.restore, engine, student, opt, sched)
    win, wmask = validation_windows(tokenizer, job.eval_data, cfg.seq_len, cfg.eval_max_tokens)
    initial = extra.get("val_ppl_initial")
    if initial is None:
        initial = validate(student, win, wmask, io, cfg, job.device)["val_ppl"]
    curve = list(extra.get("curve") or [[0, initial]])  # (step, val ppl) since step 0, carried across resumes
    per_step = cfg.batch_size * cfg.grad_accum * io.world
    batches = train_batches(tokenizer, cfg.train_data, cfg.seq_len, cfg.batch_size, io.rank, io.world, start_block=step * per_step)
    ones = torch.ones(cfg.batch_size, cfg.seq_len, dtype=torch.int64, device=job.device)
    losses: list[float] = []
    t0, tokens0, last = time.perf_counter(), step * per_step * cfg.seq_len, {}
    resumed_from = step
    while step < cfg.steps:
        for _ in range(cfg.grad_accum):
            ids = next(batches).to(job.device)
            loss = distill_loss(student, teacher.model, ids, ones, cfg)
            losses.append(float(loss.detach()))
            if engine is not None:
                engine.backward(loss)
                engine.step()  # DeepSpeed applies the optimizer only at accumulation boundaries
            else:
                (loss / cfg.grad_accum).backward()
        if engine is None:
            if io.world > 1:
                _allreduce_grads(student, io.world)
            torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        step += 1
        if stop_requested(job, io):
            break
        if step % cfg.eval_every and step < cfg.steps:
            continue
        elapsed = time.perf_counter() - t0
        tokens = step * per_step * cfg.seq_len
        last = {
            "step": step, "tokens": tokens, "train_loss": _mean_over_ranks(sum(losses) / len(losses), io),
            **validate(student, win, wmask, io, cfg, job.device), "val_ppl_initial": initial,
            "lr": sched.get_last_lr()[0], "tokens_per_s": (tokens - tokens0) / max(elapsed, 1e-9),
            "resumed_from": resumed_from, "final": step >= cfg.steps,
        }
        curve.append([step, last["val_ppl"]])
        last["curve"] = list(curve)
        losses = []
        if last["final"] and job.out and io.rank == 0:
            _export(student, tokenizer, job)
            last["student_path"] = str(job.out)
        if last["final"] and io.world > 1 and dist.is_initialized():
            dist.barrier()  # the student is on disk before any rank reports completion
        with tempfile.TemporaryDirectory(prefix="m2d-ckpt-") as tmp:
            _save(Path(tmp), engine, student, opt, sched, step, {"val_ppl_initial": initial, "curve": curve}, io.rank)
            io.report(last, Path(tmp))
    return last


def _export(student, tokenizer, job: DistillJob) -> None:
    from m2d_ray.convert.export import export_student

    module = getattr(student, "module", student)
    export_student(module, tokenizer, job.out, overwrite=True)  # a resumed last step exports again


def _save(path: Path, engine, student, opt, sched, step: int, extra: dict, rank: int) -> None:
    state = {"step": step, **extra}
    if engine is not None:  # every rank writes its ZeRO partition; rank 0 the weights
        engine.save_checkpoint(str(path), tag=DS_TAG, client_state=state)
    elif rank == 0:
        torch.save({**state, "model": student.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, path / STATE_FILE)


def _restore(path: Path | None, engine, student, opt, sched) -> tuple[int, dict]:
    """(step to continue from, saved extras); (0, {}) when there is nothing to restore."""
    if path is None:
        return 0, {}
    if engine is not None and (path / DS_TAG).is_dir():
        _, client = engine.load_checkpoint(str(path), tag=DS_TAG)
        return int(client["step"]), {k: client.get(k) for k in EXTRAS}
    if (path / STATE_FILE).exists():
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        return int(state["step"]), {k: state.get(k) for k in EXTRAS}
    raise RuntimeError(f"checkpoint {path} holds neither a DeepSpeed ({DS_TAG}/) nor a plain ({STATE_FILE}) state")
