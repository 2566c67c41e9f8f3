"""Stage 2's training settings of one student, next to the code they configure (config.py nests them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m2d_ray.distill.losses import LOSSES
from m2d_ray.errors import M2DError

STOP_POLL_STEPS = 10  # a stop request (ASHA's) is looked at every this many steps (or every eval_every, if fewer)
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}  # distill.dtype besides auto (float16 would need loss scaling)


@dataclass(frozen=True)
class DistillConfig:
    """Stage 2 training of one student (the paper's values are the defaults; tiny configs shrink them)."""

    train_data: str = (
        "fineweb-edu"  # any data spec (data/source.py): hf:, Parquet / JSON Lines / text shards, local or s3://
    )
    eval_data: str | None = None  # validation text; None = the sweep's eval.data
    eval_max_tokens: int | None = 65536
    loss: str = "fkl"  # fkl | rkl | fkl+mse
    temperature: float = 1.0
    mse_weight: float = 1.0  # fkl+mse: weight of the hidden-state MSE
    teacher_topk: int | None = None  # expanded teacher routing k' >= k (None = the teacher's own k)
    steps: int = 200
    lr: float = 1e-4
    min_lr: float = 1e-5
    warmup_steps: int = 20
    weight_decay: float = 0.01
    betas: tuple[float, ...] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_size: int = 4  # sequences per worker per micro-batch
    grad_accum: int = 1
    seq_len: int = 4096
    eval_every: int = 50  # steps between validations (each one is a report, a checkpoint and an ASHA rung step)
    eval_batch_size: int = 4
    loss_chunk: int = 1024  # tokens per vocabulary chunk of the KL
    deepspeed: bool = True  # ZeRO-2 (in `dtype`; gloo on CPU); false = plain torch
    # what the teacher, its cached hidden states, its head and the student run in: auto = bfloat16 on a GPU, float32 on
    # CPU; bfloat16 on CPU rehearses a GPU's dtypes where there is none (the tests do), at CPU bf16 speed
    dtype: str = "auto"
    zero_stage: int = 2
    workers: int = 1  # Ray Train workers per student
    gpus_per_worker: float = 0.0
    accelerator: str | None = None  # pin the workers to a GPU type (Ray's accelerator_type, e.g. H100)
    cpus_per_worker: float = 1.0
    threads_per_worker: int = 1
    gradient_checkpointing: bool = False
    keep_checkpoints: int = 2
    seed: int = 0
    epochs: int = 1  # passes over train_data the budget may take (1: a corpus shorter than the budget is refused)

    @property
    def blocks(self) -> int:
        """Global [seq_len] blocks the run reads: steps x batch x accumulation x workers."""
        return self.steps * self.batch_size * self.grad_accum * self.workers

    @property
    def stop_poll(self) -> int:
        """Steps between looks at a stop request: a student ASHA stops trains up to this many past its report."""
        return min(self.eval_every, STOP_POLL_STEPS)


def train_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """distill.dtype on `device`: auto = bfloat16 on a GPU, float32 on CPU. One choice for a rank's models and
    for the teacher of the targets pass, so cached hidden states are in the dtype the online teacher runs in."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[name]


def check_distill(d: DistillConfig) -> None:
    """One-line errors for a distillation config that cannot run."""
    if d.loss not in LOSSES:
        raise M2DError(f"distill.loss: {LOSSES.unknown_message(d.loss)}")
    positive = {
        k: getattr(d, k)
        for k in (
            "steps",
            "batch_size",
            "grad_accum",
            "seq_len",
            "eval_every",
            "eval_batch_size",
            "loss_chunk",
            "workers",
            "threads_per_worker",
            "epochs",
        )
    }
    bad = [f"distill.{k}={v}" for k, v in positive.items() if v < 1]
    if bad:
        raise M2DError(f"{', '.join(bad)}: must be >= 1")
    if not (d.lr > 0 and 0 <= d.min_lr <= d.lr and d.temperature > 0 and len(d.betas) == 2):
        raise M2DError("distill: need lr > 0, 0 <= min_lr <= lr, temperature > 0 and betas = [beta1, beta2]")
    if d.dtype not in ("auto", *DTYPES):
        raise M2DError(
            f"distill.dtype={d.dtype!r}: use auto (bfloat16 on a GPU, float32 on CPU), {' or '.join(DTYPES)}"
        )
    if d.zero_stage not in (0, 1, 2):
        raise M2DError(
            f"distill.zero_stage={d.zero_stage}: use 2 (ZeRO-2), 1 or 0; ZeRO-3 would shard the weights the loss reads"
        )
