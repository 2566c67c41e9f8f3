"""What `stage2.targets` names, without torch: the modes, their parsing and checks against the loss, and the bytes
they store per token. A config and the plan read this; `distill/targets.py` makes and reads the targets.
"""

from __future__ import annotations

from dataclasses import dataclass

from m2d_ray.catalog.distill import LOSSES
from m2d_ray.errors import M2DError

#: stage2.targets' modes: the teacher runs beside every student (online), or its outputs are cached once: its final
#: hidden states (exact), the top-K log-probabilities and the tail, or N sampled ids (approximate)
ONLINE, HIDDEN, TOPK, SAMPLED = "online", "hidden", "topk", "sampled"
MODES = (HIDDEN, TOPK, SAMPLED)  # the cached ones
DEFAULT_K = {TOPK: 64, SAMPLED: 64}
MAX_DRAWS = 255  # counts are uint8
MANIFEST = "manifest.json"
FINGERPRINT = ("teacher", "tokenizer", "tokens", "teacher_topk", "temperature")


@dataclass(frozen=True)
class TargetSpec:
    """What is cached per token: `mode` hidden (k = 0), topk (k = K) or sampled (k = N draws), at
    `temperature`; `seed` makes the draws of a sampled cache reproducible."""

    mode: str
    k: int
    temperature: float = 1.0
    seed: int = 0

    def __str__(self) -> str:
        return self.mode if self.mode == HIDDEN else f"{self.mode}:{self.k}"

    @property
    def exact(self) -> bool:
        """The student's loss is the online one (the teacher's logits recomputed from its states)."""
        return self.mode == HIDDEN


def parse_targets(text: str, temperature: float = 1.0, seed: int = 0) -> TargetSpec | None:
    """`online` -> None; `hidden` -> TargetSpec("hidden", 0) (temperature and seed do not change hidden states:
    one cache serves every temperature); `topk`, `topk:K`, `sampled`, `sampled:N` -> a TargetSpec (K and N
    default to 64)."""
    mode, colon, k = str(text).strip().partition(":")
    if mode == ONLINE and not colon:
        return None
    if mode == HIDDEN and not colon:
        return TargetSpec(HIDDEN, 0)
    usage = (
        "write online, hidden, topk[:K] (K >= 1), sampled[:N] (1 <= N <= 255) or auto (the plan's exact choice), "
        "e.g. hidden or sampled:64"
    )
    if mode not in MODES or mode == HIDDEN:
        raise M2DError(f"stage2.targets={text!r}: unknown mode {mode!r}; {usage}")
    try:
        n = int(k) if colon else DEFAULT_K[mode]
    except ValueError:
        raise M2DError(f"stage2.targets={text!r}: {k!r} is not a whole number; {usage}") from None
    if n < 1 or (mode == SAMPLED and n > MAX_DRAWS):
        raise M2DError(
            f"stage2.targets={text!r}: {mode} needs 1 <= {'K' if mode == 'topk' else 'N'}"
            f"{'' if mode == 'topk' else ' <= 255 (counts are stored as uint8)'}; {usage}"
        )
    return TargetSpec(mode, n, float(temperature), int(seed))


def mode_of(spec: TargetSpec | None) -> str:
    """The training mode a student trains in: online (no cached targets), else the cache's mode; what DistillStep's
    batches, StudentLoss's loss and the kernel's choice all read."""
    return ONLINE if spec is None else spec.mode


def check_targets_loss(loss: str, spec: TargetSpec | None) -> None:
    """Cached hidden states give the teacher's whole output distribution: every loss of it (fkl, rkl) trains
    from them. Top-K and sampled targets keep a few log-probs per token: only the forward KL. No cache keeps
    the teacher's intermediate layers (fkl+mse)."""
    if spec is None or loss not in LOSSES:  # online, or an unknown loss (check_distill names it)
        return
    kind, with_states = LOSSES[loss]
    if with_states:
        raise M2DError(
            f"distill.loss={loss} needs the teacher's hidden states of every layer, which no cache keeps; "
            "use stage2.targets=online or distill.loss=fkl"
        )
    if kind != "fkl" and not spec.exact:
        raise M2DError(
            f"distill.loss={loss} needs the teacher's full distribution; use stage2.targets=hidden (exact) or online"
        )


def bytes_per_token(spec: TargetSpec, state_bytes: int = 0) -> int:
    """Stored bytes per token:
        hidden     d x the teacher's dtype bytes (`state_bytes`; Qwen3-30B-A3B in bf16: 2,048 x 2 = 4,096)
        topk:K     K x 4 (int32 ids) + K x 2 (fp16 log-probs) + 4 (fp32 tail)  = 6K + 4  (topk:64: 388)
        sampled:N  N x 4 (int32 ids) + N x 1 (uint8 counts) + N x 2 (fp16 log-probs) = 7N  (sampled:64: 448)
    int32 ids because vocabularies exceed 65,536 (Qwen3: 151,936)."""
    if spec.mode == HIDDEN:
        if state_bytes < 1:
            raise ValueError("hidden targets: bytes_per_token needs the state's bytes (hidden size x dtype bytes)")
        return int(state_bytes)
    return 6 * spec.k + 4 if spec.mode == TOPK else 7 * spec.k


TARGET_SHARD_BYTES = (
    128 << 20
)  # one target shard (topk:64 at seq_len 4096: 80 blocks; hidden, d 2048 in bf16: 8 blocks)


def blocks_per_shard(seq_len: int, per_token: int) -> int:
    """Blocks in one target shard: the targets pass's unit of work (one actor call) and of resume."""
    return max(1, TARGET_SHARD_BYTES // (seq_len * per_token))


def state_bytes(hidden_size: int, gpu: bool) -> int:
    """Bytes of one token's final hidden state as the targets pass stores it: the dtype the pass runs the
    teacher in, bf16 on a GPU and fp32 on CPU (a layer-streamed teacher runs in its checkpoint's dtype)."""
    return hidden_size * (2 if gpu else 4)


def loss_metric(spec: TargetSpec | None) -> str:
    """The name a student's training loss is reported under: top-K's bucketed KL is a lower bound of the true
    KL, so it never shares a curve with the exact (online, hidden) or unbiased (sampled) losses."""
    return "train_loss_buckets" if spec is not None and spec.mode == TOPK else "train_loss"
