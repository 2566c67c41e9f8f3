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

    # the distillation text: any data spec (data/source.py): hf:, Parquet / JSON Lines / text shards, local or s3://
    train_data: str = "fineweb-edu"
    # the validation text; None = the run's eval.data
    eval_data: str | None = None
    # validation tokens (the first ones of eval_data); None = all of it
    eval_max_tokens: int | None = 65536
    # the loss (registries): fkl (forward KL) | rkl (reverse KL) | fkl+mse (+ every layer's hidden-state MSE)
    loss: str = "fkl"
    # the KL's temperature t (the loss is t^2 KL at logits / t)
    temperature: float = 1.0
    # fkl+mse: the weight of the hidden-state MSE
    mse_weight: float = 1.0
    # the teacher's expanded routing k' >= k; None = the teacher's own k
    teacher_topk: int | None = None
    # optimizer steps (the budget: steps x batch_size x grad_accum x workers sequences of seq_len tokens)
    steps: int = 200
    # the peak learning rate (AdamW)
    lr: float = 1e-4
    # the learning rate at the end of the cosine decay
    min_lr: float = 1e-5
    # steps of linear warm-up
    warmup_steps: int = 20
    # AdamW's weight decay (matrices decayed, norms and biases not)
    weight_decay: float = 0.01
    # AdamW's (beta1, beta2)
    betas: tuple[float, ...] = (0.9, 0.95)
    # the gradient's norm is clipped to this
    grad_clip: float = 1.0
    # sequences per worker per micro-batch
    batch_size: int = 4
    # micro-batches per optimizer step (gradient accumulation)
    grad_accum: int = 1
    # tokens per packed training sequence
    seq_len: int = 4096
    # steps between validations (each one is a report, a checkpoint and an ASHA rung step)
    eval_every: int = 50
    # validation sequences per forward
    eval_batch_size: int = 4
    # tokens per vocabulary chunk of the KL (a [tokens x vocabulary] float32 tensor never exists)
    loss_chunk: int = 1024
    # DeepSpeed ZeRO (in `dtype`; gloo on CPU); false = plain torch (DDP with several workers)
    deepspeed: bool = True
    # what the teacher, its cached hidden states, its head and the student run in: auto = bfloat16 on a GPU, float32 on
    # CPU; bfloat16 on CPU rehearses a GPU's dtypes where there is none (the tests do), at CPU bf16 speed
    dtype: str = "auto"
    # DeepSpeed's ZeRO stage: 2 shards the optimizer state and gradients over the workers (0, 1 or 2)
    zero_stage: int = 2
    # Ray Train workers per student
    workers: int = 1
    # GPUs per worker (0: CPU)
    gpus_per_worker: float = 0.0
    # pin the workers to a GPU type (Ray's accelerator_type, e.g. H100)
    accelerator: str | None = None
    # CPUs per worker
    cpus_per_worker: float = 1.0
    # torch threads per worker on CPU
    threads_per_worker: int = 1
    # recompute each layer's activations in the backward (less memory, a fourth forward of time)
    gradient_checkpointing: bool = False
    # Train checkpoints a student keeps (the latest ones)
    keep_checkpoints: int = 2
    # the seed of the training's randomness, the baselines' initial weights and the sampled targets' draws
    seed: int = 0
    # passes over train_data the budget may take (1: a corpus shorter than the budget is refused)
    epochs: int = 1

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
