"""Export a dense student natively (`save_pretrained`) and prove it before declaring success.

The saved directory is reloaded with its auto class's `from_pretrained` (no custom code) and,
for every MoE layer, the reloaded dense FFN is compared in float64 on random inputs with
sum_g alpha_g f_g(h) (+ the shared experts), computed group by group from the teacher's weights (a
lazy teacher reads each layer's grouped experts when that layer is checked).
Only the storage rounding of the stored blocks is modelled, so the bound is 1e-10 relative.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from m2d_ray.arch import auto_class
from m2d_ray.arch.base import ExpertWeights, expert_outputs, rel_error
from m2d_ray.artifacts import atomic_dir
from m2d_ray.convert.build import merged_groups
from m2d_ray.convert.plan import ConversionPlan

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Imported inside functions: transformers' model classes (seconds of modelling code; `m2d plan` reads this module
# without building a model).

PLAN_FILE = "m2d_plan.json"


def reference_output(teacher, layer: int, plan: ConversionPlan, h: Tensor, dtype: torch.dtype) -> Tensor:
    """sum_g alpha_g f_g(h) (+ shared) in float64, group by group, blocks rounded to `dtype` as stored."""
    lp = plan.layers[layer]

    def rnd(t):
        return None if t is None else t.to(dtype).double()

    out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float64)
    bias = None
    for m, a in zip(merged_groups(teacher, layer, lp), lp.alphas):
        w = ExpertWeights(
            gate=rnd(m.gate),
            up=rnd(m.up),
            down=rnd(a * m.down),
            act=m.act,
            gate_bias=rnd(m.gate_bias),
            up_bias=rnd(m.up_bias),
        )
        out += expert_outputs(w, h)[0]
        if m.down_bias is not None:
            bias = a * m.down_bias[0] if bias is None else bias + a * m.down_bias[0]
    if bias is not None:
        out += rnd(bias)
    shared = teacher.shared(layer)
    if shared is not None:
        s = shared.weights.to(torch.float64)
        w = ExpertWeights(gate=rnd(s.gate), up=rnd(s.up), down=rnd(lp.shared_scale * s.down), act=s.act)
        out += expert_outputs(w, h)[0]
    return out


def verify_student(
    student: PreTrainedModel, teacher, plan: ConversionPlan, n_tokens: int = 64, seed: int = 0
) -> dict[int, float]:
    """Relative error per MoE layer between the student's FFN and the reference (float64)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(student.parameters()).dtype
    d = student.config.get_text_config().hidden_size
    errors = {}
    layers = teacher.adapter.layers(student)
    for i in plan.layers:
        h = torch.randn(n_tokens, d, generator=gen, dtype=torch.float64)
        mlp64 = copy.deepcopy(teacher.adapter.ffn(layers[i])).to(teacher.adapter.exact_dtype)
        for sub in mlp64.modules():  # fused-expert kernels (grouped_mm) reject float64
            if getattr(sub, "config", None) is not None:
                sub.config._experts_implementation = "eager"
        with torch.no_grad():
            got = teacher.adapter.student_ffn(mlp64)(h.to(teacher.adapter.exact_dtype))
        errors[i] = rel_error(got, reference_output(teacher, i, plan, h, dtype))
    return errors


def export_student(
    student: PreTrainedModel,
    tokenizer,
    out: str | Path,
    teacher=None,
    plan: ConversionPlan | None = None,
    extra: dict | None = None,
    overwrite: bool = False,
) -> dict:
    """save_pretrained + tokenizer into `out` atomically; with a plan, reload and verify exactness first.

    Returns the verification record (max relative error per layer). Raises RuntimeError — and leaves
    `out` untouched — when the reloaded student does not reproduce the plan. `out` may replace only a
    previous student, and only with `overwrite` (artifacts.check_output). The in-memory student is let go
    before the reload: a caller that passes it without keeping a reference
    (`export_student(build_from_plan(...), ...)`) holds one student at a time, not two.
    """
    record: dict = {}
    dtype, cls, auto = next(student.parameters()).dtype, type(student).__name__, auto_class(student.config)
    with atomic_dir(out, "student", overwrite) as tmp:
        student.save_pretrained(tmp)
        del student
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if plan is not None and teacher is not None:
            reloaded = auto.from_pretrained(tmp, dtype=dtype)
            if type(reloaded).__name__ != cls:
                raise RuntimeError(f"reloaded as {type(reloaded).__name__}, expected {cls}")
            errors = verify_student(reloaded, teacher, plan)
            worst = max(errors.values(), default=0.0)
            tol = teacher.adapter.exact_tol
            if not worst < tol:
                raise RuntimeError(f"exported student is not exact: max relative FFN error {worst:.3e} >= {tol:g}")
            record = {"max_rel_error": worst, "per_layer": {str(k): v for k, v in errors.items()}}
            (tmp / PLAN_FILE).write_text(
                json.dumps({"plan": plan.to_json(), "verification": record, **(extra or {})}, indent=1)
            )
    return record
