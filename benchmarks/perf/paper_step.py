"""The paper's student at its real shapes: what `m2d plan experiments/qwen3_30b_a3b.yaml` says of one stage-2 rank of
it, and a rehearsal of its whole step on `meta` tensors (shapes and dtypes only: nothing is computed or allocated), for
benchmarks/perf/distill_step.py (`--preset paper`, `--meta-rehearsal paper`).

The plan: the paper config at one rank (distill.workers=1, plain torch: at one rank ZeRO shards nothing), hidden
targets (what the plan chooses for the paper run), on a GPU of the given memory: its decided checkpointing and its
stage-2 rank's parts, the figures the GPU call holds the step's `max_memory_allocated` to.

The rehearsal: for each checkpointing policy, the student of the preset built on `meta` (48 layers, hidden 2048,
vocabulary 151,936), checkpointed as the policy says, one micro-batch of 4 x 4096 tokens forward, through the chunked
KL from cached hidden states and the teacher's head, and backward on the head's GPU branch (numerics.tensor_cores
forced), under a dispatch mode that adds up the bytes of every tensor the step creates while it lives: the peak of
what the student's activations, the KL's buffers and the gradients in flight hold, beside the plan's `activations` +
`kl` parts. Attention runs as the GPU's does: SDPA on `meta` would take its math path (a [T x T] matrix a head), so
the rehearsal's attention is the flash kernel's own op (its output and log-sum-exp kept, as on the GPU).
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.common import REPO  # noqa: F401
from workshop.step_paths import ONE_RANK, PAPER_CONFIG, PAPER_MODEL, POLICIES, paper_plan  # noqa: F401

#: the paper config at one rank, trained from cached hidden states


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages created under it that are still alive, and their peak: each op's outputs on a
    storage not seen before (a view or an in-place result shares its input's) are counted until that storage is freed
    (a finalizer on it: torch keeps a storage's Python object while any tensor, autograd's saved ones included, uses
    it); a storage made before the mode (a weight) is never counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._outside: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata not in self._seen:
                self._outside.add(a.untyped_storage()._cdata)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self._seen and key not in self._outside:
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def _flash_standin(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention by aten's flash kernel, as SDPA runs it on a GPU: the layer's own query, key and value as its
    attention hands them over (grouped key/value heads not repeated, no copy of the query: what the real layer keeps
    is what the stand-in keeps), its output and log-sum-exp kept for the backward."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def gpu_like_meta():
    """The head's GPU branch forced (numerics.tensor_cores), the flash stand-in registered as an attention
    implementation, and transformers' packed-sequence probe (a data-dependent check `meta` cannot answer; training
    blocks are packed without per-document positions) answered "none"."""
    import transformers.masking_utils as masking
    from transformers import AttentionInterface

    from m2d_ray import numerics

    AttentionInterface.register("m2d_meta_attention", _flash_standin)
    seam, probe = numerics.tensor_cores, masking.find_packed_sequence_indices
    numerics.tensor_cores, masking.find_packed_sequence_indices = (lambda t: True), (lambda position_ids: None)
    try:
        yield
    finally:
        numerics.tensor_cores, masking.find_packed_sequence_indices = seam, probe


def rehearse(p: dict, policy: str, drop_grads: bool = False) -> dict:
    """One micro-batch of preset `p`'s student on `meta` under checkpointing `policy`: the body's forward, the chunked
    KL from cached hidden states, the backward; the live bytes after the forward and their peak. `drop_grads`: each
    parameter's gradient freed as soon as it is formed, as ZeRO-3 reduce-scatters it into its partition."""
    from m2d_ray.distill import checkpointing
    from m2d_ray.distill.losses import chunked_kl
    from workshop.random_models import teacher_and_student

    t0 = time.perf_counter()
    teacher, student = teacher_and_student(p, torch.bfloat16, device="meta")
    student.set_attn_implementation("m2d_meta_attention")
    checkpointing.apply(student, policy)
    student.train()
    if drop_grads:
        for w in student.parameters():
            w.register_post_accumulate_grad_hook(lambda w: setattr(w, "grad", None))
    tokens = p["batch"] * p["seq_len"]
    ids = torch.zeros(p["batch"], p["seq_len"], dtype=torch.long, device="meta")
    h_t = torch.empty(tokens, p["hidden"], dtype=torch.bfloat16, device="meta")
    w_t = teacher.model.get_output_embeddings().weight.detach()
    with LiveBytes() as live:
        h = student.base_model(input_ids=ids, use_cache=False).last_hidden_state
        after_forward = live.live
        loss = chunked_kl(h.reshape(tokens, -1), student.get_output_embeddings().weight, h_t, w_t)
        loss.backward()
    w = student.get_output_embeddings().weight
    assert drop_grads or (w.grad is not None and w.grad.dtype == torch.bfloat16 and w.grad.shape == w.shape)
    return {
        "policy": policy,
        "after_forward_bytes": after_forward,
        "peak_bytes": live.peak,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def meta_rehearsal(p: dict) -> dict:
    """Every checkpointing policy of the preset on `meta`, each beside the plan's activations + KL for it (the plan
    of the paper config at one rank on an H200's 141 GB for the paper preset)."""
    from m2d_ray.plan import memory
    from m2d_ray.plan.shapes import models_of
    from workshop.random_models import preset_config

    student = models_of(preset_config(p)).student
    tokens = p["batch"] * p["seq_len"]
    out = {"tokens": tokens, "vocab": p["vocab"], "hidden": p["hidden"], "layers": p["layers"], "policies": {}}
    with gpu_like_meta():
        for policy in POLICIES:
            r = rehearse(p, policy)
            kl = memory.training(student, tokens, 2, 1, False, 2, policy, 1024, masters=True)["kl"]
            r["plan_bytes"] = memory.activations(student, tokens, 2, policy) + kl
            r["plan_ratio"] = round(r["plan_bytes"] / r["peak_bytes"], 3)
            out["policies"][policy] = r
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def rehearsal_lines(r: dict) -> list[str]:
    return [
        f"[meta {x['policy']}] live after the forward {gib(x['after_forward_bytes'])}, peak {gib(x['peak_bytes'])}; "
        f"plan activations + KL {gib(x['plan_bytes'])} ({x['plan_ratio']:.2f}x)"
        for x in r["policies"].values()
    ]


if __name__ == "__main__":  # the rehearsal alone: python -m benchmarks.perf.paper_step
    from workshop.random_models import STEP_PRESETS

    print("\n".join(rehearsal_lines(meta_rehearsal(STEP_PRESETS["paper"]))))
    print(paper_plan(141 * 10**9))
