"""Sweep configuration: frozen dataclasses read from YAML, with `key=value` overrides.

A YAML file is a (possibly partial) nested mapping of the dataclasses below; `include: base.yaml`
merges a base file first, so a teacher's config is a small diff. Every key is checked: an unknown
key, a wrong type or an unknown method name fails with one line that says what to write instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from m2d_ray import measured, shipped
from m2d_ray.accelerators import check_accelerator
from m2d_ray.artifacts import write_text_atomic
from m2d_ray.catalog.distill import (
    AUTO,
    CHECKPOINTING,
    COMPILED,
    CUDA_ONLY_KERNELS,
    KL_KERNELS,
    LOSSES,
    PRECISIONS,
    RETIRED_CHECKPOINTING,
)
from m2d_ray.catalog.evaluate import SETS, check_stage3, parse_judge, parse_tasks
from m2d_ray.catalog.methods import GROUPINGS, SCALINGS, SCORINGS
from m2d_ray.catalog.targets import ONLINE, check_targets_loss, parse_targets
from m2d_ray.catalog.units import ACTOR, MODEL, STUDENT, TRIAL
from m2d_ray.console import say
from m2d_ray.errors import M2DError
from m2d_ray.sizes import parse_size

#: the closed sets a key takes, as types: the reference shows them, and each section's check refuses any other value
#: in one line with "did you mean" (the YAML reader checks only the value's type: config._coerce)
Auto = Literal[AUTO]
PrecisionName = Literal[(AUTO, *PRECISIONS)]
KernelName = Literal[(AUTO, *KL_KERNELS)]
CheckpointingName = Literal[(AUTO, *CHECKPOINTING)]
QuestionSet = Literal[SETS]


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A config key: its default (or `factory`) and its one-line doc, written once here. The doc is the field's
    `metadata["doc"]`, which `m2d --help` (cli.py) and the generated reference (docs/hooks/reference.py) read."""
    return field(default=default, default_factory=factory, metadata={"doc": doc})


def docs(cls: type) -> dict[str, str]:
    """Each field of a config dataclass -> its one-line doc (a nested section's is its class docstring)."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def default(cls: type, name: str) -> Any:
    """The default of `cls`'s field `name` (its factory's value for a mapping or a nested section)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass(frozen=True)
class CalibConfig:
    """The calibration pass: the text, how much of it, and how the teacher runs over it."""

    data: str | None = setting(
        None,
        "the calibration text (a data spec); None = the teacher's default (the embedded corpus for the embedded "
        "teacher, else wikitext2:train)",
    )
    max_tokens: int = setting(
        32768,
        "tokens of calibration text (counts, probabilities and the output Gram are summed over them)",
    )
    seq_len: int = setting(256, "tokens per calibration sequence")
    batch_size: int = setting(8, "sequences per forward of the teacher")
    stream: bool | None = setting(
        None,
        "layer-streamed calibration (one decoder layer on the device at a time); None = when the whole teacher "
        "does not fit max_memory",
    )
    max_memory: str | None = setting(
        None,
        "memory the teacher may take on a calibration actor's device, e.g. 40GB; None = the device's free memory",
    )


@dataclass(frozen=True)
class EvalConfig:
    """Stage 1's pre-distillation perplexity (also the d2d search's and stage 2's default validation text)."""

    data: str = setting("wikitext2:test", "the perplexity text (a data spec)")
    max_chars: int | None = setting(300_000, "characters of it scored (the first ones); None = all")
    seq_len: int = setting(256, "tokens per window (non-overlapping windows, scored independently)")
    batch_size: int = setting(8, "windows per forward")
    chunks: int = setting(
        6,
        "perplexity is reported after each of these chunks of windows (what early stopping compares)",
    )


@dataclass(frozen=True)
class GridConfig:
    """Stage 1's grid of recipes: every scoring x grouping x scaling x K."""

    scoring: tuple[str, ...] = setting(
        tuple(SCORINGS),
        "scorings (registries: sf, pp, ps, cp, acp, do-cp, do-acp); default every registered one",
    )
    grouping: tuple[str, ...] = setting(
        tuple(GROUPINGS),
        "groupings (rr, wc, rc, ab, oc); default every registered one",
    )
    scaling: tuple[str, ...] = setting(
        ("uniform", "proportional"),
        "scalings of the merged experts' down-projections (uniform, proportional, avg-cp)",
    )
    K: Auto | tuple[int, ...] = setting(
        AUTO,
        "experts kept per layer, k <= K <= E: a list, or auto = k, 2k, 4k, ..., E",
    )


@dataclass(frozen=True)
class SearchConfig:
    """How stage 1 spends its trials: one per distinct student, hopeless ones stopped early."""

    dedupe: bool = setting(
        True,
        "evaluate each distinct student once (configs whose plans are the same share one result)",
    )
    early_stop: bool = setting(
        True,
        "stop a config whose partial perplexity is hopeless against its (scoring, grouping) pair",
    )
    stop_factor: float = setting(
        1.3,
        "hopeless: a partial perplexity above this factor x the best of its pair at the same chunk",
    )
    grace_chunks: int = setting(1, "never stop a config before this many chunks")
    probe: bool = setting(True, "a probe round first (every student's first chunk), then the survivors best-first")


@dataclass(frozen=True)
class RayConfig:
    """Where and how wide the Ray work runs (stage 1's trials, the Ray Data passes, retries)."""

    address: str | None = setting(
        None,
        "the Ray cluster to join. Leave it unset (None): under `ray job submit` and a KubeRay RayJob the driver "
        "has RAY_ADDRESS, which m2d joins, and elsewhere m2d starts a local Ray. Set it only to join from a "
        'process Ray did not start: "auto" on a node of a running cluster (it fails when there is none), '
        '"ray://HOST:10001" from outside',
    )
    num_cpus: int = setting(
        4,
        "logical CPUs of a local Ray (more than the cores: a Tune trial that starts Train workers needs the slack)",
    )
    data_actors: int = setting(2, "Ray Data actors of the calibration and targets passes")
    data_gpus_per_actor: float = setting(0.0, "GPUs of each of those actors (0: CPU)")
    data_accelerator: str | None = setting(
        None,
        "pin the calibration and targets passes to a GPU type (Ray's accelerator_type, e.g. H100)",
    )
    cpus_per_trial: float = setting(1.0, "CPUs of a stage-1 trial")
    gpus_per_trial: float = setting(0.0, "GPUs of a stage-1 trial (fractional: trials share one device)")
    trial_accelerator: str | None = setting(
        None,
        "pin stage-1 trials to a GPU type (e.g. A10G); None = any GPU (`m2d plan` names the types a cluster has)",
    )
    spot_trials: bool = setting(
        False,
        "stage-1 trials ask for the `spot` resource: they run only on node types that carry it (cluster.yaml's "
        "gpu_a10g_1x_spot), priced at spot; with ray.max_failures > 0 a trial on a reclaimed node is retried",
    )
    max_concurrent_trials: int = setting(2, "stage-1 trials at once (and stage-2 students at once on CPUs)")
    threads_per_worker: int = setting(
        1,
        "torch threads of each Ray worker (on a small machine: 1, so workers do not fight over the cores)",
    )
    max_failures: int = setting(
        0,
        "retries of a trial, task or student whose node is lost (set > 0 on spot nodes, which can be reclaimed)",
    )


@dataclass(frozen=True)
class TrackConfig:
    """MLflow: where the run's parent run and its nested runs are logged."""

    tracking_uri: str | None = setting(
        None,
        "the tracking server or store; None = sqlite:///RUN_DIR/mlflow.db (--tracking-uri overrides it)",
    )
    experiment: str = setting("m2d", "the MLflow experiment the run's parent run belongs to")


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
    loss: str = setting(
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
    zero_stage: Literal[0, 1, 2] = setting(
        2,
        "DeepSpeed's ZeRO stage: 2 shards the optimizer state and gradients over the workers (0, 1 or 2)",
    )
    workers: int = setting(1, "Ray Train workers per student")
    gpus_per_worker: float = setting(0.0, "GPUs per worker (0: CPU)")
    accelerator: str | None = setting(None, "pin the workers to a GPU type (Ray's accelerator_type, e.g. H100)")
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
    if d.checkpointing != AUTO and d.checkpointing not in CHECKPOINTING:
        raise M2DError(f"distill.checkpointing: {CHECKPOINTING.unknown_message(d.checkpointing)} (or auto)")
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


def check_analysis(a: AnalysisConfig) -> None:
    """One-line errors for stage3.analysis settings that cannot run, from the config alone."""
    if a.questions not in SETS:
        raise M2DError(f"stage3.analysis.questions={a.questions!r}: write one of {', '.join(SETS)}")
    for key in ("per_subject", "max_new_tokens", "batch_size", "judge_retries", "judge_max_tokens"):
        if getattr(a, key) < (0 if key == "judge_retries" else 1):
            raise M2DError(f"stage3.analysis.{key}={getattr(a, key)}: give a positive number")
    if not 0 <= a.max_unjudged <= 1:
        raise M2DError(f"stage3.analysis.max_unjudged={a.max_unjudged}: give a share in [0, 1]")
    if not a.judge_deadline > 0:
        raise M2DError(f"stage3.analysis.judge_deadline={a.judge_deadline}: give a positive number of seconds")
    if a.temperature < 0 or a.judge_rate <= 0:
        raise M2DError("stage3.analysis.temperature must be >= 0 (0: greedy) and judge_rate > 0; give such values")
    parse_judge(a.judge)
    t = a.thresholds
    for key in ("filler_ratio", "unique_ratio", "digit_ratio", "overlap"):
        if not 0 <= getattr(t, key) <= 1:
            raise M2DError(f"stage3.analysis.thresholds.{key}={getattr(t, key)}: give a share in [0, 1]")
    if t.ngram < 1 or t.repeats < 2:
        raise M2DError("stage3.analysis.thresholds: give ngram >= 1 and repeats >= 2")


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
    accelerator: str | None = setting(None, "pin stage-3 tasks to a GPU type (e.g. H100)")
    analysis: AnalysisConfig = setting(
        doc="what the models write: the paper's error taxonomy after stage 3 (stages/analysis.py)",
        factory=AnalysisConfig,
    )


@dataclass(frozen=True)
class PlanConfig:
    """What `m2d plan` and `m2d run` price a run with (plan/cost.py)."""

    max_dollars: float | None = setting(
        None,
        "refuse a run whose bill (with ASHA on: its bound, no student stopped) costs more, before any work",
    )
    efficiency: float | dict[str, float] = setting(
        doc="achieved / peak FLOP/s on a GPU, by what the unit runs: a stage-2 step by its targets mode (online, "
        "hidden, topk, sampled), the forward-only stages (calibration, stage-1 trials, the targets pass, lm-eval, "
        "generation) by `forward`; a number is every one. The default is what the last GPU acceptance call measured "
        "(m2d_ray/measured_gpu.json, `efficiency`: the figures live there only); `forward` is the paper's own step's "
        '(benchmarks/RESULTS.md, "The bill"), not yet measured here',
        factory=lambda: dict(measured.gpu().efficiency),
    )
    cpu_efficiency: float = setting(
        0.4,
        "the same on a CPU thread: the platform's stage-2 step at 41.7% of the measured matmul rate (P7, 2 "
        'threads), held to the tiny run\'s measured walls (benchmarks/RESULTS.md, "The bill")',
    )
    cpu_flops: float | None = setting(
        None,
        "one CPU thread's fp32 FLOP/s; None = measured by a matmul when a stage runs on CPU",
    )
    max_storage: str | None = setting(
        None,
        "refuse a run whose storage exceeds this, e.g. 20TB, before any work (None: no limit)",
    )
    read_bandwidth: dict[str, float] = setting(
        doc="bytes/s one student reads cached targets at, by storage kind (local: the run directory; shared: a path "
        "every node mounts; object: s3:// or gs://), over plan/targets.py's defaults",
        factory=dict,
    )
    tb_month: dict[str, float] = setting(
        doc="$ per TB-month of storage by the same kinds, over plan/targets.py's defaults",
        factory=dict,
    )
    nvlink_bandwidth: float = setting(
        3.0e11,
        "bytes/s one GPU all-gathers a sharded teacher's layers at within a node (NVLink)",
    )
    network_bandwidth: float = setting(
        2.5e10,
        "bytes/s one GPU all-gathers a sharded teacher's layers at between nodes",
    )
    prices: dict[str, float] = setting(
        doc="$/hour by node type or instance type, over plan/prices.py's table",
        factory=dict,
    )
    stage_s: float = setting(
        10.0,
        "seconds the FLOPs do not show, fit on the tiny runs' measured walls on two 2-core hosts (RESULTS.md, "
        '"The bill"): a Ray round\'s start and finish (a Tune experiment, a Ray Data pass): ~6 s on an Intel Xeon, '
        "~15 s on an AMD EPYC",
    )
    actor_s: float = setting(
        2.0,
        "a Ray Data actor of the calibration or targets pass: its process, the teacher loaded, the pass planned",
    )
    trial_s: float = setting(0.4, "a stage-1 trial: its student built from its plan")
    student_s: float = setting(
        40.0,
        "a stage-2 student: its Train worker group started, its initial student built, its export",
    )
    model_s: float = setting(5.0, "a stage-3 model: loaded and lm-eval's set-up")
    gpu_start_s: dict[str, float] = setting(
        doc="the same starts of a unit on a GPU (actor, trial, student, model: a CUDA context, DeepSpeed's "
        "initialise, a Train worker group on a GPU), fit on the whole tiny run's stage walls by the last GPU "
        "acceptance call (m2d_ray/measured_gpu.json)",
        factory=lambda: dict(measured.gpu().start_s),
    )

    def start_s(self, unit: str, gpu: bool) -> float:
        """A unit's fixed start (actor, trial, student, model) on a GPU or on CPUs; a key plan.gpu_start_s leaves out
        is the measured one."""
        if gpu:
            return {**measured.gpu().start_s, **self.gpu_start_s}[unit]
        return {ACTOR: self.actor_s, TRIAL: self.trial_s, STUDENT: self.student_s, MODEL: self.model_s}[unit]

    def gpu_efficiency(self, work: str) -> float:
        """The efficiency of `work` (a targets mode, or forward) on a GPU; a key plan.efficiency leaves out is the
        measured one."""
        e = self.efficiency
        return e if isinstance(e, float) else {**measured.gpu().efficiency, **e}[work]


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests and drills: trial keys that raise, or whose student is poisoned with NaN."""

    raise_in: tuple[str, ...] = setting(
        (),
        "stage-1 config keys and stage-2 student keys whose trial raises (a failure drill)",
    )
    nan_in: tuple[str, ...] = setting((), "stage-1 config keys whose student gets a NaN weight (a divergence drill)")


@dataclass(frozen=True)
class SweepConfig:
    """A run: the teacher, where it writes, and each stage's section."""

    name: str = setting(
        "sweep",
        "the run's name (its default run directory runs/NAME-TIME, its MLflow parent run's name)",
    )
    stage: Literal[1, 2] = setting(
        1,
        "m2d sweep only: 1 = the pre-distillation grid; 2 = distil the promotions of a finished stage 1 (--resume "
        "RUN_DIR)",
    )
    model: str | None = setting(
        None,
        "the MoE teacher: a hub name, a directory or a storage URL (s3://...); None = the embedded tiny teacher",
    )
    storage: str | None = setting(
        None,
        "what Ray workers read and write (students, checkpoints, Tune state, the text files): a path every node "
        "mounts or s3:// / gs://; None = the run directory",
    )
    device: str | None = setting(None, "the device of a stage-1 trial; None = cuda when the trial has a GPU, else cpu")
    calib: CalibConfig = field(default_factory=CalibConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    grid: GridConfig = field(default_factory=GridConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    mlflow: TrackConfig = field(default_factory=TrackConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    stage2: Stage2Config = field(default_factory=Stage2Config)
    stage3: Stage3Config = field(default_factory=Stage3Config)
    faults: FaultConfig = field(default_factory=FaultConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    def to_dict(self) -> dict:
        return _plain(dataclasses.asdict(self))

    def check(self) -> None:
        """Every setting that can be checked from the config alone, each failing with one line: method names,
        non-empty axes, a well-formed K list (K's range needs the model: check_k_range), each section's values."""

        for axis, registry in (("scoring", SCORINGS), ("grouping", GROUPINGS), ("scaling", SCALINGS)):
            names = getattr(self.grid, axis)
            if not names:
                raise M2DError(f"grid.{axis} is empty; list at least one of: {', '.join(registry.names())}")
            for n in names:
                if n not in registry:
                    raise M2DError(f"grid.{axis}: {registry.unknown_message(n)}")
        K = self.grid.K
        if isinstance(K, str) and K != AUTO:
            raise M2DError(f"grid.K={K!r}: write a list of integers such as [8, 16] or auto (k, 2k, 4k ... E)")
        if not isinstance(K, str) and not K:
            raise M2DError("grid.K is empty; give a list such as [8, 16] or auto (k, 2k, 4k ... E)")
        if self.eval.chunks < 1 or self.search.stop_factor <= 1.0:
            raise M2DError("eval.chunks must be >= 1 and search.stop_factor > 1")
        if self.calib.max_memory is not None:
            try:
                parse_size(self.calib.max_memory)
            except M2DError as exc:
                raise M2DError(f"calib.max_memory: {exc}") from None
        e = self.plan.efficiency
        for key, v in [("cpu_efficiency", self.plan.cpu_efficiency), *_fractions("efficiency", e)]:
            if not 0 < v <= 1:
                raise M2DError(f"plan.{key}={v} must be in (0, 1] (achieved / peak FLOP/s); give the fraction measured")
        if self.plan.max_dollars is not None and self.plan.max_dollars <= 0:
            raise M2DError(
                f"plan.max_dollars={self.plan.max_dollars} must be > 0 when set; give a budget in dollars, or null for "
                "none"
            )
        if self.stage not in (1, 2):
            raise M2DError(
                f"stage={self.stage}: write stage=1 (pre-distillation grid) or stage=2 (distil the promotions)"
            )
        check_distill(self.distill)

        for key, value in (
            ("ray.data_accelerator", self.ray.data_accelerator),
            ("ray.trial_accelerator", self.ray.trial_accelerator),
            ("distill.accelerator", self.distill.accelerator),
            ("stage3.accelerator", self.stage3.accelerator),
        ):
            check_accelerator(value, key)
        check_stage2_targets(self)
        check_plan_storage(self.plan)
        check_recipes(self.stage2)
        grid_pairs = [f"{s}/{g}" for s in self.grid.scoring for g in self.grid.grouping]
        for p in self.stage2.pairs:
            if p not in grid_pairs:
                close = difflib.get_close_matches(p, grid_pairs, n=1, cutoff=0.5)
                raise M2DError(
                    f"stage2.pairs: {p!r} is not a scoring/grouping pair of the grid"
                    + (f"; did you mean {close[0]}?" if close else "")
                )

        parse_tasks(self.stage3.tasks, self.stage3.num_fewshot)  # a text:PATH file is checked when stage 3 starts

        check_stage3(self.stage3)
        check_analysis(self.stage3.analysis)

    def uses_gpus(self) -> bool:
        """Whether the run asks for GPUs: decided from the config, not from the GPUs up right now (a cluster
        scaling from zero GPU nodes has none until someone asks)."""
        return self.distill.gpus_per_worker > 0 or self.ray.gpus_per_trial > 0 or self.ray.data_gpus_per_actor > 0

    def students_at_once(self) -> int | None:
        """Stage 2's students at a time: as set, else all of them on GPUs (Ray queues their worker groups and an
        autoscaler starts nodes for them), else `ray.max_concurrent_trials` on CPUs."""
        if self.stage2.max_concurrent_trials:
            return self.stage2.max_concurrent_trials
        return None if self.distill.gpus_per_worker > 0 else self.ray.max_concurrent_trials

    def target_spec(self):
        """stage2.targets as a TargetSpec (None: online), at the distillation temperature and seed; `auto` is the
        plan's choice per teacher (plan/targets.py), not one spec."""
        if self.stage2.targets == AUTO:
            raise ValueError("stage2.targets=auto: each teacher's mode is the plan's (Planning.choice)")
        return parse_targets(self.stage2.targets, self.distill.temperature, self.distill.seed)


def check_stage2_targets(cfg: SweepConfig) -> None:
    """stage2.targets (a mode or auto) against the loss, and stage2.shard_teacher where it would change nothing."""
    s2, x = cfg.stage2, cfg.distill
    if s2.shard_teacher and x.workers < 2:
        raise M2DError(
            "stage2.shard_teacher=true changes nothing with distill.workers=1: a teacher is sharded over the ranks of "
            "its student; set distill.workers to 2 or more (e.g. one per GPU of a node), or drop it"
        )
    if s2.targets == AUTO:  # the plan chooses among the exact modes the loss can train from
        return
    spec = parse_targets(s2.targets, x.temperature)
    check_targets_loss(x.loss, spec)
    if s2.shard_teacher and spec is not None:
        raise M2DError(
            f"stage2.shard_teacher=true changes nothing with stage2.targets={s2.targets}: the students load no teacher "
            "weights; drop it, or use stage2.targets=online (or auto)"
        )


STORAGE_KINDS = ("local", "shared", "object")


def check_plan_storage(plan: PlanConfig) -> None:
    """plan.max_storage a size; plan.read_bandwidth / tb_month keyed by storage kind, positive / non-negative."""
    if plan.max_storage is not None:
        try:
            parse_size(plan.max_storage)
        except M2DError as exc:
            raise M2DError(f"plan.max_storage: {exc}") from None
    for key, low in (("read_bandwidth", 0.0), ("tb_month", -1.0)):
        for kind, v in getattr(plan, key).items():
            if kind not in STORAGE_KINDS:
                close = difflib.get_close_matches(kind, STORAGE_KINDS, n=1)
                raise M2DError(
                    f"plan.{key}.{kind}: unknown storage kind"
                    + (f"; did you mean {close[0]}?" if close else "")
                    + f" (kinds: {', '.join(STORAGE_KINDS)})"
                )
            if not v > low:
                raise M2DError(f"plan.{key}.{kind}={v} must be {'> 0' if low == 0 else '>= 0'}")
    for key in ("nvlink_bandwidth", "network_bandwidth"):
        if not getattr(plan, key) > 0:
            raise M2DError(f"plan.{key}={getattr(plan, key)} must be > 0 (bytes/s)")
    given = {
        "efficiency": plan.efficiency if isinstance(plan.efficiency, dict) else {},
        "gpu_start_s": plan.gpu_start_s,
    }
    known = {"efficiency": measured.gpu().efficiency, "gpu_start_s": measured.gpu().start_s}
    for key, values in given.items():
        for name, v in values.items():
            if name not in known[key]:
                close = difflib.get_close_matches(name, known[key], n=1)
                raise M2DError(
                    f"plan.{key}.{name}: unknown" + (f"; did you mean {close[0]}?" if close else "") + f" (keys: "
                    f"{', '.join(known[key])})"
                )
            if not v > 0:
                raise M2DError(f"plan.{key}.{name}={v} must be > 0")


def _fractions(key: str, value: float | dict) -> list[tuple[str, float]]:
    """(key, value) of a number or of each entry of a mapping (plan.efficiency)."""
    return [(f"{key}.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(key, value)]


@dataclass(frozen=True)
class Recipe:
    """One student named directly (stage2.recipes): what stage 1 would have promoted for its pair."""

    scoring: str
    grouping: str
    K: int
    scaling: str

    @property
    def pair(self) -> str:
        return f"{self.scoring}/{self.grouping}"

    def __str__(self) -> str:
        return f"{self.scoring}/{self.grouping}/K{self.K}/{self.scaling}"


def parse_recipe(text: str) -> Recipe:
    """`scoring/grouping/K<K>/scaling` (e.g. do-acp/rr/K8/uniform), each name checked against its registry."""
    parts = str(text).strip().split("/")
    usage = "write scoring/grouping/K<K>/scaling, e.g. do-acp/rr/K8/uniform"
    if len(parts) != 4 or parts[2][:1] not in ("K", "k") or not parts[2][1:].isdigit() or int(parts[2][1:]) < 1:
        raise M2DError(f"stage2.recipes: {text!r} is not a recipe; {usage}")
    for name, registry in ((parts[0], SCORINGS), (parts[1], GROUPINGS), (parts[3], SCALINGS)):
        if name not in registry:
            raise M2DError(f"stage2.recipes: {text!r}: {registry.unknown_message(name)}")
    return Recipe(parts[0], parts[1], int(parts[2][1:]), parts[3])


def check_recipes(s2: Stage2Config) -> None:
    """Recipes well formed, one per scoring/grouping pair, and not beside stage2.pairs (which filters a search)."""
    recipes = [parse_recipe(r) for r in s2.recipes]
    pairs = [r.pair for r in recipes]
    twice = sorted({p for p in pairs if pairs.count(p) > 1})
    if twice:
        raise M2DError(
            f"stage2.recipes names {', '.join(twice)} more than once; stage 2 distils one student per scoring/grouping "
            "pair: keep one recipe of each"
        )
    if recipes and s2.pairs:
        raise M2DError(
            "stage2.pairs picks among stage 1's promotions, and stage2.recipes skips stage 1: give one of them"
        )


def k_values(K: str | tuple[int, ...], k: int, E: int) -> list[int]:
    """The K list for a model with top-k `k` and `E` experts; raises when a K is outside [k, E]."""
    if K == AUTO:
        out, v = [], k
        while v < E:
            out.append(v)
            v *= 2
        return out + [E]
    bad = [v for v in K if not k <= v <= E]
    if bad:
        raise M2DError(f"grid.K has {bad} outside [k, E] = [{k}, {E}] for this model; use values in that range or auto")
    return sorted(set(K))


# ---- loading ---------------------------------------------------------------------------------
def load_config(path: str | Path | None, overrides: list[str] = ()) -> SweepConfig:
    """Read a YAML config (a file, else a shipped name such as `tiny`: shipped.find; None = all defaults) and apply
    `a.b=value` overrides."""
    raw: dict = _read_yaml(shipped.find(path)) if path is not None else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise M2DError(
                f"override {item!r} is not key=value: write it like grid.K=[8,16] or search.early_stop=false"
            )
        _set_path(raw, key.strip().split("."), yaml.safe_load(value))
    _retired(raw)
    _retired_checkpointing(raw.get("distill"))
    if (raw.get("distill") or {}).get("kl_kernel") == COMPILED:
        say(
            "distill.kl_kernel=compiled is deprecated: it is read as distill.kl_kernel=chunked distill.compile=true; "
            "write that"
        )
    cfg = _build(SweepConfig, raw, "")
    cfg.check()
    return cfg


#: keys of earlier versions: (section, key) -> what replaced them (a saved run's `null` is dropped)
RETIRED = {
    ("ray", "storage_path"): "storage: (students, checkpoints and Tune state, on a path every node mounts or s3://…)"
}


def _retired(raw: dict) -> None:
    for (section, key), instead in RETIRED.items():
        node = raw.get(section)
        if isinstance(node, dict) and key in node:
            if node.pop(key) is not None:
                raise M2DError(f"{section}.{key} was replaced by {instead}; write that instead")


def _retired_checkpointing(distill: dict | None) -> None:
    """distill.gradient_checkpointing (a boolean of earlier versions) read as distill.checkpointing full / none, said
    in one line (a saved run's config keeps running); with both keys given, one line asks for one."""
    if not isinstance(distill, dict) or "gradient_checkpointing" not in distill:
        return
    old = distill.pop("gradient_checkpointing")
    if "checkpointing" in distill:
        raise M2DError("distill.gradient_checkpointing was replaced by distill.checkpointing; give only that one")
    if old not in RETIRED_CHECKPOINTING:
        raise M2DError(f"distill.gradient_checkpointing={old!r}: write distill.checkpointing=none|selective|full|auto")
    distill["checkpointing"] = RETIRED_CHECKPOINTING[old]
    say(
        f"distill.gradient_checkpointing={str(old).lower()} is read as distill.checkpointing="
        f"{distill['checkpointing']}; write that (or auto: the plan picks the least recompute that fits)"
    )


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if not path.exists():
        raise M2DError(f"config {path} not found (an include: is read beside the file that names it)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise M2DError(
            f"{path} is not valid YAML ({getattr(exc, 'problem', None) or str(exc).splitlines()[0]}{where}); fix it"
        ) from None
    if not isinstance(data, dict):
        raise M2DError(f"{path} must be a mapping of keys (name:, model:, grid: ...)")
    base = data.pop("include", None)
    if base is None:
        return data
    base_path = (path.parent / base).resolve()
    if base_path in seen:
        raise M2DError(f"{path}: include cycle through {base_path}")
    return _merge(_read_yaml(base_path, seen + (path.resolve(),)), data)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _set_path(raw: dict, keys: list[str], value: Any) -> None:
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise M2DError(f"override {'.'.join(keys)}: {k} is not a section")
    node[keys[-1]] = value


#: keys a config no longer takes -> what to write instead
RENAMED = {
    "distill.dtype": (
        "distill.precision: bfloat16 -> bf16-mixed (float32 master weights and optimizer states; bf16-pure for "
        "bfloat16 ones), float32 -> fp32, auto -> auto"
    ),
}


def _build(cls, raw: Any, where: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise M2DError(f"{where or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        path = f"{where}{key}"
        if path in RENAMED:
            raise M2DError(f"{path} is now {RENAMED[path]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f" did you mean {where}{close[0]}?" if close else ""
            raise M2DError(f"unknown config key {path!r};{hint} known keys here: {', '.join(names)}")
        hint = hints[key]
        kwargs[key] = _build(hint, value, f"{path}.") if dataclasses.is_dataclass(hint) else _coerce(value, hint, path)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Check/convert a YAML value against a field's type hint (str | None, int, tuple[str, ...], ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for alt in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, alt, path)
            except M2DError as exc:
                errors.append(str(exc))
        raise M2DError(errors[-1])
    if origin is Literal:  # membership is the section check's, which names the closest value
        if type(value) in {type(a) for a in args}:
            return value
        raise M2DError(f"{path}={value!r}: write one of {', '.join(map(str, args))}")
    if origin is dict:
        if not isinstance(value, dict):
            raise M2DError(f"{path}={value!r} should be a mapping such as {{gpu_h100_8x: 55.04}}")
        return {str(k): _coerce(v, args[1], f"{path}.{k}") for k, v in value.items()}
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce(v, args[0], path) for v in items)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }
    if hint in ok and ok[hint](value):
        return float(value) if hint is float else value
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    name = getattr(hint, "__name__", hint)
    raise M2DError(f"{path}={value!r} should be {name}: give a{'n' * (str(name)[0] in 'aeiou')} {name}")


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def dump_config(cfg: SweepConfig, path: str | Path) -> None:

    write_text_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
