"""Cached teacher targets: the teacher runs once over the training blocks, students train from its outputs.

`stage2.targets` picks what is kept per token (`parse_targets`):
    online       the teacher runs beside every student (no cache; every loss works);
    hidden       the teacher's final hidden state (after its final norm, in the dtype it runs in): a student's
                 rank recomputes the teacher's exact logits through the teacher's output head alone
                 (arch/head.py), chunk by chunk inside the KL, so every loss of the output distribution works
                 (fkl, rkl, any temperature) at d x bytes per token;
    topk[:K]     the K most likely ids, their log-probs and the log of the rest (`losses.sparse_kl`; its
                 loss is the KL over K+1 buckets, a lower bound of the true KL, logged as train_loss_buckets);
    sampled[:N]  N ids drawn from the teacher's distribution, kept as distinct ids and counts
                 (Sparse Logit Sampling, Anshumann et al., ACL 2025: an unbiased gradient; `losses.sampled_kl`).
topk and sampled targets are made at the distillation temperature t (log-softmax of logits / t); hidden
states depend on no temperature. Targets are stored per global block of seq_len tokens, in safetensors
shards ([blocks, seq_len, ...] tensors) listed with their sha256 in a `TargetsManifest`, which also records
what they were made from, so that a run cannot read another teacher's, tokenizer's, token stream's,
routing's or temperature's targets.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from m2d_ray.artifacts import sha256_bytes, write_json_atomic, write_text_atomic
from m2d_ray.catalog.distill import AUTO  # noqa: F401  (re-exported)
from m2d_ray.catalog.targets import (  # noqa: F401  (the light part; re-exported for the code that makes targets)
    DEFAULT_K,
    FINGERPRINT,
    HIDDEN,
    MANIFEST,
    MAX_DRAWS,
    MODES,
    SAMPLED,
    TARGET_SHARD_BYTES,
    TOPK,
    TargetSpec,
    blocks_per_shard,
    bytes_per_token,
    check_targets_loss,
    loss_metric,
    parse_targets,
    state_bytes,
)
from m2d_ray.distill.losses import log_probs
from m2d_ray.errors import M2DError


def block_generator(seed: int, block: int) -> torch.Generator:
    """The CPU generator of one global block's draws: the same (seed, block) gives the same draws on any
    worker, in any batch of blocks, at any chunk size."""
    digest = hashlib.sha256(f"m2d-targets:{seed}:{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def teacher_targets(
    h_t: Tensor, w_t: Tensor | None, spec: TargetSpec, first_block: int = 0, chunk: int = 1024
) -> dict[str, Tensor]:
    """The targets of B consecutive global blocks first_block.. from the teacher's final hidden states
    h_t [B, L, d] and output projection w_t [V, d]; tensors [B, L, ...] on h_t's device (the shard layout).
    Hidden targets are the states themselves (no head: None).

    Logits are formed `chunk` tokens at a time (peak ~3 x chunk x V floats), never for all tokens at once.
    """
    if spec.mode == HIDDEN:
        return {"hidden": h_t}
    b, length, _ = h_t.shape
    k, dev, t = spec.k, h_t.device, float(spec.temperature)
    if spec.mode == TOPK and k > w_t.shape[0]:
        raise M2DError(
            f"stage2.targets={spec}: K is larger than the teacher's vocabulary ({w_t.shape[0]}); use a smaller K"
        )
    if spec.mode == TOPK:
        out = {
            "ids": torch.empty(b, length, k, dtype=torch.int32, device=dev),
            "logp": torch.empty(b, length, k, dtype=torch.float16, device=dev),
            "tail": torch.empty(b, length, dtype=torch.float32, device=dev),
        }
    else:
        out = {
            "ids": torch.zeros(b, length, k, dtype=torch.int32, device=dev),
            "counts": torch.zeros(b, length, k, dtype=torch.uint8, device=dev),
            "logp": torch.zeros(b, length, k, dtype=torch.float16, device=dev),
        }
    with torch.no_grad():
        for i in range(b):
            # a block's uniforms are drawn whole, before chunking, so chunk size cannot change the draws
            u = (
                torch.rand(length, k, generator=block_generator(spec.seed, first_block + i), dtype=torch.float64).to(
                    dev
                )
                if spec.mode == SAMPLED
                else None
            )
            for s in range(0, length, chunk):
                lp = log_probs(h_t[i, s : s + chunk], w_t, t)
                rows = {name: x[i, s : s + chunk] for name, x in out.items()}
                if spec.mode == TOPK:
                    _topk(lp, k, **rows)
                else:
                    _sampled(lp, u[s : s + chunk], **rows)
    return out


def _topk(lp: Tensor, k: int, ids: Tensor, logp: Tensor, tail: Tensor) -> None:
    """The K largest log-probs and log(1 - their mass), the latter as a logsumexp over the other tokens
    (exact however close the mass is to 1, -inf when K = V); overwrites lp."""
    values, idx = lp.topk(k, dim=-1)
    ids.copy_(idx)
    logp.copy_(values)
    tail.copy_(lp.scatter_(1, idx, -math.inf).logsumexp(-1))


def _sampled(lp: Tensor, u: Tensor, ids: Tensor, counts: Tensor, logp: Tensor) -> None:
    """N draws per row by inverting the float64 CDF at float64 uniforms u [rows, N], stored as ascending
    distinct ids, their counts and log-probs, then padding (id 0, count 0, log-prob 0).

    float64 throughout: a float32 CDF near 1 moves in steps of 6e-8, so at a 151,936-token vocabulary every
    token whose probability falls below that step adds nothing to the sum and can never be drawn (thousands
    of ids, 1e-4 of the mass); float32 uniforms likewise take only 2^24 values. In float64 the smallest
    drawable probability is ~1e-16 of the row's mass."""
    cdf = lp.double().exp().cumsum_(-1)  # out of place: a float64 lp is its own .double(), read again below
    draws = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=lp.shape[1] - 1)
    draws, _ = draws.sort(dim=-1)
    first = torch.ones_like(draws, dtype=torch.bool)
    first[:, 1:] = draws[:, 1:] != draws[:, :-1]
    slot = first.long().cumsum_(-1).sub_(1)  # where each draw's distinct id goes
    counts.copy_(torch.zeros_like(draws).scatter_add_(1, slot, torch.ones_like(draws)))
    distinct = torch.zeros_like(draws).scatter_(1, slot, draws)
    ids.copy_(distinct)
    logp.copy_(torch.where(counts > 0, lp.gather(1, distinct), 0.0))


def fingerprint(
    spec: TargetSpec, teacher: str, tokenizer: str, tokens: str, teacher_topk: int | None, temperature: float
) -> dict:
    """What targets of `spec` depend on besides the spec: teacher, tokenizer, the token manifest's sha256, the
    teacher's (expanded) routing k' (None = its own k) and the temperature (None for hidden states, which
    every temperature shares). The pass and a student's rank both build it, each from its own settings."""
    return {
        "teacher": str(teacher),
        "tokenizer": str(tokenizer),
        "tokens": str(tokens),
        "teacher_topk": None if teacher_topk is None else int(teacher_topk),
        "temperature": None if spec.exact else float(temperature),
    }


@dataclass(frozen=True)
class ShardEntry:
    """One shard file: global blocks first_block .. first_block + blocks - 1, and its sha256."""

    file: str
    first_block: int
    blocks: int
    sha256: str


def shard_name(first_block: int) -> str:
    return f"targets-{first_block:09d}.safetensors"


def write_shard(directory: str | Path, first_block: int, targets: dict[str, Tensor]) -> ShardEntry:
    """Write one shard (the tensors of `teacher_targets`) through a temp file + rename, so a reader sees
    the whole file or none; the sha256 is of the bytes written."""
    data = save_tensors({name: x.detach().cpu().contiguous() for name, x in targets.items()})
    name = shard_name(first_block)
    write_text_atomic(Path(directory) / name, data)
    return ShardEntry(name, int(first_block), int(next(iter(targets.values())).shape[0]), sha256_bytes(data))


def read_shard(directory: str | Path, entry: ShardEntry) -> dict[str, Tensor]:
    """The shard's tensors, after checking its sha256 against the manifest's (truncation, corruption)."""
    path = Path(directory) / entry.file
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise M2DError(
            f"targets shard {path} is missing; compute the targets again or use stage2.targets=online"
        ) from None
    actual = sha256_bytes(data)
    if actual != entry.sha256:
        raise M2DError(
            f"targets shard {path} is truncated or corrupted: sha256 {actual}, manifest says {entry.sha256} "
            f"({len(data)} bytes); compute the targets again or use stage2.targets=online"
        )
    return load_tensors(data)


@dataclass(frozen=True)
class TargetsManifest:
    """A directory of target shards: the spec, what they were made from, seq_len and the shards, which
    tile global blocks 0..blocks-1 in order. `where` names the directory in messages (not stored)."""

    spec: TargetSpec
    fingerprint: dict
    seq_len: int
    shards: tuple[ShardEntry, ...]
    where: str = ""

    def __post_init__(self) -> None:
        start = 0
        for s in self.shards:
            if s.first_block != start or s.blocks < 1:
                raise M2DError(
                    f"targets manifest in {self.where or 'this directory'}: shard {s.file} holds blocks from "
                    f"{s.first_block}, "
                    f"expected {start} (shards must tile blocks 0.. in order); compute the targets again"
                )
            start += s.blocks

    @property
    def blocks(self) -> int:
        return sum(s.blocks for s in self.shards)

    def to_json(self) -> dict:
        return {
            "spec": {
                "mode": self.spec.mode,
                "k": self.spec.k,
                "temperature": self.spec.temperature,
                "seed": self.spec.seed,
            },
            "fingerprint": self.fingerprint,
            "seq_len": self.seq_len,
            "blocks": self.blocks,
            "shards": [vars(s) for s in self.shards],
        }

    def save(self, directory: str | Path) -> None:
        write_json_atomic(Path(directory) / MANIFEST, self.to_json())

    @classmethod
    def load(cls, directory: str | Path, where: str | None = None) -> TargetsManifest:
        """Read DIR/manifest.json; `where` (default: the directory) is how messages name the targets."""
        path = Path(directory) / MANIFEST
        where = str(directory) if where is None else where
        try:
            d = json.loads(path.read_text())
            return cls(
                TargetSpec(**d["spec"]),
                d["fingerprint"],
                int(d["seq_len"]),
                tuple(ShardEntry(**s) for s in d["shards"]),
                where,
            )
        except FileNotFoundError:
            raise M2DError(
                f"no targets manifest in {where} ({MANIFEST}); compute the targets first or use stage2.targets=online"
            ) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise M2DError(
                f"targets manifest {path} is unreadable ({type(exc).__name__}: {exc}); compute the targets again"
            ) from None

    def check_matches(self, expected: dict, spec: TargetSpec | None = None) -> None:
        """Refuse targets made from anything else than this run's teacher, tokenizer, tokens, routing k' and
        temperature (`fingerprint(...)`), or, given `spec`, of another mode or size."""
        theirs = f"targets in {self.where or 'this directory'}"
        diffs = [
            f"{f} {self.fingerprint.get(f)!r}, this run's is {expected[f]!r}"
            for f in FINGERPRINT
            if self.fingerprint.get(f) != expected[f]
        ]
        if diffs:
            raise M2DError(
                f"{theirs} were made with {'; '.join(diffs)}; compute targets for this run (another directory) or use "
                "stage2.targets=online"
            )
        if spec is not None and (spec.mode, spec.k) != (self.spec.mode, self.spec.k):
            raise M2DError(
                f"{theirs} are {self.spec}, this run asks for {spec}; compute {spec} targets (another directory) or "
                f"ask for {self.spec}"
            )

    def locate(self, block: int) -> tuple[ShardEntry, int]:
        """The shard holding global block `block` and the block's index in it."""
        starts = [s.first_block for s in self.shards]
        i = bisect.bisect_right(starts, block) - 1
        if i < 0 or block >= starts[i] + self.shards[i].blocks:
            raise M2DError(
                f"targets in {self.where or 'this directory'} cover blocks 0..{self.blocks - 1}, not block {block}; "
                "compute targets for more blocks or train fewer steps"
            )
        return self.shards[i], block - starts[i]
