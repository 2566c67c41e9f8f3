"""The teacher as tensors read on demand, so that building a student never loads the whole teacher.

`LazyTeacher` holds the teacher's config, tokenizer and architecture adapter, a *skeleton* (the model
built on the meta device: module tree, names, shapes, dtypes and the computed rotary buffers, no
weights) and the checkpoint (`m2d_ray.checkpoint`). Sub-modules are materialised from the checkpoint
when asked for: a MoE block holding only the experts a plan merges, a dense layer's FFN, one decoder
layer for streamed calibration. The eager `models.Teacher` answers the same questions (`experts`,
`router_weight`, `shared`, `dense_ffn`, `state`, `skeleton`, `dtype`) from a loaded model, so every
conversion step takes either.

Checkpoint names are the adapter's business (`checkpoint_names`, `per_expert_keys`): a fused
in-memory expert tensor is read from the fused checkpoint tensor (rows = the wanted experts) or
assembled from per-expert keys exactly as transformers fuses them on load (stack over experts,
concatenate along dim 1), so the values are bitwise those of `from_pretrained`.

A teacher published quantised (FP8, MXFP4, compressed-tensors: `m2d_ray.quant`) is read the same way, each tensor
dequantised on read into the model dtype (`quant.reader.Reader`); `models.load_model` loads it whole from the same
reads.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import hf_hub_download, snapshot_download
from torch import Tensor, nn
from transformers import AutoTokenizer

from m2d_ray import checkpoint, storage
from m2d_ray.arch import auto_class, family_of, get_adapter
from m2d_ray.arch.base import (
    DenseFFN,
    ExpertWeights,
    MoEAdapter,
    SharedExpert,
)
from m2d_ray.arch.checkpoint_names import checkpoint_map
from m2d_ray.arch.dense import dense_layout
from m2d_ray.arch.head import check_plain_head, head_names
from m2d_ray.checkpoint import (
    INDEX_FILE,
    Checkpoint,
    Shard,
    check_files,
    read_stored_tensor,
)
from m2d_ray.errors import M2DError
from m2d_ray.models import checkpoint_dir, default_teacher, model_config, model_fingerprint
from m2d_ray.quant import Scheme, scheme_of
from m2d_ray.quant.reader import Reader

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Imported inside functions: transformers' model classes (seconds of modelling code; `m2d plan` reads this module
# without building a model).


def check_finite(name: str, t: Tensor, experts: Sequence[int] | None = None) -> Tensor:
    """`t` itself, or an M2DError naming the tensor (and its layer and expert) when it holds NaN or inf,
    worded as `checkpoint.check_model_finite` words it for a loaded teacher.

    `experts` maps the rows of a fused [E, ...] expert tensor to expert ids (default: row = id).
    """
    checkpoint.check_finite(
        [(name, t)], "teacher weight", "the checkpoint is damaged: re-download or re-export the model", experts
    )
    return t


def skeleton(config, dtype: torch.dtype, device: str = "cpu") -> PreTrainedModel:
    """The model on the meta device (no weights), with its non-persistent buffers (rotary frequencies)
    computed as `from_pretrained` computes them."""
    kwargs = {"dtype": dtype}
    if device == "cpu" and family_of(config) is not None:
        kwargs["experts_implementation"] = "eager"  # grouped_mm rejects odd tiny shapes on CPU
    with torch.device("meta"):
        model = auto_class(config).from_config(copy.deepcopy(config), **kwargs)
    for module in model.modules():
        lost = [
            n
            for n in module._non_persistent_buffers_set
            if module._buffers.get(n) is not None and module._buffers[n].is_meta
        ]
        for n in lost:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
        if lost:
            model._init_weights(module)
    return model.eval()


def _checkpoint_dtype(config, ckpt: Checkpoint) -> torch.dtype:
    """What from_pretrained(dtype="auto") picks: the config's dtype, else the first floating tensor's."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    floats = (ckpt.shard(n).dtype(n) for n in sorted(ckpt.names()))
    return next((d for d in floats if d.is_floating_point and d.itemsize > 1), torch.get_default_dtype())


@dataclass
class LazyTeacher:
    """A teacher whose weights stay in its checkpoint until a sub-module is asked for (see module doc)."""

    name: str
    config: object
    tokenizer: object
    adapter: MoEAdapter
    skeleton: PreTrainedModel
    checkpoint: Checkpoint
    _names: dict[nn.Module, str] = field(init=False, repr=False)
    _expert_tensors: set[str] = field(init=False, repr=False)
    _ties: dict[str, list[str]] = field(init=False, repr=False)
    _targets: dict[str, Tensor] = field(init=False, repr=False)
    _reader: Reader = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._reader = Reader(self.checkpoint, scheme_of(self.config))
        self._targets = self.skeleton.state_dict(keep_vars=True)
        self._names = {m: n for n, m in self.skeleton.named_modules(remove_duplicate=False)}
        self._expert_tensors = {
            f"{self._names[self.adapter.expert_module(b)]}.{n}"
            for b in self.adapter.moe_blocks(self.skeleton).values()
            for n, _ in self.adapter.expert_module(b).named_parameters()
        }
        by_object: dict[int, list[str]] = {}
        for n, t in self._targets.items():
            by_object.setdefault(id(t), []).append(n)
        self._ties = {n: [o for o in group if o != n] for group in by_object.values() for n in group if len(group) > 1}

    # ---- what conversion reads (the same methods as models.Teacher) ----------------------------
    @property
    def dtype(self) -> torch.dtype:
        return next(self.skeleton.parameters()).dtype

    @property
    def quantization(self) -> Scheme | None:
        """How the checkpoint stores its weights quantised (None: as they are)."""
        return self._reader.scheme

    def nbytes(self) -> int:
        """Bytes of the whole teacher in its model dtype (from the checkpoint headers; nothing is read)."""
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in self._targets.values()}.values())

    def fingerprint(self) -> dict:
        return model_fingerprint(self.name, self.config)

    def moe_layers(self) -> list[int]:
        return sorted(self.adapter.moe_blocks(self.skeleton))

    def experts(self, layer: int, ids: Sequence[int] | None = None) -> ExpertWeights:
        """Experts `ids` (all when None) of a MoE layer, in that order; only their bytes are read."""
        block = self.adapter.moe_blocks(self.skeleton)[layer]
        only = self._relative(self.adapter.expert_module(block), block)
        return self.adapter.experts(self.module(self._names[block], experts=ids, only=only))

    def router_weight(self, layer: int) -> Tensor:
        block = self.adapter.moe_blocks(self.skeleton)[layer]
        only = self._relative(self.adapter.router(block), block)
        return self.adapter.router_weight(self.module(self._names[block], only=only))

    def shared(self, layer: int) -> SharedExpert | None:
        block = self.adapter.moe_blocks(self.skeleton)[layer]
        if self.adapter.shared(block) is None:  # known from the structure: nothing to read
            return None
        return self.adapter.shared(self.module(self._names[block], experts=[]))

    def dense_ffn(self, layer: int) -> DenseFFN:
        """A dense (non-MoE) layer's FFN."""
        ffn = self.adapter.ffn(self.adapter.layers(self.skeleton)[layer])
        return self.adapter.dense_ffn(self.module(self._names[ffn]))

    def state(self, names: Sequence[str]) -> dict[str, Tensor]:
        """Tensors by in-memory name, in the model dtype (tied names share one tensor)."""
        out: dict[str, Tensor] = {}
        for n in names:
            tied = next((out[o] for o in self._ties.get(n, ()) if o in out), None)
            out[n] = tied if tied is not None else self.tensor(n)
        return out

    # ---- reading ---------------------------------------------------------------------------
    def module(self, prefix: str, experts: Sequence[int] | None = None, only: str | None = None) -> nn.Module:
        """A real copy of the skeleton's sub-module `prefix`, parameters and persistent buffers read from
        the checkpoint. Fused expert tensors hold only `experts` (all when None), in that order. With
        `only` (a relative name prefix), just those tensors are read; the others stay on the meta device."""
        skel = self.skeleton.get_submodule(prefix)
        mod = copy.deepcopy(skel)
        done: dict[int, Tensor] = {}
        for rel, target in skel.state_dict(keep_vars=True).items():
            if only is not None and not rel.startswith(only):
                continue
            full = f"{prefix}.{rel}" if prefix else rel
            if id(target) not in done:
                done[id(target)] = self.tensor(full, experts if full in self._expert_tensors else None)
            owner, _, attr = rel.rpartition(".")
            sub = mod.get_submodule(owner)
            value = done[id(target)]
            if attr in sub._parameters:
                sub._parameters[attr] = nn.Parameter(value, requires_grad=False)
            else:
                sub._buffers[attr] = value
        return mod

    def tensor(self, name: str, rows: Sequence[int] | None = None) -> Tensor:
        """The in-memory tensor `name` (a key of the skeleton's state dict) in its model dtype; for a fused
        expert tensor `rows` picks experts. Every value read is checked for NaN/inf."""
        target = self._targets[name]
        ckpt, reader = self.checkpoint, self._reader
        for key in self.adapter.checkpoint_names(name):
            if key in reader:
                return check_finite(key, reader.read(key, rows, target.dtype), rows).to(target.dtype)
        if name in self._expert_tensors and (parts := self._per_expert(name)):
            return self._assemble(parts, target, rows)
        for other in self._ties.get(name, ()):
            if any(k in reader for k in self.adapter.checkpoint_names(other)):
                return self.tensor(other, rows)
        stored = self._mapped().get(name)
        if stored is not None and stored.unread:
            raise M2DError(stored.unread)
        if stored is not None and stored.part is not None:  # one of the tensors a stored one is split into
            whole = check_finite(stored.key, reader.read(stored.key, None, target.dtype))
            return whole.narrow(stored.dim, *stored.part).contiguous().to(target.dtype)
        if stored is not None and stored.swap is not None:  # stored transposed
            t = check_finite(stored.key, reader.read(stored.key, None, target.dtype))
            return t.transpose(*stored.swap).contiguous().to(target.dtype)
        if stored is not None and stored.ops is not None:
            return self._converted(stored, rows, target.dtype)
        if stored is not None and stored.interleaved:  # (g0, u0, g1, u1 ...) along dim -> [gate; up]
            t = check_finite(stored.key, reader.read(stored.key, rows, target.dtype))
            shape = list(t.shape)
            shape[stored.dim : stored.dim + 1] = [shape[stored.dim] // 2, 2]
            return t.reshape(shape).transpose(stored.dim, stored.dim + 1).reshape(t.shape).to(target.dtype)
        if stored is not None and stored.key is not None:
            return check_finite(stored.key, reader.read(stored.key, rows, target.dtype)).to(target.dtype)
        if stored is not None and name in self._expert_tensors:
            return self._assemble(list(stored.templates), target, rows)
        if stored is not None:  # one tensor fused from several (no expert axis)
            parts = [check_finite(k, reader.read(k, None, target.dtype)) for k in stored.templates]
            return torch.cat(parts, dim=stored.dim).to(target.dtype)
        quantized = any(f"{k}_blocks" in ckpt for k in self.adapter.checkpoint_names(name))
        hint = (
            "it is stored quantized but config.json has no quantization_config: give the model's published config"
            if quantized and self.quantization is None
            else "is it a checkpoint of this model?"
        )
        raise M2DError(f"checkpoint {ckpt.dir} has no tensor {name} ({hint})")

    def _converted(self, stored, rows: Sequence[int] | None, dtype: torch.dtype) -> Tensor:
        """A tensor transformers assembles with operations of its own (`Stored.ops`): its sources read as stored, or
        dequantised by the checkpoint's scheme (only the experts `rows` where the operations work expert by expert),
        then those operations run on them, into `dtype` as `from_pretrained` runs them into the parameter's."""
        ops, patterns, targets, target = stored.ops
        pushed = rows if stored.per_expert else None
        # each source as stored, or dequantised where the teacher's published scheme stores it quantised
        tensors: dict = {p: [self._reader.read(k, pushed, dtype)] for p, k in stored.sources}
        for op in ops:
            tensors = op.convert(
                tensors,
                source_patterns=list(patterns),
                target_patterns=list(targets),
                model=_Dtype(dtype),
                full_layer_name=target,
                config=self.config,
            )
        out = tensors[target]
        out = out[0] if isinstance(out, list) else out
        if rows is not None and pushed is None:
            out = out[list(rows)]
        return check_finite(stored.key, out.to(dtype), rows)

    def _mapped(self) -> dict:
        """In-memory name -> checkpoint keys by transformers' conversion mapping (arch/checkpoint_names.py), for the
        names the adapter's own rules do not find; computed once, on the first such name."""
        if not hasattr(self, "_map"):
            self._map = checkpoint_map(self.skeleton, self.checkpoint.names())
        return self._map

    def _per_expert(self, name: str) -> list[str]:
        """Templates ('{e}' = expert) of the per-expert checkpoint keys that make up a fused expert tensor."""
        module, _, param = name.rpartition(".")
        parts = []
        for tmpl in self.adapter.per_expert_keys.get(param, ()):
            names = self.adapter.checkpoint_names(f"{module}.{tmpl}")
            found = next((n for n in names if n.format(e=0) in self._reader), None)
            if found is None:
                return []
            parts.append(found)
        return parts

    def _assemble(self, parts: list[str], target: Tensor, rows: Sequence[int] | None) -> Tensor:
        """Stack the experts' per-expert tensors, concatenating the parts along dim 1 (transformers' fusion)."""
        ids = list(range(target.shape[0])) if rows is None else list(rows)
        out = torch.empty((len(ids), *target.shape[1:]), dtype=target.dtype)
        for j, e in enumerate(ids):
            at = 0
            for tmpl in parts:
                key = tmpl.format(e=e)
                if self._reader.quantised(key):  # dequantised on read
                    value = check_finite(key, self._reader.read(key, None, out.dtype))
                    rows_e = value.shape[0]
                    out[j, at : at + rows_e].copy_(value)
                else:
                    shard = self.checkpoint.shard(key)
                    rows_e = shard.shape(key)[0]
                    dst = out[j, at : at + rows_e]
                    if shard.dtype(key) == out.dtype and dst.shape == shard.shape(key):  # in place, no temporary
                        check_finite(key, shard.read(key, out=dst))
                    else:
                        dst.copy_(check_finite(key, shard.read(key)))
                at += rows_e
            if at != out.shape[1]:
                raise M2DError(
                    f"checkpoint {self.checkpoint.dir}: per-expert tensors {parts} of expert {e} do not fill "
                    f"{list(target.shape)}"
                )
        return out

    def name_of(self, module: nn.Module) -> str:
        """Qualified name of a skeleton module (what `module` materialises)."""
        return self._names[module]

    def _relative(self, module: nn.Module, parent: nn.Module) -> str:
        return self._names[module].removeprefix(self._names[parent] + ".") + "."


class _Dtype:
    """What a transformers loading op asks of the model it loads into: a parameter's dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def get_parameter(self, name: str) -> _Dtype:
        return self


def open_teacher(name: str | None = None, device: str = "cpu", dtype: torch.dtype | None = None) -> LazyTeacher:
    """A teacher by directory, hub name or storage URL with no weights loaded, its tensors read in `dtype` (default:
    the checkpoint's); fails with one line when the model is not a supported MoE, or its files are missing,
    truncated or not safetensors."""
    name = name or default_teacher()
    return _open(name, get_adapter(model_config(name)), device, dtype)


def open_model(name: str, device: str = "cpu", dtype: torch.dtype | None = None) -> LazyTeacher:
    """`open_teacher` of any teacher a student distils from: a supported MoE, or a dense model (the d2d baseline's
    teacher), read with the dense layout (`arch.dense.dense_layout`: its layers, no experts)."""
    config = model_config(name)
    adapter = get_adapter(config) if family_of(config) is not None else dense_layout(config)
    return _open(name, adapter, device, dtype)


def _open(name: str, adapter: MoEAdapter, device: str, dtype: torch.dtype | None) -> LazyTeacher:
    config = model_config(name)
    directory = checkpoint_dir(name)
    check_files(str(directory), "teacher")  # the same checks (and messages) as loading it whole
    ckpt = Checkpoint(directory)
    return LazyTeacher(
        name=name,
        config=config,
        tokenizer=AutoTokenizer.from_pretrained(str(directory)),
        adapter=adapter,
        skeleton=skeleton(config, dtype or _checkpoint_dtype(config, ckpt), device),
        checkpoint=ckpt,
    )


def read_output_head(name: str, dtype: torch.dtype) -> Tensor:
    """The model's output projection W [V, d] alone, in `dtype` (`lm_head`, or the tied input embedding;
    arch/head.py): all a student's rank holds of its teacher with `hidden` targets. A teacher in object
    storage is read by ranged reads of that tensor only (no copy of the checkpoint on the node); MoE and
    dense teachers (the d2d baseline's) alike; checked for NaN/inf like every lazy read."""

    config = model_config(name)
    check_plain_head(config)
    adapter = get_adapter(config) if family_of(config) is not None else None
    wanted = head_names(skeleton(config, dtype))
    keys = [k for n in wanted for k in (adapter.checkpoint_names(n) if adapter else (n,))]
    if storage.is_remote(name):
        found = read_stored_tensor(name, keys)
    elif not Path(name).expanduser().exists():
        found = _read_hub_tensor(name, keys)
    else:
        directory = checkpoint_dir(name)
        check_files(str(directory), "teacher")
        reader = Reader(Checkpoint(directory), scheme_of(config))
        found = next(((k, reader.read(k, None, dtype)) for k in keys if k in reader), None)
    if found is None:
        raise M2DError(
            f"the checkpoint of {name} has no output head ({' or '.join(wanted)}); is it a causal language model?"
        )
    if found[1].element_size() == 1:  # a ranged read has no scales beside it
        raise M2DError(
            f"the output head {found[0]} of {name} is stored quantised; give the teacher by a local directory "
            "(its head is then dequantised on read)"
        )
    return check_finite(*found).to(dtype)


def _read_hub_tensor(name: str, keys: Sequence[str]) -> tuple[str, Tensor] | None:
    """(key, tensor) of the first of `keys` in a hub model, downloading its JSON files and only the weight shard
    that holds the tensor (into the hub cache), not the whole checkpoint."""

    try:
        meta = Path(snapshot_download(name, allow_patterns=["*.json"]))
        index = meta / INDEX_FILE
        files = (
            json.loads(index.read_text())["weight_map"] if index.exists() else {k: "model.safetensors" for k in keys}
        )
        for key in (k for k in keys if k in files):
            shard = Shard(Path(hf_hub_download(name, files[key])))
            if key in shard.entries:
                return key, shard.read(key)
    except M2DError:
        raise
    except Exception as exc:
        raise M2DError(
            f"cannot fetch the output head of {name!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        ) from None
    return None
