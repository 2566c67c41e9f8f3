"""Where and how big: the devices and batch size of one lm-eval run, from an estimate of its memory.

lm-eval scores a batch by one forward over padded sequences and a log-softmax over the whole vocabulary,
so besides the weights every sequence of a batch costs about

    logits, their log-softmax, and the previous   seq × vocab × 3·b
    batch's log-softmax (lm-eval keeps it bound while the next batch runs)
    key/value cache (HF models keep one)             2 × layers × seq × kv_heads × head_dim × b
    activations of one layer                         seq × (8·hidden + 3·max(ffn, k·d_expert)) × b

(b = bytes per weight, 2 in bf16; benchmarks/perf/memory_plan.py holds this to the measured peak). Qwen3-30B-A3B at
4,096 tokens: 4.1 GiB a sequence, beside 56.9 GiB of
weights — batch 16 on one 80 GB GPU is ~123 GiB, which is why stage 3 used to fail there. It gets two
80 GB GPUs (sharded) and batch 8.

`plan_eval` picks the fewest GPUs of a node on which the weights (spread evenly by an accelerate device map)
plus a batch of MIN_BATCH sequences fit (else plus one sequence), and the batch that fits beside them; a model that fits
on no number of the node's
GPUs fails with one line before anything is loaded. A model that fits a fraction of a GPU keeps the
configured fraction (small students share GPUs). On CPU (no GPU) nothing is sharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from m2d_ray.arch.counts import attention_widths
from m2d_ray.arch.meta import param_counts
from m2d_ray.catalog.distill import AUTO
from m2d_ray.errors import M2DError

GiB = 1 << 30
RESERVE = 1 * GiB  # CUDA context, allocator slack
UTILISATION = 0.9  # of a GPU's memory given to weights + batch
MAX_BATCH = 64  # lm-eval's own default max_batch_size
MIN_BATCH = 4  # GPUs are added (sharding) until this many sequences fit beside the weights, when a node allows
DEFAULT_SEQ = (
    4096  # the longest sequence planned for (lm-eval's max_length for the run; longer contexts are left-truncated)
)


@dataclass(frozen=True)
class ModelSize:
    params: int
    bytes_per_param: int
    vocab: int
    hidden: int
    layers: int
    kv_heads: int
    head_dim: int
    ffn: int  # the widest FFN activation of a token (dense width, or k x d_expert for an MoE)

    @property
    def weights(self) -> int:
        return self.params * self.bytes_per_param

    def sequence_bytes(self, seq: int) -> int:
        b = self.bytes_per_param
        logits = 3 * seq * self.vocab * b  # no fp32 upcast: transformers 5 returns logits in the weights' dtype
        kv = 2 * self.layers * seq * self.kv_heads * self.head_dim * b
        act = seq * (8 * self.hidden + 3 * self.ffn) * b
        return logits + kv + act

    def generation_bytes(self, prompt: int, length: int) -> tuple[int, int]:
        """(bytes of one generated sequence that spread with the layers over sharded GPUs, bytes that do not):
        its key/value cache at full `length`, and the prompt's activations of one layer during the prefill beside
        the last position's logits in float32 (generate keeps one position's, with their processed copy and the
        probabilities)."""
        b = self.bytes_per_param
        kv = 2 * self.layers * length * self.kv_heads * self.head_dim * b
        return kv, prompt * (8 * self.hidden + 3 * self.ffn) * b + 3 * self.vocab * 4


@dataclass(frozen=True)
class EvalPlacement:
    gpus: float  # what to ask Ray for (0 on CPU; a fraction only when the model fits in it)
    shard: bool  # spread the weights over `gpus` GPUs with an accelerate device map
    batch_size: int | str  # an int, or "auto" (lm-eval searches down from max_batch_size on OOM)
    max_batch_size: int  # the batch the estimate says fits
    max_length: int  # the sequence length planned for (lm-eval's max_length)
    max_memory_per_gpu: int | None  # bytes of weights per GPU for the device map (sharded only)
    weights: int
    sequence: int
    #: the model read a decoder layer at a time (no node holds it; forward passes only: the teacher judge's scores)
    streamed: bool = False

    def describe(self) -> str:
        where = f"{self.gpus:g} GPU" + ("s, sharded" if self.shard else "") if self.gpus else "CPU"
        where += ", streamed a decoder layer at a time" if self.streamed else ""
        return (
            f"{where}; weights {_gib(self.weights)}, {_gib(self.sequence)} per {self.max_length}-token sequence, "
            f"batch {self.batch_size}" + (f" (at most {self.max_batch_size})" if self.batch_size == AUTO else "")
        )


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def model_size(config, dtype_bytes: int | None = None) -> ModelSize:
    """Parameters counted from the config (arch/meta.param_counts: no weights read), and the shapes the batch estimate
    needs."""

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = param_counts(config).params
    if dtype_bytes is None:
        dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype_bytes = 4 if str(dt).endswith("float32") else 2
    _, kv_width, _, kv_heads = attention_widths(text)
    k = getattr(text, "num_experts_per_tok", None) or 1
    moe = getattr(text, "moe_intermediate_size", None)
    ffn = max(getattr(text, "intermediate_size", 0) or 0, k * moe if moe else 0)
    return ModelSize(
        params,
        dtype_bytes,
        text.vocab_size,
        text.hidden_size,
        text.num_hidden_layers,
        kv_heads,
        kv_width // kv_heads,  # a layer's key/value width (averaged where layers differ: Gemma-4) over its heads
        ffn,
    )


def plan_eval(
    size: ModelSize,
    gpu_bytes: int | None,
    gpus_per_node: int = 1,
    batch_size: int | str = 16,
    batch_memory: int | None = None,
    gpu_fraction: float | None = None,
    max_length: int = DEFAULT_SEQ,
    host_bytes: int | None = None,
    what: str = "the model",
) -> EvalPlacement:
    """The placement of one evaluation (see the module docstring).

    gpu_bytes: one GPU's memory (None = CPU); gpus_per_node: the most GPUs one node has; batch_size: the
    configured batch (an int is lowered to what fits; "auto" = lm-eval's search below the estimate);
    batch_memory: a budget for the batch (bytes, e.g. from a memory plan), used instead of what is left;
    gpu_fraction: the configured share of a GPU (stage3.gpus_per_task < 1), kept when the model fits it."""
    seq = size.sequence_bytes(max_length)
    if gpu_bytes is None:  # CPU: nothing to shard; "auto" from the host's memory
        fit = MAX_BATCH if host_bytes is None else max(1, min(MAX_BATCH, (host_bytes - size.weights) // seq))
        if batch_memory is not None:
            fit = max(1, min(fit, batch_memory // seq))
        batch = fit if batch_size == AUTO else min(int(batch_size), fit)
        return EvalPlacement(0, False, batch, fit, max_length, None, size.weights, seq)
    usable = gpu_bytes * UTILISATION - RESERVE
    least = min(MIN_BATCH, MAX_BATCH if batch_size == AUTO else int(batch_size))
    if gpu_fraction is not None and 0 < gpu_fraction < 1:
        share = gpu_bytes * gpu_fraction * UTILISATION - RESERVE
        if size.weights + least * seq <= share:
            return _batch(
                size, seq, gpu_fraction, False, share - size.weights, None, batch_size, batch_memory, max_length
            )
    for need in (least, 1):  # the fewest GPUs that hold a useful batch; else the fewest that hold one sequence
        for g in range(1, max(1, gpus_per_node) + 1):
            per_gpu = size.weights / g * (1.05 if g > 1 else 1.0)  # a device map is not perfectly even
            free = usable - per_gpu
            if free >= need * seq:
                cap = math.ceil(per_gpu) if g > 1 else None
                return _batch(size, seq, g, g > 1, free, cap, batch_size, batch_memory, max_length)
    raise M2DError(
        f"{what} does not fit: {size.weights / GiB:.1f} GiB of weights + {seq / GiB:.2f} GiB for one "
        f"{max_length}-token "
        f"sequence need more than {gpus_per_node} GPU(s) of {gpu_bytes / GiB:.0f} GiB (usable {usable / GiB:.1f} GiB "
        "each); "
        "use nodes with more or bigger GPUs, or a shorter stage3.max_length"
    )


def plan_generation(
    size: ModelSize,
    gpu_bytes: int | None,
    gpus_per_node: int,
    batch: int,
    prompt: int,
    length: int,
    gpu_fraction: float | None = None,
    what: str = "the model",
) -> EvalPlacement:
    """The placement of a model that generates `batch` sequences of `length` tokens from prompts of `prompt` at once
    (the analysis): on a GPU the configured fraction when all of it fits there, else the fewest GPUs of a node on
    which the weights (spread evenly) and the whole batch fit; on CPU (`gpu_bytes` None) nothing is sharded."""
    spread, each = size.generation_bytes(prompt, length)
    seq = spread + each
    if gpu_bytes is None:
        return EvalPlacement(0, False, batch, batch, length, None, size.weights, seq)
    if gpu_fraction is not None and 0 < gpu_fraction < 1:
        if size.weights + batch * seq <= gpu_bytes * gpu_fraction * UTILISATION - RESERVE:
            return EvalPlacement(gpu_fraction, False, batch, batch, length, None, size.weights, seq)
    usable = gpu_bytes * UTILISATION - RESERVE
    for g in range(1, max(1, gpus_per_node) + 1):
        per_gpu = size.weights / g * (1.05 if g > 1 else 1.0)
        if per_gpu + batch * (spread / g + each) <= usable:
            return EvalPlacement(
                g, g > 1, batch, batch, length, math.ceil(per_gpu) if g > 1 else None, size.weights, seq
            )
    raise M2DError(
        f"{what} does not fit: {size.weights / GiB:.1f} GiB of weights + {batch} sequences of {length} tokens "
        f"({batch * seq / GiB:.2f} GiB) need more than {gpus_per_node} GPU(s) of {gpu_bytes / GiB:.0f} GiB; use a "
        "smaller stage3.analysis.batch_size or max_new_tokens, or nodes with more or bigger GPUs"
    )


def plan_streamed(
    size: ModelSize, gpu_bytes: int | None, batch: int, length: int, what: str = "the model"
) -> EvalPlacement:
    """A model no node holds, scoring sequences (forward passes only: the teacher judge's log-likelihoods) a decoder
    layer at a time on one GPU (calibrate/stream.py): there, its largest layer (its weights less the embedding and
    the head, over its layers) and then its output head, beside one batch's activations; the hidden states of every
    sequence wait on the host between layers."""
    b = size.bytes_per_param
    head = size.vocab * size.hidden * b
    layer = max(0, size.weights - 2 * head) // max(1, size.layers)
    seq = length * (8 * size.hidden + 3 * size.ffn) * b + length * size.vocab * 4
    if gpu_bytes is not None and max(layer, head) + batch * seq > gpu_bytes * UTILISATION - RESERVE:
        raise M2DError(
            f"{what} does not fit a decoder layer at a time either: {max(layer, head) / GiB:.1f} GiB + {batch} "
            f"sequences of {length} tokens on a GPU of {gpu_bytes / GiB:.0f} GiB; use a smaller batch"
        )
    return EvalPlacement(
        1 if gpu_bytes is not None else 0, False, batch, batch, length, None, max(layer, head), seq, True
    )


def _batch(size, seq, gpus, shard, free, cap, batch_size, batch_memory, max_length) -> EvalPlacement:
    fit = int(max(1, min(MAX_BATCH, free // seq)))
    if batch_memory is not None:
        fit = int(max(1, min(fit, batch_memory // seq)))
    batch = AUTO if batch_size == AUTO else min(int(batch_size), fit)
    return EvalPlacement(gpus, shard, batch, fit, max_length, cap, size.weights, seq)


def hflm_kwargs(p: EvalPlacement) -> dict:
    """HFLM arguments of a placement (besides pretrained/tokenizer/batch_size/device)."""
    out: dict = {"max_batch_size": p.max_batch_size, "max_length": p.max_length}
    if p.shard:
        out.update(parallelize=True, max_memory_per_gpu=p.max_memory_per_gpu)
    return out
