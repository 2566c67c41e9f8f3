"""The per-worker distillation loop: plain torch (+ DeepSpeed when asked), no Ray.

One call trains one student against its frozen teacher, both in this process:
    load teacher (optionally with expanded top-k' routing) and student -> `step.DistillStep` (AdamW +
    warm-up/cosine, DeepSpeed ZeRO or DDP) -> steps of packed blocks (gradient accumulation)
    -> every `eval_every` steps: validation CE / perplexity, a checkpoint, a report
    -> after the last step: the student exported natively (rank 0) and reported as `student_path`.
Reports carry the training throughput since the previous report over training time only (validation,
checkpoints and reports excluded), the seconds those took, and an MFU estimate (`flops.py`).
The host (Ray Train in trainer.py, or a test) supplies rank/world, where reports go and which
checkpoint to resume from; a resumed run continues at the checkpoint's step with the same data.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from m2d_ray import storage
from m2d_ray.arch import auto_class, family_of, get_adapter
from m2d_ray.config import DistillConfig
from m2d_ray.convert.export import export_student
from m2d_ray.data.text import load_text, tokenize
from m2d_ray.distill import checkpointing
from m2d_ray.distill.data import train_batches
from m2d_ray.distill.flops import active_params, flops_per_token, matmul_rate
from m2d_ray.distill.gpu import attention_implementation
from m2d_ray.distill.precision import for_device
from m2d_ray.distill.sharded_teacher import load_sharded
from m2d_ray.distill.step import DistillStep, all_reduce_max, all_reduce_sum
from m2d_ray.distill.targets import TargetsManifest, TargetSpec, fingerprint, loss_metric, read_shard
from m2d_ray.distill.tokens import TokenShards, manifest_sha256, rank_batches
from m2d_ray.evaluate.perplexity import window_nll, windows
from m2d_ray.models import Teacher, load_distill_teacher, load_tokenizer, model_config
from m2d_ray.peaks import peaks, reset_peaks
from m2d_ray.weights import read_output_head

STATE_FILE = "m2d_state.pt"  # plain-torch checkpoint (DeepSpeed writes its own layout next to it)
DS_TAG = "state"
EXTRAS = ("val_ppl_initial", "curve")  # saved with every checkpoint besides the training state


@dataclass(frozen=True)
class DistillJob:
    """Everything one student's distillation needs, as one object (picklable: it travels to the Ray Train workers):
    teacher and initial student (directories, hub names or storage URLs), the hyper-parameters, what it reads
    (token shards, cached targets), where the student and its checkpoints go (paths or storage URLs), how often a
    lost worker group is retried, and two hooks from the host."""

    teacher: str
    student: str
    cfg: DistillConfig
    eval_data: str
    out: str | None = None  # exported student (written by rank 0 after the last step)
    device: str = "cpu"
    stop: Callable[[], bool] | None = None  # early stop requested from outside (ASHA): the run ends cleanly
    build: Callable[[Path], object] | None = (
        None  # writes the initial student into a directory, when `student` is missing
    )
    tokens: str | None = (
        None  # the stream tokenised once (distill/tokens.py; a path or storage URL); None = tokenise here
    )
    targets: str | None = (
        None  # the teacher's cached targets over `tokens` (distill/targets.py): then no teacher weights are loaded
    )
    target_spec: TargetSpec | None = None
    checkpoints: str | None = (
        None  # where Ray Train keeps its checkpoints (checkpoints/run_name); None: the host's default
    )
    run_name: str = (
        "train"  # Ray Train's run name there: fitting the same name again resumes from its latest checkpoint
    )
    max_failures: int = 0  # Ray Train's retries of a lost worker group
    shard_teacher: bool = False  # online: the teacher sharded over the ranks (distill/sharded_teacher.py)


@dataclass
class WorkerIO:
    """The host's side: rank, world, a report sink and the checkpoint to resume from (None = fresh)."""

    rank: int = 0
    world: int = 1
    report: Callable[[dict, Path | None], None] = lambda metrics, ckpt: None
    restore: Path | None = None


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
    total, count = all_reduce_sum([total, count], device, io.world)
    model.train(was_training)
    loss = total / max(count, 1)
    ppl = math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf
    return {"val_loss": loss if math.isfinite(loss) else math.inf, "val_ppl": ppl, "val_tokens": int(count)}


def validation_windows(tokenizer, spec: str, seq_len: int, max_tokens: int | None) -> tuple[Tensor, Tensor]:

    return windows(tokenize(tokenizer, load_text(spec, max_tokens=max_tokens), max_tokens=max_tokens), seq_len)


def data(job: DistillJob, io: WorkerIO, tokenizer, start_block: int) -> tuple[Iterator[Tensor], tuple[Tensor, Tensor]]:
    """(this rank's training batches from `start_block` on, the validation windows): read from the run's
    token shards, or tokenised here when the job has none (the same batches either way)."""
    cfg = job.cfg
    if job.tokens is None:
        return (
            train_batches(tokenizer, cfg.train_data, cfg.seq_len, cfg.batch_size, io.rank, io.world, start_block),
            validation_windows(tokenizer, job.eval_data, cfg.seq_len, cfg.eval_max_tokens),
        )

    shards = TokenShards(storage.fetch_dir(job.tokens))
    shards.check(tokenizer, cfg.seq_len, cfg.train_data)
    pin = torch.device(job.device).type == "cuda"
    valid = windows(shards.valid_ids(), cfg.seq_len)
    if job.targets is None:
        return shards.batches(cfg.batch_size, io.rank, io.world, start_block, pin=pin), valid

    where = storage.fetch_dir(job.targets)
    manifest = TargetsManifest.load(where, where=job.targets)
    manifest.check_matches(
        fingerprint(
            job.target_spec,
            job.teacher,
            shards.manifest["tokenizer"],
            manifest_sha256(shards.manifest),
            cfg.teacher_topk,
            cfg.temperature,
        ),
        job.target_spec,
    )  # what this job says, not what the manifest says
    ids = shards.batches(cfg.batch_size, io.rank, io.world, start_block, pin=pin)
    targets = rank_batches(
        manifest.shards, lambda e: read_shard(where, e), cfg.batch_size, io.rank, io.world, start_block, pin
    )
    return ({"tokens": i, **t} for i, t in zip(ids, targets)), valid


def _teacher_shape(name: str):
    """A teacher with no weights (cached targets): its tokenizer, and a meta-device model and adapter for
    counting FLOPs and active parameters."""

    config = model_config(name)
    with torch.device("meta"):
        model = auto_class(config).from_config(config)
    return Teacher(
        name=name,
        model=model,
        tokenizer=load_tokenizer(name),
        adapter=get_adapter(config) if family_of(config) is not None else None,
    )


def _load_models(job: DistillJob, io: WorkerIO, dtype: torch.dtype):
    """Teacher, its output head and the student on this rank. With cached targets the teacher has no weights
    (`_teacher_shape`); with `hidden` targets its output head alone is read; a sharded teacher holds 1/world of its
    weights and its head whole (distill/sharded_teacher.py); else the head is None (online, DistillStep takes the
    loaded teacher's). Rank 0 first builds the initial student into storage if it is missing."""

    if job.build is not None and io.rank == 0 and not storage.exists(job.student):
        storage.save_dir(job.student, job.build)
    if io.world > 1 and dist.is_initialized():
        dist.barrier()  # every rank reads the student rank 0 made

    head = None
    if job.targets:
        teacher = _teacher_shape(job.teacher)
    elif sharded(job, io):
        teacher, head = load_sharded(job.teacher, dtype, job.device)
    else:
        teacher = load_distill_teacher(job.teacher, dtype=dtype, device=job.device)
    if (
        job.cfg.teacher_topk is not None and teacher.adapter is not None
    ):  # (an MoE teacher: the D2D baseline's dense one runs with teacher_topk None)
        teacher.adapter.set_top_k(teacher.model, job.cfg.teacher_topk)
    for p in teacher.model.parameters():
        p.requires_grad_(False)
    if job.targets and job.target_spec.exact:
        head = read_output_head(job.teacher, dtype).to(job.device)
    kwargs = {"dtype": dtype}
    if job.device == "cuda":
        kwargs["attn_implementation"] = attention_implementation()
    path = storage.local_model(job.student)
    student = auto_class(model_config(path)).from_pretrained(path, **kwargs).to(job.device)
    checkpointing.apply(student, job.cfg.checkpointing, job.device)
    student.config.use_cache = False
    return teacher, head, student.train()


def sharded(job: DistillJob, io: WorkerIO) -> bool:
    """Whether this rank's teacher is sharded: asked for, online, over more than one rank."""
    return job.shard_teacher and job.targets is None and io.world > 1


def stop_requested(job: DistillJob, io: WorkerIO) -> bool:
    """Rank 0 asks the host whether to stop and every rank gets its answer (ranks must stop at the same step)."""
    if job.stop is None:
        return False
    return all_reduce_sum([float(io.rank == 0 and job.stop())], job.device, io.world)[0] > 0


def run_distill(job: DistillJob, io: WorkerIO) -> dict:
    """Train `job.student` for cfg.steps (from the restored step on); returns the last report's metrics."""
    cfg = job.cfg
    torch.manual_seed(cfg.seed)
    reset_peaks()  # the student's peak, above what the worker held before it
    precision = for_device(cfg.precision, job.device)
    teacher, head, student = _load_models(job, io, precision.dtype)
    tokenizer = teacher.tokenizer
    counted = _teacher_shape(job.teacher) if sharded(job, io) else teacher  # FLOPs from shapes, not from shards
    flops = flops_per_token(
        counted.model, counted.adapter, student, cfg.seq_len, cfg.teacher_topk, teacher_forward=job.targets is None
    )
    sizes = {
        "student_params": sum(p.numel() for p in student.parameters()),  # for the matched-parameter table
        "teacher_active_params": active_params(counted.model, counted.adapter, cfg.teacher_topk),
    }
    peak = matmul_rate(job.device, precision.dtype)
    trainer = DistillStep(
        student, None if job.targets else teacher.model, cfg, job.device, io.world, precision, job.target_spec, head
    )
    step, extra = _restore(io.restore, trainer)

    def check(*args) -> dict:  # validation reads the student's head as a tensor: gathered whole under ZeRO-3
        with trainer.whole_head():
            return validate(*args)

    per_step = cfg.batch_size * cfg.grad_accum * io.world
    batches, (win, wmask) = data(job, io, tokenizer, start_block=step * per_step)
    initial = extra.get("val_ppl_initial")
    if initial is None:
        initial = check(student, win, wmask, io, cfg, job.device)["val_ppl"]
    curve = list(extra.get("curve") or [[0, initial]])  # (step, val ppl) since step 0, carried across resumes
    poll = cfg.stop_poll
    last, resumed_from, since = {}, step, step
    if step >= cfg.steps:  # the final checkpoint was saved but its report never reached the host (it was killed)
        last = {
            "step": step,
            "tokens": step * per_step * cfg.seq_len,
            **check(student, win, wmask, io, cfg, job.device),
            "val_ppl_initial": initial,
            "lr": trainer.lr,
            "resumed_from": step,
            "final": True,
            "curve": curve,
            **sizes,
            **peak_memory(job.device, io.world),
        }
        _finish(trainer, tokenizer, job, io, last)
        io.report(last, None)
        return last
    t0 = time.perf_counter()
    while step < cfg.steps:
        trainer.step([_to(next(batches), job.device) for _ in range(cfg.grad_accum)])
        step += 1
        if step % poll == 0 and stop_requested(job, io):
            break
        if step % cfg.eval_every and step < cfg.steps:
            continue
        train_s = _elapsed(t0, job.device)  # training only: no validation, checkpoint or report in it
        t0 = time.perf_counter()
        last = {
            "step": step,
            "tokens": step * per_step * cfg.seq_len,
            loss_metric(job.target_spec): trainer.take_loss(),
            **check(student, win, wmask, io, cfg, job.device),
            "val_ppl_initial": initial,
        }
        eval_s = _elapsed(t0, job.device)
        tokens_per_s = (step - since) * per_step * cfg.seq_len / max(train_s, 1e-9)
        curve.append([step, last["val_ppl"]])
        last.update(
            {
                "lr": trainer.lr,
                "tokens_per_s": tokens_per_s,
                "mfu": flops * tokens_per_s / (peak * io.world),
                "train_s": train_s,
                "eval_s": eval_s,
                "resumed_from": resumed_from,
                "final": step >= cfg.steps,
                "curve": list(curve),
                **sizes,
                **peak_memory(job.device, io.world),
            }
        )
        t0 = time.perf_counter()
        if last["final"]:
            _finish(trainer, tokenizer, job, io, last)
        with tempfile.TemporaryDirectory(prefix="m2d-ckpt-") as tmp:
            _save(Path(tmp), trainer, step, {"val_ppl_initial": initial, "curve": curve}, io.rank)
            last["ckpt_s"] = time.perf_counter() - t0  # the checkpoint (and the exported student at the end)
            io.report(last, Path(tmp))
        t0, since = time.perf_counter(), step
    return last


def _finish(trainer: DistillStep, tokenizer, job: DistillJob, io: WorkerIO, last: dict) -> None:
    """After the last step: rank 0 exports the student (under ZeRO-3 the consolidated one, gathered with every rank);
    no rank reports completion before it is stored."""
    whole = trainer.consolidated(io.rank) if job.out else None
    if job.out and io.rank == 0:
        _export(trainer.student if whole is None else _rebuilt(job, whole), tokenizer, job)
        last["student_path"] = str(job.out)
    if io.world > 1 and dist.is_initialized():
        dist.barrier()


def _to(batch: Tensor | dict[str, Tensor], device: str) -> Tensor | dict[str, Tensor]:
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch.to(device, non_blocking=True)


def peak_memory(device: str, world: int) -> dict:
    """This process's peaks since the training started (m2d_ray/peaks.py: resident, resident above the start,
    CUDA allocations), each the max over ranks (what the memory plan is checked against; one small collective)."""
    p = peaks()
    cuda = p.get("peak_cuda_bytes", 0) if torch.device(device).type == "cuda" else 0
    rss, work, cuda = all_reduce_max([p["peak_rss_bytes"], p.get("peak_work_bytes", 0), cuda], device, world)
    return {
        "peak_rss_bytes": int(rss),
        **({"peak_work_bytes": int(work)} if work else {}),
        **({"peak_cuda_bytes": int(cuda)} if cuda else {}),
    }


def _elapsed(t0: float, device: str) -> float:
    """Seconds since t0 once the device's queued work is done (a CUDA step returns before it has run)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _export(student, tokenizer, job: DistillJob) -> None:
    """The distilled student, natively, at job.out (a path or a storage URL); a resumed last step exports again."""

    module = getattr(student, "module", student)
    storage.save_dir(job.out, lambda path: export_student(module, tokenizer, path, overwrite=True))


def _rebuilt(job: DistillJob, state: dict[str, Tensor]):
    """The student whole on the host from ZeRO-3's consolidated parameters: the initial student's module (its
    config, dtype and buffers) with every parameter replaced by its trained value, by name (a tied one once)."""
    path = storage.local_model(job.student)
    dtype = next(iter(state.values())).dtype
    model = auto_class(model_config(path)).from_pretrained(path, dtype=dtype)
    named = dict(model.named_parameters())
    if set(named) != set(state):
        raise RuntimeError(f"the consolidated student's parameters differ from its module's: {set(named) ^ set(state)}")
    with torch.no_grad():
        for name, value in state.items():
            named[name].copy_(value)
    return model


def _save(path: Path, trainer: DistillStep, step: int, extra: dict, rank: int) -> None:
    state = {"step": step, **extra}
    if trainer.engine is not None:  # every rank writes its ZeRO partition; rank 0 the weights
        trainer.engine.save_checkpoint(str(path), tag=DS_TAG, client_state=state)
    elif rank == 0:
        torch.save(
            {
                **state,
                "model": trainer.student.state_dict(),
                "optimizer": trainer.opt.state_dict(),
                "scheduler": trainer.sched.state_dict(),
                **({"masters": trainer.masters.state_dict()} if trainer.masters is not None else {}),
            },
            path / STATE_FILE,
        )


def _restore(path: Path | None, trainer: DistillStep) -> tuple[int, dict]:
    """(step to continue from, saved extras); (0, {}) when there is nothing to restore."""
    if path is None:
        return 0, {}
    if trainer.engine is not None and (path / DS_TAG).is_dir():
        _, client = trainer.engine.load_checkpoint(str(path), tag=DS_TAG)
        return int(client["step"]), {k: client.get(k) for k in EXTRAS}
    if (path / STATE_FILE).exists():
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        trainer.student.load_state_dict(state["model"])
        trainer.opt.load_state_dict(state["optimizer"])
        trainer.sched.load_state_dict(state["scheduler"])
        if trainer.masters is not None:  # after the model: the masters' rounding overwrites its weights
            trainer.masters.load_state_dict(state.get("masters"))
        return int(state["step"]), {k: state.get(k) for k in EXTRAS}
    raise RuntimeError(f"checkpoint {path} holds neither a DeepSpeed ({DS_TAG}/) nor a plain ({STATE_FILE}) state")
