"""The sections of a config that the students' stages read: stage 2's distillation (`distill`) and its students
(`stage2`), stage 3's evaluation and what the models write (`stage3`, `stage3.analysis`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from m2d_ray.catalog.distill import AUTO, COMPILED
from m2d_ray.catalog.targets import ONLINE
from m2d_ray.config.fields import Auto, CheckpointingName, KernelName, LossName, PrecisionName, QuestionSet, setting

ZERO_WITHOUT_PLAN = 2  # distill.zero_stage=auto where no plan decided it (the paper's ZeRO-2)
STOP_POLL_STEPS = 10  # a stop request (ASHA's) is looked at every this many steps (or every eval_every, if fewer)


@dataclass(frozen=True)
class DistillConfig:
    """Stage 2 training of one student (the paper's values are the defaults; tiny configs shrink them)."""

    train_data: str = setting(
        "fineweb-edu",
        "the distillation text: any data spec (data/source.py): hf:, Parquet / JSON Lines / text shards, local or "
        "s3://",
    )
    eval_data: str | None = setting(None, "the validation text; None = the run's eval.data")
    eval_max_tokens: int | None = setting(65536, "validation tokens (the first ones of eval_data); None = all of it")
    loss: LossName = setting(
        "fkl",
        "the loss (registries): fkl (forward KL) | rkl (reverse KL) | fkl+mse (+ every layer's hidden-state MSE)",
    )
    temperature: float = setting(1.0, "the KL's temperature t (the loss is t^2 KL at logits / t)")
    mse_weight: float = setting(1.0, "fkl+mse: the weight of the hidden-state MSE")
    teacher_topk: int | None = setting(None, "the teacher's expanded routing k' >= k; None = the teacher's own k")
    steps: int = setting(
        200,
        "optimizer steps (the budget: steps x batch_size x grad_accum x workers sequences of seq_len tokens)",
    )
    lr: float = setting(1e-4, "the peak learning rate (AdamW)")
    min_lr: float = setting(1e-5, "the learning rate at the end of the cosine decay")
    warmup_steps: int = setting(20, "steps of linear warm-up")
    weight_decay: float = setting(0.01, "AdamW's weight decay (matrices decayed, norms and biases not)")
    betas: tuple[float, ...] = setting((0.9, 0.95), "AdamW's (beta1, beta2)")
    grad_clip: float = setting(1.0, "the gradient's norm is clipped to this")
    batch_size: int = setting(4, "sequences per worker per micro-batch")
    grad_accum: int = setting(1, "micro-batches per optimizer step (gradient accumulation)")
    seq_len: int = setting(4096, "tokens per packed training sequence")
    eval_every: int = setting(
        50,
        "steps between validations (each one is a report, a checkpoint and an ASHA rung step)",
    )
    eval_batch_size: int = setting(4, "validation sequences per forward")
    loss_chunk: int = setting(
        1024,
        "tokens per vocabulary chunk of the KL (a [tokens x vocabulary] float32 tensor never exists)",
    )
    deepspeed: bool | Auto = setting(
        AUTO,
        "DeepSpeed ZeRO (gloo on CPU); false = plain torch (DDP with several workers); auto = DeepSpeed where a "
        "student has more than one worker (at one rank ZeRO shards nothing and its step is slower: "
        "docs/how-to/gpu.md)",
    )
    precision: PrecisionName = setting(
        AUTO,
        "bf16-mixed: bfloat16 compute (student, teacher, cached states) with float32 master weights and optimizer "
        "states; bf16-pure: bfloat16 weights and optimizer states too (only when asked); fp32; auto = bf16-mixed "
        "on a GPU, fp32 on CPU (bf16-mixed on CPU rehearses a GPU's numerics where there is none, at CPU bf16 "
        "speed)",
    )
    kl_kernel: KernelName = setting(
        AUTO,
        "the KL's implementation (distill/kernels.py): chunked (the reference, every device), liger (Liger "
        "Kernel's fused linear JSD at beta 0 = forward KL; GPU, the [gpu] extra); auto = the kernel the last GPU "
        "acceptance call measured fastest at the same loss (chunked on CPU); compiled (deprecated) = chunked with "
        "distill.compile=true",
    )
    compile: bool = setting(
        False,
        "torch.compile the student's forward and loss (inductor fuses its norms, SwiGLU and rotary embeddings; the "
        "first step pays the compilation), with any kl_kernel",
    )
    zero_stage: Literal[0, 1, 2, 3] | Auto = setting(
        AUTO,
        "DeepSpeed's ZeRO stage: 2 shards the optimizer state and gradients over the workers, 3 the weights too (each "
        "layer gathered as it runs; the exported student and its parameter names are the same); auto = 2 where a "
        "ZeRO-2 rank fits its device, else 3 (the plan decides it and the run's config records it); 0, 1, 2, 3 or auto",
    )
    workers: int = setting(1, "Ray Train workers per student")
    gpus_per_worker: float = setting(0.0, "GPUs per worker (0: CPU)")
    accelerator: str | None = setting(
        None,
        "pin the workers to a GPU type (Ray's accelerator_type, e.g. H100); unset: the plan places them on the "
        "cheapest GPU type of the cluster's whose node holds all the workers and whose GPU a rank fits (recorded)",
    )
    cpus_per_worker: float = setting(1.0, "CPUs per worker")
    threads_per_worker: int = setting(1, "torch threads per worker on CPU")
    checkpointing: CheckpointingName = setting(
        AUTO,
        "activations recomputed in the backward: none; selective (per op: matmul and attention outputs kept, the "
        "elementwise ops recomputed); full (each layer's input kept, its forward recomputed: a fourth forward of "
        "time); auto = the least recompute whose stage-2 rank fits its device (the plan decides it and the run's "
        "config records it); distill.gradient_checkpointing=true/false of earlier versions reads as full/none",
    )
    keep_checkpoints: int = setting(2, "Train checkpoints a student keeps (the latest ones)")
    seed: int = setting(
        0,
        "the seed of the training's randomness, the baselines' initial weights and the sampled targets' draws",
    )
    epochs: int = setting(
        1,
        "passes over train_data the budget may take (1: a corpus shorter than the budget is refused)",
    )

    def __post_init__(self) -> None:
        if self.kl_kernel == COMPILED:  # the deprecated kernel name: chunked, the student compiled
            object.__setattr__(self, "kl_kernel", "chunked")
            object.__setattr__(self, "compile", True)

    @property
    def blocks(self) -> int:
        """Global [seq_len] blocks the run reads: steps x batch x accumulation x workers."""
        return self.steps * self.batch_size * self.grad_accum * self.workers

    @property
    def uses_deepspeed(self) -> bool:
        """DeepSpeed ZeRO: asked for, or under auto where a student has more than one worker."""
        return self.workers > 1 if self.deepspeed == AUTO else bool(self.deepspeed)

    @property
    def zero(self) -> int:
        """The ZeRO stage a step trains with: the plan's decision, else (no plan decided `auto`: `m2d distill`, a job
        built by hand) ZeRO-2, the paper's."""
        return ZERO_WITHOUT_PLAN if self.zero_stage == AUTO else int(self.zero_stage)

    @property
    def stop_poll(self) -> int:
        """Steps between looks at a stop request: a student ASHA stops trains up to this many past its report."""
        return min(self.eval_every, STOP_POLL_STEPS)


@dataclass(frozen=True)
class Stage2Config:
    """Stage 2: which students are distilled beside the promoted ones, how, and what stays in storage."""

    baselines: tuple[str, ...] = setting(
        ("random-ffn", "random-init"),
        "baselines distilled under the same budget (stages/baselines/: random-ffn, random-init, d2d); checked "
        'with "did you mean"',
    )
    d2d_teacher: str | None = setting(
        None,
        "the d2d baseline's dense teacher, matched to `model` in total parameters (pruned to the K = k student's "
        "parameter count and distilled from); None = the embedded dense twin, which matches only the embedded MoE "
        "teacher",
    )
    asha: bool = setting(True, "stop poor students early on validation loss (ASHA)")
    grace_evals: int = setting(2, "ASHA never stops a student before this many validations")
    reduction_factor: int = setting(3, "ASHA's reduction factor: at each rung the best 1/factor of the students go on")
    max_concurrent_trials: int | None = setting(
        None,
        "students at once; None = all of them on GPUs (Ray queues them), ray.max_concurrent_trials on CPUs",
    )
    pairs: tuple[str, ...] = setting((), 'the "scoring/grouping" pairs to distil; empty = every promoted pair')
    targets: str = setting(
        ONLINE,
        "the teacher's outputs: online (the teacher runs beside every student) | hidden (its final hidden states: "
        "exact, a rank reads the teacher's output head only) | topk[:K] | sampled[:N] (approximate); cached modes "
        "are computed once over the run's tokens into its storage, and students load no teacher weights; auto: "
        "per teacher, the cheapest exact mode that fits (hidden, or online, sharded where it must be), chosen by "
        "the plan",
    )
    shard_teacher: bool = setting(
        False,
        "online: each rank of a student holds 1/distill.workers of its teacher and gathers one layer at a time "
        "for the forward (distill/sharded_teacher.py); with auto, the online choices are sharded ones",
    )
    recipes: tuple[str, ...] = setting(
        (),
        "students named directly, with no stage-1 search (calibration still plans them): "
        "scoring/grouping/K<K>/scaling, e.g. [do-acp/rr/K8/uniform, sf/wc/K16/uniform]; one per scoring/grouping "
        "pair",
    )
    keep_training_state: bool = setting(
        False,
        "keep a student's Train checkpoints (DeepSpeed state: ~14 B/parameter, 94 GB at 3.3B) once it ends; "
        "false: removed (ok: once its distilled model is verified in storage; pruned or diverged: at once)",
    )


@dataclass(frozen=True)
class Thresholds:
    """stage3.analysis.thresholds: the taxonomy rules' thresholds (evaluate/taxonomy.py), the paper's by default."""

    filler_ratio: float = setting(0.35, "incoherent: filler words / words above this ...")
    unique_ratio: float = setting(0.15, "... and distinct words / words below this")
    digit_ratio: float = setting(0.30, "incoherent: digits / non-space characters above this")
    ngram: int = setting(3, "repetitive: a word n-gram of this length ...")
    repeats: int = setting(5, "... occurring at least this many times")
    overlap: float = setting(0.15, "topic drift: question keywords the response uses, below this share")


@dataclass(frozen=True)
class AnalysisConfig:
    """What the models write (stages/analysis.py): each answers the questions in a chain-of-thought, every answer is
    put in one category of the paper's error taxonomy (evaluate/taxonomy.py)."""

    enabled: bool = setting(False, "run the analysis stage after stage 3")
    questions: QuestionSet = setting(
        "mmlu", "mmlu (the paper's: MMLU's test split, after `m2d fetch-data`) | local (offline)"
    )
    per_subject: int = setting(10, "questions per subject (the paper: 10 x 57 MMLU subjects)")
    max_new_tokens: int = setting(2048, "the longest answer generated, in tokens")
    temperature: float = setting(0.7, "sampling temperature (0 = greedy)")
    seed: int = setting(0, "the sample of questions and the sampling of every batch")
    batch_size: int = setting(16, "answers generated at once (and the teacher judge's batch)")
    judge: str = setting("teacher", "teacher (the run's MoE teacher) | none | openai:MODEL")
    judge_url: str = setting("https://api.openai.com/v1", "an OpenAI-compatible server (openai:MODEL)")
    judge_key_env: str = setting("OPENAI_API_KEY", "the environment variable holding its key (unset: no key sent)")
    judge_rate: float = setting(2.0, "requests per second, at most")
    judge_retries: int = setting(4, "retries of a failed request, with exponential backoff")
    judge_max_tokens: int = setting(
        4096,
        "the longest reply asked of it, in tokens: room for a reasoning model's (or a <think>ing one's) thoughts "
        "before its one word",
    )
    judge_deadline: float = setting(
        3600.0,
        "seconds an openai judge may take over one model's answers, its retries included (what is left then: unjudged)",
    )
    judge_extracts: bool = setting(
        True,
        "an openai judge reads the final answer the rules could not (none, or a hedge), recorded as extracted_by: "
        "judge",
    )
    max_unjudged: float = setting(
        0.05,
        "a model whose judge (teacher or openai) leaves more than this share of the answers it was asked about "
        "unjudged is recorded failed (the run exits non-zero; a resume judges it again)",
    )
    thresholds: Thresholds = setting(
        doc="the taxonomy rules' thresholds (the defaults are the paper's)",
        factory=Thresholds,
    )


@dataclass(frozen=True)
class Stage3Config:
    """lm-eval of the distilled students (and the teacher), one Ray task per model."""

    tasks: str = setting(
        "paper",
        "the suite: paper | paper-hub | local | text:PATH | task[:shots],... (see evaluate/harness.py)",
    )
    num_fewshot: int | None = setting(None, "shots for every task; None = the suite's own")
    limit: int | None = setting(None, "examples per task; None = all")
    batch_size: int | str = setting(
        16,
        "sequences per forward, lowered to what fits beside the weights; or auto: the largest that fits",
    )
    teacher: bool = setting(True, "evaluate the teacher too (the table's reference row)")
    teacher_scores: str | None = setting(
        None,
        'a JSON file of the teacher\'s scores from elsewhere, {task: score} or a stage-3 record ({"tasks": {task: '
        '{"score": ...}}}): the teacher\'s row reads them and the teacher is neither evaluated nor analysed (one no '
        "node holds, e.g. DeepSeek-V3 in bf16); None = evaluated here",
    )
    cpus_per_task: float = setting(1.0, "CPUs of a model's task")
    gpus_per_task: float | None = setting(
        None,
        "GPUs of a model's task; None = 1 when the run uses GPUs, else 0 (a model that needs more gets them, sharded)",
    )
    threads_per_task: int = setting(1, "torch threads of a model's task on CPU")
    gpu_memory: str | None = setting(None, "one GPU's memory, e.g. 80GB; None = measured by a 1-GPU Ray task")
    gpus_per_node: int | None = setting(None, "the most GPUs one node has; None = from the Ray cluster's nodes")
    batch_memory: str | None = setting(
        None,
        "memory for a batch's activations, e.g. 20GB (a memory plan's); None = what is left beside the weights",
    )
    max_length: int = setting(4096, "the longest sequence planned for (longer contexts are left-truncated by lm-eval)")
    accelerator: str | None = setting(
        None,
        "pin stage-3 and analysis tasks to a GPU type (e.g. H100); unset: the plan places them on the cheapest GPU "
        "type of the cluster's whose GPUs hold every model (recorded)",
    )
    analysis: AnalysisConfig = setting(
        doc="what the models write: the paper's error taxonomy after stage 3 (stages/analysis.py)",
        factory=AnalysisConfig,
    )
