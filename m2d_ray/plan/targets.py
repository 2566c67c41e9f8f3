"""How each stage-2 teacher gives its students their targets, and what that costs besides the FLOPs: the arithmetic of
`stage2.targets` (a mode for every teacher, or `auto`), `stage2.shard_teacher`, the storage a cached mode fills and
reads, and the gathers of a sharded teacher.

A teacher is the MoE teacher (key `teacher`) or a baseline's own (its stage-3 key, `teacher-d2d`). `TeacherTargets`
is one teacher's choice: a mode (online, hidden, topk:K, sampled:N) and, online, whether it is sharded over a
student's ranks. With `auto` the plan chooses per teacher (pipeline.choose_targets) the cheapest exact candidate that
fits: `hidden` (one pass, its states stored for the run and read by every student) or online (its forward once per
student, nothing stored; sharded when a whole teacher does not fit a rank). A teacher that serves one student never
stores states (the pass would cost its forward once anyway, plus the storage).

Storage kinds and their defaults (`plan.read_bandwidth`, `plan.tb_month` override them by kind):

    kind     storage:                        read by a student           $ per TB-month
    local    none (the run directory)        2 GB/s (NVMe)               0 (the node's own disk, in its price)
    shared   a path (every node mounts it)   1 GB/s (NFS/EFS)            300 (EFS Standard)
    object   s3://, gs://                    0.5 GB/s (a node's copy)    23 (S3 Standard)

A sharded teacher's ranks all-gather its whole weights once per micro-batch forward (reshard after forward), each
receiving (N - 1)/N of them: at `plan.nvlink_bandwidth` (300 GB/s a GPU, H100 NVLink 4's 450 GB/s a direction at
NCCL's ~2/3) when a student's ranks share a node, else at `plan.network_bandwidth` (25 GB/s a GPU: half of a
p5.48xlarge's 3,200 Gb/s EFA over its 8 GPUs); the plan adds that time to the student's, with no overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from m2d_ray.catalog.distill import AUTO
from m2d_ray.catalog.targets import ONLINE, TargetSpec, bytes_per_token, parse_targets, state_bytes
from m2d_ray.plan.shapes import Shape
from m2d_ray.storage import is_remote

MOE = "teacher"  # the MoE teacher's key (stage 3's); a baseline's own teacher is keyed by its teacher_key
READ_BANDWIDTH = {"local": 2.0e9, "shared": 1.0e9, "object": 5.0e8}
TB_MONTH = {"local": 0.0, "shared": 300.0, "object": 23.0}
HOURS_A_MONTH = 730.0


@dataclass(frozen=True)
class TeacherTargets:
    """One teacher's targets: `mode` online | hidden | topk:K | sampled:N, `shard` (online: over a student's ranks),
    and, when the plan chose it (`auto`), why."""

    mode: str = ONLINE
    shard: bool = False
    why: str = ""

    def spec(self, temperature: float = 1.0, seed: int = 0) -> TargetSpec | None:
        return parse_targets(self.mode, temperature, seed)

    @property
    def kind(self) -> str:
        """online, hidden, topk or sampled (what the memory and FLOPs of a rank depend on)."""
        return self.mode.partition(":")[0]

    @property
    def stores(self) -> bool:
        """Whether its outputs are cached (a targets pass and storage), not computed beside each student."""
        return self.mode != ONLINE

    @property
    def label(self) -> str:
        return f"{self.mode}, sharded" if self.shard else self.mode

    def to_json(self) -> dict:
        return {"targets": self.mode, "shard_teacher": self.shard, **({"why": self.why} if self.why else {})}

    @classmethod
    def from_json(cls, d: dict) -> TeacherTargets:
        return cls(d["targets"], bool(d["shard_teacher"]), d.get("why", ""))


def recorded(plan: dict | None) -> dict[str, TeacherTargets]:
    """The teachers' targets a run's plan (memory_plan.json) chose."""
    return {k: TeacherTargets.from_json(v) for k, v in ((plan or {}).get("targets") or {}).items()}


def configured(cfg, keys) -> dict[str, TeacherTargets]:
    """The config's choice for every teacher in `keys` (an explicit stage2.targets; empty under auto)."""
    if cfg.stage2.targets == AUTO:
        return {}
    mode = str(cfg.target_spec() or ONLINE)
    return {k: TeacherTargets(mode, cfg.stage2.shard_teacher and mode == ONLINE) for k in keys}


def per_token(t: TeacherTargets, teacher: Shape, cfg) -> int:
    """Bytes a token's cached targets of `teacher` take (0 online); hidden states in the pass's dtype."""
    spec = t.spec(cfg.distill.temperature)
    return bytes_per_token(spec, state_bytes(teacher.hidden, cfg.ray.data_gpus_per_actor > 0)) if spec else 0


def storage_kind(storage: str | None) -> str:
    """local (the run directory: `storage` None), shared (a path given: one every node mounts), object (a URL)."""
    if storage is None:
        return "local"
    return "object" if is_remote(storage) else "shared"


def read_bandwidth(cfg, kind: str) -> float:
    return {**READ_BANDWIDTH, **cfg.plan.read_bandwidth}[kind]


def storage_dollars(cfg, kind: str, nbytes: float, seconds: float | None) -> float | None:
    """What `nbytes` kept for `seconds` cost at the kind's price a TB-month (None: the run's length unknown)."""
    if seconds is None:
        return None
    return nbytes / 1e12 * {**TB_MONTH, **cfg.plan.tb_month}[kind] * seconds / 3600 / HOURS_A_MONTH


def gather_seconds(cfg, teacher: Shape, steps: float, one_node: bool) -> float:
    """Seconds one rank spends all-gathering a sharded teacher over `steps` optimizer steps: (N - 1)/N of its weights
    (in the training dtype) per micro-batch forward, at the interconnect of a student's ranks."""
    x = cfg.distill
    b = 2 if x.gpus_per_worker > 0 else 4
    per_forward = teacher.params * b * (x.workers - 1) / x.workers
    bandwidth = cfg.plan.nvlink_bandwidth if one_node else cfg.plan.network_bandwidth
    return steps * x.grad_accum * per_forward / bandwidth
