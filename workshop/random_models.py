"""Random models for tests and benchmarks: a Qwen3-MoE teacher of a given shape (arch/qwen3_moe.moe_config shapes it)
with its random-FFN student, built in memory the way stage 2 loads them, and the tokenizer's fields a saved random
teacher carries. One home, so that a test and the benchmark it mirrors build the same models."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from m2d_ray.arch import get_adapter
from m2d_ray.arch.qwen3_moe import moe_config
from m2d_ray.catalog.methods import RANDOM_BASELINES
from m2d_ray.distill.gpu import attention_implementation
from m2d_ray.models import Teacher


def tokenizer_fields(tok, multiple: int = 8) -> dict:
    """The config fields a random teacher saved with tokenizer `tok` needs: its vocabulary rounded up to `multiple`
    (a matmul-friendly size; ids past the tokenizer's are never fed), its pad and end-of-sequence ids."""
    return dict(vocab=-(-len(tok) // multiple) * multiple, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


#: a preset's model shape: the teacher is moe_config(**shape), the student's width top_k x expert width
SHAPE = ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts", "expert_width", "top_k", "vocab")
#: and its run: where, tokens a sequence, sequences a step, warm-up steps and timed steps
RUN = ("device", "seq_len", "batch", "warmup", "steps")
# fmt: off
_ROWS = {
    # hidden layers heads kv_heads head_dim experts expert_width top_k vocab | device seq_len batch warmup steps
    "cpu": (256, 4, 4, 2, 64, 16, 128, 4, 4096, "cpu", 256, 4, 2, 12),
    "h100": (2048, 8, 16, 4, 128, 64, 768, 8, 4096, "cuda", 2048, 8, 3, 10),
    # the paper student's head (STEP_PRESETS["head"] below) on the CPU: one layer, 128 tokens, one path (the share of
    # a step the head and the KL take)
    "head-cpu": (2048, 1, 16, 4, 128, 4, 768, 2, 151936, "cpu", 128, 1, 1, 2),
    "smoke": (64, 2, 4, 2, 16, 8, 32, 2, 512, "cpu", 64, 2, 1, 2),
}
# fmt: on
#: model shape, batch and timing of each preset of the distillation-step benchmarks (benchmarks/perf/distill_step.py,
#: science/precision_trajectories.py) and their tests, by name: {field of SHAPE or RUN: value}
STEP_PRESETS = {name: dict(zip(SHAPE + RUN, row)) for name, row in _ROWS.items()}

# the paper student's head (Qwen3: vocabulary 151,936, hidden 2048, 32 query heads) at the paper's micro-batch of 4 x
# 4096 tokens, 2 decoder layers: the head and the KL at the shapes that cost money, every path and kernel side by side
# (by arithmetic, not measured: a 0.72B student, ~13 GB a bf16-mixed path (weights 2, float32 gradient sums 4, masters
# 4, moments 8 bytes a parameter), 11.5 GB the fp32 one, a 2.5 GB teacher, and the plain loop's whole [16,384 x V]
# float32 logits, their log-softmax and gradient ~40 GB at its step: ~95 GB with platform, loop, fp32 and liger, an
# H200's 141 GB; on an 80 GB card run it with --paths platform and fewer kernels)
STEP_PRESETS["head"] = {
    **STEP_PRESETS["h100"],
    "heads": 32,  # the paper student's 32 query heads of 128 (4 key/value heads)
    "layers": 2,
    "vocab": 151936,
    "seq_len": 4096,
    "batch": 4,  # the paper's micro-batch, 16,384 tokens: Liger sizes its chunks by it (distill/kernels.py)
    "warmup": 2,
    "steps": 6,
}


# the paper's student (Qwen3-30B-A3B's K = k student: what `m2d plan qwen3_30b_a3b` builds for stage 2,
# tests/unit/test_paper_step.py holds it equal): 48 layers of hidden 2048, 32 query and 4 key/value heads of 128, an
# FFN of 8 x 768 = 6144, an untied 151,936-word head, 4 x 4096 tokens a micro-batch, trained from the teacher's cached
# final hidden states (stage2.targets=hidden, what the plan chooses for the paper run) on one rank. Its teacher is only
# as large as hidden mode needs: one MoE layer (`teacher_layers`) to make the cached states, and its head; the student
# is built whole at the full depth (fresh weights: the step's speed does not depend on them). By arithmetic: 3.34B
# parameters, ~60 GB of weights, float32 masters, sums and moments on one rank, activations as the plan's checkpointing
# decides for the device (`checkpointing`: auto).
STEP_PRESETS["paper"] = {
    **dict(zip(SHAPE + RUN, (2048, 48, 32, 4, 128, 128, 768, 8, 151936, "cuda", 4096, 4, 2, 4))),
    "teacher_layers": 1,
    "targets": "hidden",
    "checkpointing": "auto",
    "one_path_at_a_time": True,  # a path's optimizer state alone is ~60 GB: P7 runs its paths one after the other
    "no_fp32_spread": True,  # its float32 step would need ~2x the memory: no spread path beside bf16-mixed
}


def preset_config(p: dict, layers: int | None = None):
    """The teacher config of preset `p` (at `layers` decoder layers, default the preset's)."""
    return moe_config(**{**{k: p[k] for k in SHAPE}, "layers": layers or p["layers"]}, max_positions=p["seq_len"])


def teacher_and_student(p: dict, dtype: torch.dtype, device: str | None = None) -> tuple[Teacher, torch.nn.Module]:
    """(teacher Teacher, initial student) on the preset's device (or `device`: `meta` rehearses the shapes), the way
    stage 2 loads them: the random-FFN student of the teacher, or with `teacher_layers` a teacher of that many layers
    and a freshly initialised student of the preset's full depth."""
    device = device or p["device"]
    config = preset_config(p, p.get("teacher_layers"))
    kwargs = {"experts_implementation": "eager"} if device == "cpu" else {}  # as models.load_model on CPU
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs).eval()
    for w in model.parameters():
        w.requires_grad_(False)
    adapter = get_adapter(config)
    teacher = Teacher(name="random", model=model, tokenizer=None, adapter=adapter)
    if p.get("teacher_layers"):
        width = p["top_k"] * p["expert_width"]
        with torch.device(device):
            student = AutoModelForCausalLM.from_config(adapter.student_config(preset_config(p), width), dtype=dtype)
    else:
        student = RANDOM_BASELINES["random-ffn"](teacher, seed=0)
    if device == "cuda":
        student.set_attn_implementation(attention_implementation())
    student.config.use_cache = False
    return teacher, student
