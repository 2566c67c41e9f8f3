"""Model checkpoints: checked before they are used, and read tensor by tensor without loading the model.

Checks: the files are whole, the values are finite. A truncated download or a NaN in one expert
otherwise surfaces much later as a safetensors traceback or as "exported student is not exact: error
inf". These checks name the file or the tensor instead (one line, exit 2). Reading is streamed: one
tensor at a time, so checking a teacher never holds it.

Reading (`Checkpoint`, `Shard`): a safetensors shard is `u64 header length | JSON header | raw data`;
the header gives each tensor's dtype, shape and byte range. Each shard is opened once; a read copies
only the bytes of the tensor (or of the requested rows along its first dimension, e.g. a few experts of
a fused [E, ...] tensor) with positional reads into the caller's tensor (no memory map), so resident
memory holds the copies the caller keeps and nothing else.
Headers are validated when a shard is opened, with the same one-line messages as `check_files`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor

from m2d_ray import storage
from m2d_ray.errors import M2DError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is garbage, not a header
_CHUNK = 1 << 24  # elements per isfinite pass (bounds the temporary mask)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    **({"F8_E8M0": torch.float8_e8m0fnu} if hasattr(torch, "float8_e8m0fnu") else {}),  # ue8m0 FP8 scales
}
_FIX = "re-download or re-export the model"


def local_dir(name: str) -> Path | None:
    """The model directory `name` refers to, or None for a hub name."""
    p = Path(name).expanduser()
    return p if p.exists() else None


def check_files(name: str, what: str = "model") -> None:
    """A local model directory has weights, every shard its index names, and whole safetensors files."""
    d = local_dir(name)
    if d is None:
        return  # a hub name: transformers resolves and verifies the download
    if not d.is_dir():
        raise M2DError(f"{what} {name!r} is a file; give the model directory (config.json + weights)")
    for index in d.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError):
            raise M2DError(
                f"{index} is not a weight index (no weight_map); re-download or re-export the model"
            ) from None
        missing = sorted(s for s in shards if not (d / s).is_file())
        if missing:
            raise M2DError(
                f"{what} {d} lacks {len(missing)} weight file(s) named in {index.name}, e.g. {missing[0]}; re-download "
                "or re-export it"
            )
    files = [p for p in d.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    if not files:
        raise M2DError(f"{what} {d} holds no weights (*.safetensors); give a saved model directory")
    for f in files:
        if f.suffix == ".safetensors":
            _check_safetensors(f)


def _read_header(path: Path) -> tuple[int, dict, int]:
    """(header length, header, file size) of a safetensors file whose header fits and whose tensors end
    inside the file; otherwise an M2DError naming the file."""
    with path.open("rb") as f:
        return _parse_header(lambda offset, n: os.pread(f.fileno(), n, offset), path.stat().st_size, str(path))


def _parse_header(read: Callable[[int, int], bytes], size: int, where: str) -> tuple[int, dict, int]:
    """`_read_header` of a file of `size` bytes read by `read(offset, n)` (a local file or a storage object)."""
    bad = f"{where} is not a whole safetensors file"
    head = read(0, 8) if size >= 8 else b""
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or n > min(size - 8, _MAX_HEADER):
        raise M2DError(f"{bad} (unreadable header; truncated or corrupt): {_FIX}")
    try:
        header = json.loads(read(8, n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise M2DError(f"{bad} (corrupt header): {_FIX}") from None
    if 8 + n + end > size:
        raise M2DError(f"{bad}: its header needs {8 + n + end:,} bytes but it has {size:,} (truncated): {_FIX}")
    return n, header, size


def read_stored_tensor(url: str, names: Sequence[str]) -> tuple[str, Tensor] | None:
    """(name, tensor) of the first of `names` that the safetensors checkpoint in the storage directory `url`
    holds, by ranged reads of its index, one shard's header and the tensor's bytes: a rank reads one
    tensor of a teacher in object storage without fetching the teacher. None when none is there."""

    files = storage.list_names(url)
    if INDEX_FILE in files:
        try:
            weight_map = json.loads(storage.read_bytes(storage.join(url, INDEX_FILE)))["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise M2DError(f"{storage.join(url, INDEX_FILE)} is not a weight index (no weight_map); {_FIX}") from None
        candidates = [(n, weight_map[n]) for n in names if n in weight_map]
    else:
        candidates = [(n, f) for n in names for f in files if f.endswith(".safetensors")]
    for name, file in candidates:
        where = storage.join(url, file)
        with storage.open_ranged(where) as f:
            n, header, _ = _parse_header(lambda offset, k: f.read_at(k, offset), f.size(), where)
            if name not in header:
                continue
            e = header[name]
            start, end = e["data_offsets"]
            buf = torch.empty(end - start, dtype=torch.uint8)
            data = f.read_at(end - start, 8 + n + start)
            if len(data) != end - start:
                raise M2DError(f"{where} ended before byte {8 + n + end}; {_FIX}")
            buf.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            return name, buf.view(_DTYPES[e["dtype"]]).reshape(e["shape"])
    return None


def _check_safetensors(path: Path) -> None:
    _read_header(path)


def nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, inf count) of a tensor, in bounded memory."""
    if not (t.is_floating_point() or t.is_complex()):
        return 0, 0
    nan = inf = 0
    for part in t.detach().reshape(-1).split(_CHUNK):
        part = part.float() if part.element_size() == 1 else part  # float8 has no isinf of its own
        nan += int(part.isnan().sum())
        inf += int(part.isinf().sum())
    return nan, inf


def _where(key: str, t: torch.Tensor, experts: Sequence[int] | None = None) -> str:
    """'layer 3, expert 5' for an expert tensor (per-expert key or fused [E, ...] parameter; `experts`
    maps the rows of a fused tensor holding only some experts to their ids)."""
    layer = re.search(r"layers\.(\d+)\.", key)
    expert = re.search(r"experts\.(\d+)\.", key)
    parts = [f"layer {layer.group(1)}"] if layer else []
    if expert:
        parts.append(f"expert {expert.group(1)}")
    elif "experts" in key and t.dim() == 3:
        bad = (~torch.isfinite(t.detach())).flatten(1).any(1).nonzero().flatten().tolist()
        if experts is not None:
            bad = [experts[r] for r in bad]
        parts.append(f"expert{'s' * (len(bad) > 1)} {', '.join(map(str, bad[:8]))}{' …' * (len(bad) > 8)}")
    return f" ({', '.join(parts)})" if parts else ""


def check_finite(
    tensors: Iterable[tuple[str, torch.Tensor]], what: str, fix: str, experts: Sequence[int] | None = None
) -> None:
    """Raise on the first tensor with NaN/inf: '<what> <key> (layer 3, expert 5) has 1 NaN; <fix>'."""
    for key, t in tensors:
        nan, inf = nonfinite(t)
        if nan or inf:
            counts = " and ".join(f"{n:,} {w}" for n, w in ((nan, "NaN"), (inf, "inf")) if n)
            raise M2DError(f"{what} {key}{_where(key, t, experts)} has {counts}; {fix}")


def scan(name: str, what: str = "model") -> None:
    """Whole files and finite values of a local model, read one tensor at a time (no-op for hub names)."""
    d = local_dir(name)
    if d is None:
        return
    check_files(name, what)

    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            check_finite(
                ((k, st.get_tensor(k)) for k in st.keys()),
                f"{what} weight",
                f"{f.name} is damaged: re-download or re-export the model",
            )


def check_model_finite(model: torch.nn.Module, what: str = "model") -> None:
    """Finite parameters of a loaded model (one pass over memory, no copy)."""
    check_finite(
        model.named_parameters(), f"{what} weight", "the checkpoint is damaged: re-download or re-export the model"
    )


# ---- reading tensors by name ----------------------------------------------------------------------
def read_at(fd: int, dst: memoryview, offset: int) -> bool:
    """Fill the byte view `dst` from `offset` of the open file `fd` with positional reads; False when the
    file ends first."""
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


class Shard:
    """One safetensors file: its validated header and an open descriptor for positional reads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            n, header, size = _read_header(path)
        except OSError as exc:
            raise M2DError(f"{path} cannot be read ({exc.strerror or exc}); {_FIX}") from None
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
        data = size - 8 - n
        for name, e in self.entries.items():
            try:
                start, end = e["data_offsets"]
                expected = math.prod(e["shape"]) * torch.empty((), dtype=_DTYPES[e["dtype"]]).element_size()
            except (KeyError, TypeError, ValueError):
                raise M2DError(
                    f"{path} is not a whole safetensors file (corrupt header entry {name}): {_FIX}"
                ) from None
            if not (0 <= start <= end <= data and end - start == expected):
                raise M2DError(
                    f"{path} is not a whole safetensors file (corrupt header: tensor {name} spans bytes {start}..{end} "
                    f"of {data}, needs {expected}): {_FIX}"
                )
        self._file = open(path, "rb", buffering=0)  # closed with the shard
        self._base = 8 + n

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.entries[name]["dtype"]]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def nbytes(self, name: str) -> int:
        start, end = self.entries[name]["data_offsets"]
        return end - start

    def read(self, name: str, rows: Sequence[int] | None = None, out: Tensor | None = None) -> Tensor:
        """The tensor `name`, or only `rows` of its first dimension (in that order), as a new CPU tensor, or
        written into `out` (contiguous, of its dtype and element count: no second copy of the bytes)."""
        shape, dtype = self.shape(name), self.dtype(name)
        start = self._base + self.entries[name]["data_offsets"][0]
        if out is not None and rows is None:
            if not out.is_contiguous() or out.dtype != dtype or out.numel() != math.prod(shape):
                raise ValueError(f"{name}: cannot read {dtype} {list(shape)} into {out.dtype} {list(out.shape)}")
            self._fill(out.view(-1).view(torch.uint8).numpy(), start)
            return out
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
        """Read dst.size bytes at `offset` of the file into dst. Positional reads, not a memory map: a mapped
        file keeps the pages around every read resident (the kernel maps neighbours on each fault), and a
        process reading a teacher layer by layer grew by megabytes per layer."""
        if not read_at(self._file.fileno(), memoryview(dst).cast("B"), offset):
            raise M2DError(f"{self.path} ended before byte {offset + dst.size}; {_FIX}")


class Checkpoint:
    """Every tensor of a model directory's safetensors shards, by name (every shard's header checked on open)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self._shards: dict[str, Shard] = {}
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self._file_of = dict(weight_map)
            except (ValueError, KeyError, TypeError):
                raise M2DError(f"{index} is not a weight index (no weight_map); {_FIX}") from None
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise M2DError(
                    f"{self.dir} holds no weights (*.safetensors); save the model with save_pretrained (safetensors) "
                    "first"
                )
            self._file_of = {name: f.name for f in files for name in self._shard(f.name).entries}
        for file in sorted(set(self._file_of.values())):  # fail now, naming the file, not in the middle of a build
            self._shard(file)

    def _shard(self, file: str) -> Shard:
        if file not in self._shards:
            path = self.dir / file
            if not path.is_file():
                raise M2DError(
                    f"{self.dir} lacks the weight file {file} named in {INDEX_FILE} ({path} is missing); {_FIX}"
                )
            self._shards[file] = Shard(path)
        return self._shards[file]

    def names(self) -> set[str]:
        return set(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shard(self, name: str) -> Shard:
        return self._shard(self._file_of[name])

    def read(self, name: str, rows: Sequence[int] | None = None, out: Tensor | None = None) -> Tensor:
        return self.shard(name).read(name, rows, out)

    def nbytes(self) -> int:
        """Bytes of all tensors (as stored)."""
        return sum(self.shard(n).nbytes(n) for n in self._file_of)
