"""Tensors read by name from a checkpoint's safetensors shards, without loading the model.

A shard is `u64 header length | JSON header | raw data`; the header gives each tensor's dtype, shape
and byte range. Each shard is memory-mapped once; a read copies only the bytes of the tensor (or of
the requested rows along its first dimension, e.g. a few experts of a fused [E, ...] tensor) and then
releases those pages from the process (`madvise(MADV_DONTNEED)`), so resident memory holds the copies
the caller keeps and nothing else. Headers are validated when a shard is opened: a truncated or
corrupt file fails with one line naming it.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from m2d_ray.errors import M2DError

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_PAGE = mmap.PAGESIZE


class Shard:
    """One safetensors file: its validated header and a read-only memory map."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < n <= size - 8:
                    raise ValueError(f"header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + n else None
            self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
            data = size - 8 - n
            for name, e in self.entries.items():
                start, end = e["data_offsets"]
                expected = math.prod(e["shape"]) * torch.empty((), dtype=_DTYPES[e["dtype"]]).element_size()
                if not (0 <= start <= end <= data and end - start == expected):
                    raise ValueError(f"tensor {name} spans bytes {start}..{end} of {data} (needs {expected})")
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise M2DError(f"checkpoint file {path} is truncated or corrupt ({exc}); download or save it again") from None
        self._base = 8 + n

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.entries[name]["dtype"]]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def nbytes(self, name: str) -> int:
        start, end = self.entries[name]["data_offsets"]
        return end - start

    def read(self, name: str, rows: Sequence[int] | None = None) -> Tensor:
        """The tensor `name`, or only `rows` of its first dimension (in that order), as a new CPU tensor."""
        shape, dtype = self.shape(name), self.dtype(name)
        start = self._base + self.entries[name]["data_offsets"][0]
        if rows is None:
            buf = torch.empty(self.nbytes(name), dtype=torch.uint8)
            self._fill(buf.numpy(), start)
            return buf.view(dtype).reshape(shape)
        row = self.nbytes(name) // max(shape[0], 1)
        buf = torch.empty(len(rows), row, dtype=torch.uint8)
        for j, r in enumerate(rows):
            if not 0 <= r < shape[0]:
                raise IndexError(f"row {r} of {name} (first dimension {shape[0]})")
            self._fill(buf[j].numpy(), start + r * row)
        return buf.view(dtype).reshape(len(rows), *shape[1:])

    def _fill(self, dst: np.ndarray, offset: int) -> None:
        """Copy dst.size bytes at `offset` of the file into dst, then give the mapped pages back."""
        if dst.size == 0:
            return
        dst[:] = np.frombuffer(self._map, dtype=np.uint8, count=dst.size, offset=offset)
        lo = offset // _PAGE * _PAGE
        self._map.madvise(mmap.MADV_DONTNEED, lo, offset + dst.size - lo)


class Checkpoint:
    """Every tensor of a model directory's safetensors shards, by name (every shard's header checked on open)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self._shards: dict[str, Shard] = {}
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise M2DError(f"checkpoint index {index} is corrupt ({exc}); download or save it again") from None
            self._file_of = dict(weight_map)
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise M2DError(f"{self.dir} holds no *.safetensors weights; save the model with save_pretrained (safetensors) first")
            self._file_of = {name: f.name for f in files for name in self._shard(f.name).entries}
        for file in sorted(set(self._file_of.values())):  # fail now, naming the file, not in the middle of a build
            self._shard(file)

    def _shard(self, file: str) -> Shard:
        if file not in self._shards:
            path = self.dir / file
            if not path.exists():
                raise M2DError(f"checkpoint file {path} is missing (named by {INDEX_FILE}); download it again")
            self._shards[file] = Shard(path)
        return self._shards[file]

    def names(self) -> set[str]:
        return set(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shard(self, name: str) -> Shard:
        return self._shard(self._file_of[name])

    def read(self, name: str, rows: Sequence[int] | None = None) -> Tensor:
        return self.shard(name).read(name, rows)

    def nbytes(self) -> int:
        """Bytes of all tensors (as stored)."""
        return sum(self.shard(n).nbytes(n) for n in self._file_of)
