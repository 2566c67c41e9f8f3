"""Layer-streamed calibration: the teacher's decoder layers go to the device one at a time.

The calibration hidden states stay on the host (in a temporary file once they exceed a byte budget)
and are carried from layer to layer: layer i is materialised from the checkpoint
(`LazyTeacher.module`), run on every batch, and dropped before layer i + 1 is read. Each layer runs
inside the model's own forward, with the layers before it passing hidden states through and the
pass stopped right after it, so attention masks, sliding windows and rotary embeddings are the
model's own and the statistics equal the whole-model pass (`collect_stats`) to float64 round-off.
Peak memory: one decoder layer (plus the embedding table while the first states are made), one
batch of hidden states on the device, and all hidden states on the host or on disk.
"""

from __future__ import annotations

import ctypes
import os
import tempfile

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from m2d_ray import console
from m2d_ray.calibrate.collect import observe, token_batches
from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.checkpoint import read_at
from m2d_ray.errors import M2DError
from m2d_ray.peaks import proc_kib
from m2d_ray.sizes import parse_size

#: room left beside the weights for activations and the statistics' working set
RESERVE_BYTES = 1 << 30


def give_back_freed_memory() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; nothing elsewhere). Called between
    layers: the freed layer and its activations otherwise stay resident as heap the next layer cannot
    always reuse, and the process drifts above its one-layer footprint."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def free_memory(device: str) -> int:
    """Free bytes of the device: CUDA's free memory, or the host's available memory."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    available = proc_kib("/proc/meminfo", "MemAvailable")
    return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def should_stream(teacher, device: str, stream: bool | None = None, max_memory: str | int | None = None) -> bool:
    """`stream` when given; else whether the whole teacher plus one layer and RESERVE_BYTES exceeds
    `max_memory` (default: the device's free memory)."""
    if stream is not None:
        return stream
    budget = parse_size(max_memory) if max_memory is not None else free_memory(device)
    weights = teacher.nbytes()
    return weights + weights // max(teacher.config.get_text_config().num_hidden_layers, 1) + RESERVE_BYTES > budget


class HiddenStates:
    """Per-batch hidden states [B, L, d] on the host: in one buffer allocated up front, or in one temporary
    file when their total exceeds `spill_above` bytes (read and written a batch at a time, so the file costs
    no resident memory). Writing in place matters: a new host tensor per batch and layer, interleaved with
    the layer's short-lived buffers, fragments the heap and the process keeps growing layer after layer."""

    def __init__(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, spill_above: int, spill_dir: str | None = None
    ) -> None:
        self.shapes, self.dtype = shapes, dtype
        item = torch.empty((), dtype=dtype).element_size()
        self.sizes = [int(torch.Size(s).numel()) * item for s in shapes]
        self.offsets = [sum(self.sizes[:b]) for b in range(len(shapes))]
        self.spilled = sum(self.sizes) > spill_above
        self._fd = None
        self._mem: Tensor | None = None
        if self.spilled:
            fd, path = tempfile.mkstemp(prefix="m2d-hidden-", suffix=".bin", dir=spill_dir)
            os.unlink(path)  # the open descriptor keeps the data; nothing is left behind on a crash
            self._fd = fd
        else:
            self._mem = torch.empty(sum(self.sizes), dtype=torch.uint8)

    def _slot(self, b: int) -> Tensor:
        return self._mem[self.offsets[b] : self.offsets[b] + self.sizes[b]].view(self.dtype).view(self.shapes[b])

    def put(self, b: int, t: Tensor) -> None:
        if not self.spilled:
            self._slot(b).copy_(t.detach())
            return
        t = t.detach().to("cpu", self.dtype).contiguous()
        view = memoryview(t.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], self.offsets[b] + done)

    def get(self, b: int) -> Tensor:
        """Batch b's states: a view of the buffer (overwritten by the next `put(b)`), or read from the file."""
        if not self.spilled:
            return self._slot(b)
        buf = torch.empty(self.sizes[b], dtype=torch.uint8)
        if not read_at(self._fd, memoryview(buf.numpy()), self.offsets[b]):
            raise OSError(f"short read from the hidden-state file at batch {b}")
        return buf.view(self.dtype).reshape(self.shapes[b])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._mem = None


class _Stop(Exception):
    def __init__(self, value: Tensor) -> None:
        self.value = value


class _StandIn(nn.Module):
    """In place of a decoder layer: what the model's forward reads off its layers (Inkling-2's `attention_type`)
    is read off the layer it stands for, which is not registered (its weights may be on the meta device)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_layer", layer)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)


class _PassThrough(_StandIn):
    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        return hidden_states


class _StopBefore(_StandIn):
    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        raise _Stop(hidden_states)


class _StopAfter(_StandIn):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        self.layer = layer

    def forward(self, *args, **kwargs) -> Tensor:
        out = self.layer(*args, **kwargs)
        raise _Stop(out[0] if isinstance(out, tuple) else out)


def run_until(teacher, index: int, stop: nn.Module, **inputs) -> Tensor:
    """The model's own forward of one batch with layer `index` replaced by `stop` (which ends the pass with
    its result) and the layers before it passing the hidden states through unchanged."""
    layers = teacher.adapter.layers(teacher.skeleton)
    saved = list(layers)
    try:
        for j in range(index):
            layers[j] = _PassThrough(saved[j])
        layers[index] = stop
        teacher.skeleton.base_model(**inputs, use_cache=False)
    except _Stop as s:
        return s.value
    finally:
        for j, m in enumerate(saved):
            layers[j] = m
    raise RuntimeError(f"the forward pass of {type(teacher.skeleton).__name__} never reached layer {index}")


@torch.no_grad()
def stream_layers(
    teacher,
    batches: list[tuple[Tensor, Tensor]],
    upto: int,
    device: str,
    bar,
    hook=None,
    spill_above: int | None = None,
    spill_dir: str | None = None,
) -> HiddenStates:
    """Decoder layers 0..`upto` of every batch, one layer on `device` at a time; returns the host store of
    the hidden states after layer `upto` (the caller closes it). `hook(i, layer, masks)` may observe layer i
    (returns handles to remove, and sees the current batch's mask in `masks["mask"]`)."""
    why = teacher.adapter.unstreamable(teacher.config)
    if why:
        raise M2DError(
            f"{teacher.config.model_type} cannot be run a decoder layer at a time: {why}; use calibrate.stream=false "
            "(the whole teacher on one device)"
        )
    skel, layers = teacher.skeleton, teacher.adapter.layers(teacher.skeleton)
    shapes = [(b.shape[0], b.shape[1], teacher.config.get_text_config().hidden_size) for b, _ in batches]
    spill = spill_above if spill_above is not None else free_memory("cpu") // 2
    store = HiddenStates(shapes, teacher.dtype, spill, spill_dir)
    try:
        embed = skel.get_input_embeddings()
        skel.set_input_embeddings(teacher.module(teacher.name_of(embed)).to(device))
        try:
            for b, (b_ids, b_mask) in enumerate(batches):
                store.put(
                    b,
                    run_until(
                        teacher, 0, _StopBefore(layers[0]), input_ids=b_ids.to(device), attention_mask=b_mask.to(device)
                    ),
                )
                bar.update()
        finally:
            skel.set_input_embeddings(embed)
        for i in range(upto + 1):
            layer = teacher.module(teacher.name_of(layers[i])).to(device)
            current: dict[str, Tensor] = {}
            handles = hook(i, layer, current) if hook is not None else []
            try:
                for b, (_, b_mask) in enumerate(batches):
                    current["mask"] = b_mask.to(device)
                    store.put(
                        b,
                        run_until(
                            teacher,
                            i,
                            _StopAfter(layer),
                            inputs_embeds=store.get(b).to(device),
                            attention_mask=current["mask"],
                        ),
                    )
                    bar.update()
            finally:
                for h in handles:
                    h.remove()
            del layer
            give_back_freed_memory()
    except BaseException:
        store.close()
        raise
    return store


@torch.no_grad()
def collect_stats_streamed(
    teacher,
    ids: Tensor,
    mask: Tensor,
    batch_size: int = 8,
    device: str = "cpu",
    progress: bool = True,
    spill_above: int | None = None,
    spill_dir: str | None = None,
) -> dict[int, LayerStats]:
    """`collect_stats` of a `LazyTeacher` with one decoder layer on `device` at a time (see module doc).
    Hidden states go to a temporary file in `spill_dir` above `spill_above` bytes (default: half the
    host's available memory)."""
    adapter, skel = teacher.adapter, teacher.skeleton
    moe, layers = teacher.moe_layers(), adapter.layers(skel)
    batches = list(token_batches(ids, mask, batch_size))
    stats = {i: LayerStats.zeros(adapter.num_experts(teacher.config), device=device) for i in moe}

    def observe_moe(i: int, layer: nn.Module, current: dict[str, Tensor]) -> list:
        if i not in stats:
            return []
        block = adapter.moe_blocks(skel)[i]
        name, outer = teacher.name_of(block), teacher.name_of(layers[i])
        rel = "" if name == outer else name.removeprefix(outer + ".")  # the block may be the layer (Gemma-4)
        return [observe(adapter, layer.get_submodule(rel), stats[i], current)]

    bar = console.bar((moe[-1] + 2) * len(batches), "calibrate (streamed)", "batch") if progress else tqdm(disable=True)
    try:
        stream_layers(teacher, batches, moe[-1], device, bar, observe_moe, spill_above, spill_dir).close()
    finally:
        bar.close()
    return stats


@torch.no_grad()
def final_hidden_streamed(teacher, ids: Tensor, batch_size: int, device: str, progress: bool = False) -> Tensor:
    """The teacher's final hidden states [n, L, d] (after its last norm) of the packed blocks `ids` [n, L],
    one decoder layer on `device` at a time: the targets pass of a teacher larger than its device."""
    mask = torch.ones_like(ids)
    batches = list(token_batches(ids, mask, batch_size))
    last = teacher.config.get_text_config().num_hidden_layers - 1
    bar = console.bar((last + 2) * len(batches), "teacher (streamed)", "batch") if progress else tqdm(disable=True)
    norm = teacher.module(teacher.name_of(teacher.adapter.final_norm(teacher.skeleton))).to(device)
    try:
        store = stream_layers(teacher, batches, last, device, bar)
        try:
            return torch.cat([norm(store.get(b).to(device)).cpu() for b in range(len(batches))])
        finally:
            store.close()
    finally:
        bar.close()
