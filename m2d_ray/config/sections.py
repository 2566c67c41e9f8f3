"""The run-wide sections of a config: the calibration and perplexity texts, stage 1's grid and search, Ray, MLflow,
the plan's prices and the fault drills (each a frozen dataclass; its fields' defaults and docs written once, `setting`).
"""

from __future__ import annotations

from dataclasses import dataclass

from m2d_ray import measured
from m2d_ray.catalog.distill import AUTO
from m2d_ray.catalog.methods import GROUPINGS, SCALINGS, SCORINGS
from m2d_ray.catalog.units import ACTOR, MODEL, STUDENT, TRIAL
from m2d_ray.config.fields import Auto, names, setting


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
        f"scorings ({names(SCORINGS)}); default every registered one",
    )
    grouping: tuple[str, ...] = setting(
        tuple(GROUPINGS),
        f"groupings ({names(GROUPINGS)}); default every registered one",
    )
    scaling: tuple[str, ...] = setting(
        ("uniform", "proportional"),
        f"scalings of the merged experts' down-projections ({names(SCALINGS)})",
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
        "pin the calibration and targets passes to a GPU type (Ray's accelerator_type, e.g. H100); unset: the plan "
        "places them on the cheapest GPU type of the cluster's whose GPU holds an actor (the run's config records it)",
    )
    cpus_per_trial: float = setting(1.0, "CPUs of a stage-1 trial")
    gpus_per_trial: float | Auto = setting(
        0.0,
        "GPUs of a stage-1 trial (fractional: trials share one device); auto = the smallest share of a GPU (1/8, "
        "1/4, 1/2, 1) whose trial fits, on the pinned GPU type, else on the cluster's type that holds it, else the "
        "fewest whole GPUs of one node (2, 4, 8) the student's layers are spread over in order (the plan decides it, "
        "with ray.trial_accelerator, and the run's config records both); one whole GPU where no plan did",
    )
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

    @property
    def trial_gpus(self) -> float:
        """A stage-1 trial's GPUs: as set or decided by the plan; `auto` where no plan decided it: one GPU."""
        return 1.0 if self.gpus_per_trial == AUTO else float(self.gpus_per_trial)


@dataclass(frozen=True)
class TrackConfig:
    """MLflow: where the run's parent run and its nested runs are logged."""

    tracking_uri: str | None = setting(
        None,
        "the tracking server or store; None = sqlite:///RUN_DIR/mlflow.db (--tracking-uri overrides it)",
    )
    experiment: str = setting("m2d", "the MLflow experiment the run's parent run belongs to")


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
