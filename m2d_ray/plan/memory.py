"""Bytes per device of each stage, part by part: the arithmetic behind `m2d plan`.

Every function returns {part: bytes} for ONE device (a GPU, or on CPU the process's host memory), the
way the stage's code holds it (b = bytes per weight: the checkpoint's dtype for inference, bf16 for
training on a GPU and fp32 on CPU; T = tokens of a micro-batch):

    weights              params x b (a layer-streamed calibration: one layer + embeddings and head)
    ZeRO-2 (DeepSpeed)   gradients: b x P / W + an fp32 partition 4P / W (the micro-batches' sum: grad_accum_dtype
                         fp32 when b < 4) + one reduce bucket, and its float32 copy when b < 4 (the reduce runs
                         in float32: communication_data_type); optimizer: fp32 master copy (when b < 4) + Adam
                         moments = (4 + 8) P / W
    ZeRO-3 (DeepSpeed)   the weights b x P / W, gradients in one float32 partition 4P / W (stage3.py's
                         grad_partitions_flat_buffer, gradient_accumulation_dtype) + the reduce bucket as ZeRO-2's,
                         the optimizer as ZeRO-2's, plus what is gathered whole: the running and the prefetched layer
                         (or the embedding) and the head the KL reads
    ZeRO-0 (DeepSpeed)   gradients b P (+ 4P fp32 accumulators when b < 4); optimizer as ZeRO-2 at W = 1
    plain torch          gradients b P (DDP's buckets are views of them); with float32 masters (bf16-mixed,
                         distill/precision.py) the float32 sums 4P (each b-byte gradient added in and freed as
                         autograd makes it: the largest, the head's V h b, counted) and the masters and moments
                         (4 + 8) P, else AdamW's moments in the weights' dtype 2 b P
    activations          what a Qwen3 decoder layer's saved tensors hold per token (counted by a saved-tensors
                         hook on the real layer, tests/unit/test_activation_count.py): none: 6h + 4q + 4kv + 4f
                         b-byte elements (the norms' inputs, normalised values and outputs, q/k/v, their norms
                         and rotary embeddings, the attention's output, SwiGLU's gate, up, activation and
                         product), below float32 also the float32 copies the RMSNorms take (2h + q + kv more),
                         and float32 scalars: the norms' reciprocal RMS (2 + H + H_kv) and the attention's
                         log-sum-exp (H); selective (distill/checkpointing.py's SAC): its input h and the outputs
                         of its matmuls and attention but the down projection's (q, k, v, attention, o_proj,
                         gate, up: 2h + 2q + 2kv + 2f, + the log-sum-exp) plus one layer's recompute; full: each
                         layer's input h plus one layer recomputed
    KL buffers           the chunked loss keeps grad_h (T h b) and grad_W (V h, fp32) and forms 5 fp32
                         [chunk x V] tensors per chunk where it forms the teacher's logits (online, and from
                         cached hidden states), 3 from top-K / sampled targets (distill/losses.py)
    the teacher          online: all of it and its forward, or sharded over the W ranks: (params - head) b / W, the
                         head whole, one gathered layer and the gather's buffers (the next layer and the shard's
                         copy: layer b (1 + 1/W)); `hidden` targets: its output head (V h b) and a micro-batch of
                         states with the next one prefetched; top-K / sampled: their targets
    a forward            no-grad: logits T V b (calibration's full forward) or one chunk of them (the chunked
                         losses), plus a layer's transient T (4h + 2 ffn) b
    calibration Gram     all-expert outputs of a token chunk: the working set calibrate/stats.gram_chunk
                         bounds to 3 (CPU: 3/4) x one layer's expert bytes
    lm-eval              evaluate/placement.py (weights per GPU + batch x per-sequence bytes)
    CUDA                 context and allocator slack (placement.RESERVE) on a GPU; none on CPU

The constants are the tensors the code forms, not fits: tests/unit/test_plan_measured.py and
benchmarks/perf/memory_plan.py hold each estimate to within 25% of a measured peak.
"""

from __future__ import annotations

from m2d_ray.catalog.distill import ambiguous_down
from m2d_ray.catalog.targets import HIDDEN, ONLINE
from m2d_ray.plan.shapes import Shape

FP32 = 4
KL_TENSORS = {
    True: 5,
    False: 3,
}  # fp32 [chunk x V] tensors alive in one chunk of the KL: the student's logits, log-probs and
# gradient, and where the teacher's logits are formed (online, hidden states) also those and their log-probs (top-K /
# sampled: [chunk x K])
DS_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)
CPU_GRAM_SHARE = 4  # calibrate/stats.gram_chunk: the CPU working set is a quarter of the GPU one


def layer_activation(s: Shape, b: int = FP32) -> int:
    """Bytes per token a decoder layer keeps for its backward when it computes in b-byte weights, without
    checkpointing (see the module docstring)."""
    upcasts = 2 * s.hidden + s.q_width + s.kv_width if b < FP32 else 0
    elements = 6 * s.hidden + 4 * s.q_width + 4 * s.kv_width + 4 * s.ffn + upcasts
    return b * elements + FP32 * (2 + 2 * s.heads + s.kv_heads)


def selective_activation(s: Shape, b: int = FP32) -> int:
    """Bytes per token a decoder layer keeps under selective checkpointing (distill/checkpointing.py): its input and
    the outputs of its matmuls (the down projection's only where its shape is another projection's) and of its
    attention kernel (the output and its float32 log-sum-exp)."""
    down = s.hidden if ambiguous_down(s.hidden, s.q_width, s.ffn) else 0
    return b * (2 * s.hidden + 2 * s.q_width + 2 * s.kv_width + 2 * s.ffn + down) + FP32 * s.heads


def activations(s: Shape, tokens: int, b: int, checkpointing: str) -> int:
    """Bytes the student's decoder layers keep for the backward under `checkpointing` (none, selective, full; see
    distill/checkpointing.py), the recompute of one layer included where a layer recomputes."""
    per_layer = tokens * layer_activation(s, b)
    if checkpointing == "none":
        return s.layers * per_layer
    kept = selective_activation(s, b) if checkpointing == "selective" else b * s.hidden
    return s.layers * tokens * kept + per_layer


def forward_transient(s: Shape, tokens: int, b: int) -> int:
    """A no-grad forward's largest live set besides the weights: the hidden states and one layer's
    intermediates (norm, q/k/v, and the widest FFN activation twice)."""
    return tokens * (4 * s.hidden + s.q_width + 2 * s.kv_width + 2 * s.ffn) * b


def training(
    student: Shape,
    tokens: int,
    b: int,
    world: int,
    deepspeed: bool,
    zero_stage: int,
    checkpointing: str,
    chunk: int,
    teacher_logits: bool = True,
    masters: bool = False,
) -> dict[str, int]:
    """One rank's student: weights, gradients, optimizer state, activations and the KL's buffers
    (`teacher_logits`: the KL forms the teacher's logits chunk by chunk; `masters`: the policy keeps float32 master
    weights behind b-byte ones, as DeepSpeed always does when b < 4)."""
    P = student.params
    out = {"student": P * b}
    low = b < FP32 and (masters or deepspeed)  # float32 masters and moments behind lower-precision weights
    if deepspeed and zero_stage >= 3:
        out = {"student": P * b // world, "gathered": zero3_gathered(student, b)}
    if deepspeed and zero_stage >= 1:
        bucket = min(P, DS_BUCKET) * (b + (FP32 if b < FP32 else 0))  # reduced in float32 behind b < 4
        sharded = 0 if zero_stage >= 3 else P * b // (world if zero_stage >= 2 else 1)  # ZeRO-3: float32 alone
        out["grads"] = sharded + FP32 * P // world + bucket
        out["optimizer"] = (8 + (FP32 if b < FP32 else 0)) * P // world
    elif low and deepspeed:  # DeepSpeed's ZeRO-0 bf16 optimizer (fp32 gradient accumulators)
        out["grads"] = P * b + FP32 * P
        out["optimizer"] = (FP32 + 8) * P
    elif low:  # the plain path's MasterWeights: float32 sums, one b-byte gradient (at most the head's) at a time
        out["grads"] = FP32 * P + student.vocab * student.hidden * b
        out["optimizer"] = (FP32 + 8) * P  # masters and moments
    else:
        out["grads"] = P * b
        out["optimizer"] = 2 * P * b
    out["activations"] = activations(student, tokens, b, checkpointing)
    c = min(chunk, tokens)
    out["kl"] = (
        tokens * student.hidden * b
        + student.vocab * student.hidden * FP32
        + KL_TENSORS[teacher_logits] * c * student.vocab * FP32
    )
    return out


def zero3_gathered(student: Shape, b: int) -> int:
    """What a ZeRO-3 rank holds whole besides its partitions: the layer running and the next one prefetched, and the
    student's head, which the chunked KL reads outside any layer (DeepSpeed gathers it as an external parameter and
    keeps it for the loss's backward), beside the embedding when the backward reaches it."""
    head = student.vocab * student.hidden
    return (max(2 * student.layer_params, head) + (0 if student.tied else head)) * b


def online_teacher(teacher: Shape, tokens: int, b: int) -> dict[str, int]:
    """The teacher beside a student (stage2.targets=online): its weights and its no-grad forward."""
    return {
        "teacher": teacher.params * b,
        "teacher forward": forward_transient(teacher, tokens, b) + tokens * teacher.hidden * b,
    }


def sharded_teacher(teacher: Shape, tokens: int, b: int, world: int) -> dict[str, int]:
    """The teacher sharded over a student's `world` ranks (distill/sharded_teacher.py): its weights but the head over
    the ranks, the head whole (as with hidden states), the layer gathered for the forward, the gather's buffers (the
    next layer's gather in flight and this rank's shard copied in), and its no-grad forward."""
    head = teacher.vocab * teacher.hidden
    layer = teacher.layer_params * b
    return {
        "teacher shard": (teacher.params - (0 if teacher.tied else head)) * b // world,
        "teacher head": head * b,
        "gathered layer": layer,
        "gather buffers": layer + layer // world,
        "teacher forward": online_teacher(teacher, tokens, b)["teacher forward"],
    }


def cached_targets(tokens: int, per_token: int) -> dict[str, int]:
    """One micro-batch of cached targets, and the next one prefetched."""
    return {"targets": 2 * tokens * per_token}


def student_rank(
    student: Shape,
    teacher: Shape,
    tokens: int,
    b: int,
    world: int,
    deepspeed: bool,
    zero_stage: int,
    checkpointing: str,
    chunk: int,
    targets: str = ONLINE,
    per_token: int = 0,
    shard: bool = False,
    masters: bool = False,
) -> dict[str, int]:
    """One stage-2 rank: `training` and what it holds of its teacher for `targets` (online, whole or `shard`ed over
    the ranks; hidden, topk, sampled; `per_token`: the cache's bytes per token)."""
    exact = targets in (ONLINE, HIDDEN)
    out = training(
        student, tokens, b, world, deepspeed, zero_stage, checkpointing, chunk, teacher_logits=exact, masters=masters
    )
    if targets == ONLINE:
        return {**out, **(sharded_teacher(teacher, tokens, b, world) if shard else online_teacher(teacher, tokens, b))}
    if targets == HIDDEN:
        out["teacher head"] = teacher.vocab * teacher.hidden * b
    return {**out, **cached_targets(tokens, per_token)}


def calibration(teacher: Shape, batch: int, seq: int, b: int, streamed: bool, gpu: bool) -> dict[str, int]:
    """One calibration actor: the teacher (or one layer of it), its forward with full logits, the
    all-expert Gram working set and the float64 statistics."""
    T = batch * seq
    weights = (teacher.outer_params + teacher.layer_params) * b if streamed else teacher.params * b
    out = {"teacher": weights, "forward": forward_transient(teacher, T, b) + (0 if streamed else T * teacher.vocab * b)}
    if streamed:  # the batch's hidden states stay between layers
        out["hidden states"] = T * teacher.hidden * b
    if teacher.experts:
        E, I, d = teacher.experts, teacher.expert_width, teacher.hidden
        gram_b = FP32 if gpu else 8
        per_token = E * ((5 * I + d) * b + d * gram_b // 4)
        budget = 3 * E * I * d * b // (1 if gpu else CPU_GRAM_SHARE)
        out["gram"] = min(T, max(64, budget // per_token)) * per_token
        out["statistics"] = teacher.layers * (teacher.experts**2 + 4 * teacher.experts) * 8 * 2
    return out


def trial(student: Shape, batch: int, seq: int, b: int) -> dict[str, int]:
    """One stage-1 trial: the student (built a layer at a time in float64) and its perplexity batch
    (hidden states, one layer's forward, one 1,024-token chunk of logits in fp32)."""
    T = batch * seq
    return {
        "student": student.params * b,
        "build": 3 * student.ffn * student.hidden * 8 * 2,
        "forward": forward_transient(student, T, b) + min(T, 1024) * student.vocab * (b + 2 * FP32),
    }


def targets_pass(
    teacher: Shape, batch: int, seq: int, b: int, streamed: bool, per_token: int, logits: bool = True
) -> dict[str, int]:
    """The teacher-once pass of cached targets: a calibration-sized forward without the Gram, and the
    chunked log-softmax over the vocabulary (`logits`: top-K / sampled; hidden states need none)."""
    T = batch * seq
    weights = (teacher.outer_params + teacher.layer_params) * b if streamed else teacher.params * b
    out = {
        "teacher": weights,
        "forward": forward_transient(teacher, T, b) + T * teacher.hidden * b,
        "targets": T * per_token,
    }
    return {**out, "log-softmax": 3 * min(T, 1024) * teacher.vocab * FP32} if logits else out


def total(parts: dict[str, int]) -> int:
    return int(sum(parts.values()))
