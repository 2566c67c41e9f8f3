"""Assemble a dense student model from a teacher and one DenseFFN per layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from m2d_ray.arch import auto_class
from m2d_ray.arch.base import DenseFFN, MoEAdapter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Imported inside functions: transformers' model classes (seconds of modelling code; `m2d plan` reads this module
# without building a model).


def student_width(teacher: nn.Module, adapter: MoEAdapter, moe_width: int) -> int:
    """One intermediate size for the whole student: the widest of the MoE-derived and dense layers
    (`teacher` may be a meta-device skeleton: only shapes are read)."""
    ffns = [adapter.ffn(layer) for layer in adapter.layers(teacher)]
    dense = [adapter.dense_ffn(f).width for f in ffns if f is not None and not adapter.is_moe(f)]
    return max([moe_width, *dense])


def build_student(teacher, ffns: dict[int, DenseFFN]) -> PreTrainedModel:
    """Dense student: the teacher's attention/embeddings/norms/head plus the given FFNs.

    `teacher` is a `models.Teacher` or a `weights.LazyTeacher`: only the non-FFN tensors and the dense
    layers' FFNs are read from it. Layers without an entry in `ffns` are the teacher's dense layers;
    every FFN is zero-padded to the widest one so the student has a single intermediate size.
    """
    adapter, skeleton = teacher.adapter, teacher.skeleton
    layers = adapter.layers(skeleton)
    with_ffn = [i for i, layer in enumerate(layers) if adapter.ffn(layer) is not None]  # not a Mamba mixer's
    all_ffns = {i: ffns[i] if i in ffns else teacher.dense_ffn(i) for i in with_ffn}
    multiple = adapter.student_width_multiple(teacher.config)
    width = -(-max(f.width for f in all_ffns.values()) // multiple) * multiple
    dtype = teacher.dtype

    config = adapter.dense_config(teacher.config, width)
    config.dtype = dtype
    with torch.device("meta"):
        student = auto_class(config).from_config(config, dtype=dtype)
    state = {}
    for i, ffn in all_ffns.items():
        padded = ffn.pad_to(width)
        state.update({k: v.to(dtype) for k, v in adapter.student_ffn_state(student, i, padded).items()})
    # everything else is the teacher's, by the same name and shape (attention, embeddings, norms, the head)
    wanted = {k: t for k, t in student.state_dict().items() if k not in state}
    teacher_shapes = {k: t.shape for k, t in skeleton.state_dict().items()}
    odd = [k for k, t in wanted.items() if teacher_shapes.get(k) != t.shape]
    unexpected = set(state) - set(student.state_dict())
    if unexpected or odd:
        raise RuntimeError(f"student state mismatch: not the teacher's {odd[:5]}, unexpected {sorted(unexpected)[:5]}")
    state.update(teacher.state(list(wanted)))
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
