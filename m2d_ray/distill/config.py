"""Stage 2's training settings of one student, next to the code they configure (config.py nests them)."""

from __future__ import annotations

from dataclasses import dataclass

from m2d_ray.catalog.distill import AUTO, CUDA_ONLY_KERNELS, KL_KERNELS, LOSSES, PRECISIONS
from m2d_ray.errors import M2DError

STOP_POLL_STEPS = 10  # a stop request (ASHA's) is looked at every this many steps (or every eval_every, if fewer)


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
    # DeepSpeed ZeRO (gloo on CPU); false = plain torch (DDP with several workers); auto = DeepSpeed where a student
    # has more than one worker (at one rank ZeRO shards nothing and its step is slower: docs/how-to/gpu.md)
    deepspeed: bool | str = "auto"
    # bf16-mixed: bfloat16 compute (student, teacher, cached states) with float32 master weights and optimizer states;
    # bf16-pure: bfloat16 weights and optimizer states too (only when asked); fp32; auto = bf16-mixed on a GPU, fp32
    # on CPU (bf16-mixed on CPU rehearses a GPU's numerics where there is none, at CPU bf16 speed)
    precision: str = "auto"
    # the KL's implementation (distill/kernels.py): chunked (the reference, every device), compiled (torch.compile of
    # the student's forward and loss), liger (Liger Kernel's fused linear JSD at beta 0 = forward KL; GPU, the [gpu]
    # extra); auto = the kernel the last GPU acceptance call measured fastest at the same loss (chunked on CPU)
    kl_kernel: str = "auto"
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
    def uses_deepspeed(self) -> bool:
        """DeepSpeed ZeRO: asked for, or under auto where a student has more than one worker."""
        return self.workers > 1 if self.deepspeed == AUTO else bool(self.deepspeed)

    @property
    def stop_poll(self) -> int:
        """Steps between looks at a stop request: a student ASHA stops trains up to this many past its report."""
        return min(self.eval_every, STOP_POLL_STEPS)


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
    if d.precision != AUTO and d.precision not in PRECISIONS:
        raise M2DError(f"{PRECISIONS.unknown_message(d.precision)} (or auto: bf16-mixed on a GPU, fp32 on CPU)")
    if d.deepspeed not in (True, False, AUTO):
        raise M2DError(f"distill.deepspeed={d.deepspeed!r}: use true, false or auto (DeepSpeed above one worker)")
    if d.precision == "bf16-pure" and d.uses_deepspeed:
        raise M2DError(
            "distill.precision=bf16-pure: DeepSpeed keeps float32 master weights in bf16; set distill.deepspeed=false "
            "for pure bfloat16 training, or use bf16-mixed"
        )
    if d.kl_kernel != AUTO and d.kl_kernel not in KL_KERNELS:
        raise M2DError(f"distill.kl_kernel: {KL_KERNELS.unknown_message(d.kl_kernel)} (or auto)")
    if d.kl_kernel != AUTO and d.kl_kernel in CUDA_ONLY_KERNELS and d.gpus_per_worker <= 0:
        raise M2DError(
            f"distill.kl_kernel={d.kl_kernel} runs on CUDA devices only and distill.gpus_per_worker is 0; use chunked "
            "or auto"
        )
    if d.zero_stage not in (0, 1, 2):
        raise M2DError(
            f"distill.zero_stage={d.zero_stage}: use 2 (ZeRO-2), 1 or 0; ZeRO-3 would shard the weights the loss reads"
        )
