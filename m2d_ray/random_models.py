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

# the paper student's head (Qwen3: vocabulary 151,936, hidden 2048) at 4096-token sequences, 2 decoder layers: the
# head and the KL at the shapes that cost money, every path and kernel side by side in 80 GB (by arithmetic, not
# measured: a 0.72B student, ~13 GB a bf16-mixed path (weights 2, float32 gradient sums 4, masters 4, moments 8
# bytes a parameter), 11.5 GB the fp32 one, a 2.5 GB teacher, and the plain loop's whole [4096 x V] float32
# logits ~12 GB at its step: ~78 GB with platform, loop, fp32, compiled and liger; a third layer would not fit)
STEP_PRESETS["head"] = {
    **STEP_PRESETS["h100"],
    "layers": 2,
    "vocab": 151936,
    "seq_len": 4096,
    "batch": 1,
    "warmup": 2,
    "steps": 6,
}


def teacher_and_student(p: dict, dtype: torch.dtype) -> tuple[Teacher, torch.nn.Module]:
    """(teacher Teacher, initial student) on the preset's device, the way stage 2 loads them."""
    config = moe_config(**{k: p[k] for k in SHAPE}, max_positions=p["seq_len"])
    kwargs = {"experts_implementation": "eager"} if p["device"] == "cpu" else {}  # as models.load_model on CPU
    torch.manual_seed(0)
    with torch.device(p["device"]):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs).eval()
    for w in model.parameters():
        w.requires_grad_(False)
    teacher = Teacher(name="random", model=model, tokenizer=None, adapter=get_adapter(config))
    student = RANDOM_BASELINES["random-ffn"](teacher, seed=0)
    if p["device"] == "cuda":
        student.set_attn_implementation(attention_implementation())
    student.config.use_cache = False
    return teacher, student
