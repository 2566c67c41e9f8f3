"""Assemble a dense student model from a teacher and one DenseFFN per layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from m2d_ray.arch.base import DenseFFN, MoEAdapter, dense_from_mlp

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Imported inside functions: transformers' model classes (seconds of modelling code; `m2d plan` reads this module
# without building a model).


def teacher_ffn_keys(model: nn.Module, adapter: MoEAdapter) -> set[str]:
    """State-dict keys of every teacher FFN (MoE or dense): these are replaced in the student."""
    keys = set()
    for i, layer in enumerate(adapter.layers(model)):
        prefix = adapter.ffn_prefix(i)
        keys.update(prefix + k for k in layer.mlp.state_dict())
    return keys


def student_width(teacher: nn.Module, adapter: MoEAdapter, moe_width: int) -> int:
    """One intermediate size for the whole student: the widest of the MoE-derived and dense layers
    (`teacher` may be a meta-device skeleton: only shapes are read)."""
    dense = [dense_from_mlp(layer.mlp).width for layer in adapter.layers(teacher) if not adapter.is_moe(layer.mlp)]
    return max([moe_width, *dense])


def build_student(teacher, ffns: dict[int, DenseFFN]) -> PreTrainedModel:
    """Dense student: the teacher's attention/embeddings/norms/head plus the given FFNs.

    `teacher` is a `models.Teacher` or a `weights.LazyTeacher`: only the non-FFN tensors and the dense
    layers' FFNs are read from it. Layers without an entry in `ffns` are the teacher's dense layers;
    every FFN is zero-padded to the widest one so the student has a single intermediate size.
    """
    from transformers import AutoModelForCausalLM

    adapter, skeleton = teacher.adapter, teacher.skeleton
    layers = adapter.layers(skeleton)
    all_ffns = {i: ffns[i] if i in ffns else teacher.dense_ffn(i) for i in range(len(layers))}
    width = max(f.width for f in all_ffns.values())
    dtype = teacher.dtype

    ffn_keys = teacher_ffn_keys(skeleton, adapter)
    state = teacher.state([k for k in skeleton.state_dict() if k not in ffn_keys])
    for i, ffn in all_ffns.items():
        padded = ffn.pad_to(width)
        state.update({k: v.to(dtype) for k, v in adapter.student_ffn_state(adapter.ffn_prefix(i), padded).items()})

    config = adapter.student_config(teacher.config, width)
    config.dtype = dtype
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing = set(student.state_dict()) - set(state)
    unexpected = set(state) - set(student.state_dict())
    if unexpected or missing:
        raise RuntimeError(
            f"student state mismatch: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    student.load_state_dict(state, strict=True, assign=True)
    materialise_buffers(student, skeleton)
    student.eval()
    return student


def materialise_buffers(student: nn.Module, teacher: nn.Module) -> None:
    """Non-persistent buffers (rotary inv_freq …) are not in the state dict: take the teacher's."""
    teacher_buffers = dict(teacher.named_buffers())
    for name, buf in list(student.named_buffers()):
        if buf.device.type != "meta":
            continue
        if name not in teacher_buffers:
            raise RuntimeError(f"student buffer {name} has no teacher counterpart")
        module_name, _, attr = name.rpartition(".")
        module = student.get_submodule(module_name) if module_name else student
        module._buffers[attr] = teacher_buffers[name].clone()
