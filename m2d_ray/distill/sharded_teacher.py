"""The frozen teacher sharded over its student's ranks (`stage2.shard_teacher`, `m2d distill --shard-teacher`): online
targets from a teacher larger than one GPU's share of it.

Every rank of a student's worker group holds 1/N of each of the teacher's tensors (FSDP2's `fully_shard` over the
student's own process group, one unit per decoder layer, the embeddings and the final norm, with
`reshard_after_forward=True`): a layer's shards are all-gathered just before it runs and freed right after, so a rank
holds teacher/N plus the layer in flight. The teacher has no gradient and no optimizer state (its parameters are
frozen and never given to an optimizer); its forward runs under `no_grad` (distill/step.py), so nothing of it is kept
for a backward. Its output head is read whole on every rank, as `hidden` targets read it (`weights.read_output_head`):
the chunked KL forms the teacher's logits from it a chunk of tokens at a time, exactly as online does.

Loading is layer-streamed (`load_sharded`): the teacher is built on the meta device over its checkpoint
(`weights.open_model`) and its decoder layers are read one at a time, each sharded before the next is read, then the
embeddings and the final norm; no rank ever holds more than its shards and one whole layer, not even while loading.
`shard_loaded` shards a teacher already loaded whole the same way (where a process has it anyway: a notebook, a
benchmark's random-weight model); tests hold both ways to the unsharded loss.

Why FSDP2 and not DeepSpeed ZeRO-3 inference (benchmarks/perf/sharded_teacher.py, benchmarks/RESULTS.md, "The sharded
teacher"; the E64 teacher, 2 gloo ranks on the CPU): both hold half the teacher once it runs, and their forwards took
about the same time (each gathers the whole teacher once a forward), but ZeRO-3 as transformers documents it outside
its Trainer (a live `HfDeepSpeedConfig`, `from_pretrained`, an engine without optimizer) loaded the whole checkpoint
on rank 0 (1.9 x the teacher's bytes there: what this module must never do) and took 5x longer to load; it also
partitions models through a process-wide patch of module construction (`deepspeed.zero.Init`) that the students'
ZeRO-2 engines and transformers' loading in the same process would see (a second ZeRO-3 model beside another hangs,
DeepSpeed#5520). FSDP2 shards modules that already exist, one layer at a time, with plain torch collectives on the
student's process group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from m2d_ray.models import Teacher
from m2d_ray.weights import open_model, read_output_head


def load_sharded(name: str, dtype: torch.dtype, device: str) -> tuple[Teacher, torch.Tensor]:
    """(the teacher `name` sharded over the default process group, its output head [V, d] whole), read one decoder
    layer at a time from its checkpoint (see the module docstring). Every rank of the group calls it."""
    lazy = open_model(name, dtype=dtype)
    model = lazy.skeleton
    _shard(model, lazy.adapter.layers(model), lambda m: lazy.module(lazy.name_of(m)), device)
    adapter = None if not lazy.adapter.moe_blocks(model) else lazy.adapter
    teacher = Teacher(name=name, model=model, tokenizer=lazy.tokenizer, adapter=adapter)
    return teacher, read_output_head(name, dtype).to(device)


def shard_loaded(model: nn.Module, layers: nn.ModuleList, device: str) -> nn.Module:
    """A teacher already in memory sharded in place over the default process group, as `load_sharded` shards a
    streamed one (its output head is left as it is: the caller takes it before); returns the model."""
    _shard(model, layers, lambda m: m, device)
    return model


def _shard(model: nn.Module, layers: nn.ModuleList, real: Callable[[nn.Module], nn.Module], device: str) -> None:
    """Shard `model`'s base model one unit at a time: each decoder layer made real (`real`: read from the checkpoint,
    or the module itself) and sharded before the next, then the base model's other children with parameters
    (embeddings, final norm), each a unit; buffers (rotary frequencies) are moved to the device whole. The output head
    is not part of it."""
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for i in range(len(layers)):
        layer = _frozen(real(layers[i]).to(device))
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        layers[i] = layer
    base, rest = model.base_model, []
    for name, child in list(base.named_children()):
        if child is not layers:
            setattr(base, name, _frozen(real(child) if _on_meta(child) else child).to(device))
            rest += [getattr(base, name)] if any(True for _ in child.parameters()) else []
    for key, buf in list(base._buffers.items()):  # its own buffers, if any, beside the children's
        if buf is not None:
            base._buffers[key] = buf.to(device)
    # a unit each, not the base model: it keeps its class (transformers finds the outputs a forward records, the
    # per-layer hidden states of fkl+mse, by the class of the model that records them)
    for child in rest:
        fully_shard(child, mesh=mesh, reshard_after_forward=True)


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.state_dict().values())


def _frozen(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()
