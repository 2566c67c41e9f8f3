"""Checks of model checkpoints before they are used: the files are whole, the values are finite.

A truncated download or a NaN in one expert otherwise surfaces much later as a safetensors traceback
or as "exported student is not exact: error inf". These checks name the file or the tensor instead
(one line, exit 2). Reading is streamed: one tensor at a time, so checking a teacher never holds it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

import torch

from m2d_ray.errors import M2DError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is garbage, not a header
_CHUNK = 1 << 24  # elements per isfinite pass (bounds the temporary mask)


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
            raise M2DError(f"{index} is not a weight index (no weight_map); re-download or re-export the model") from None
        missing = sorted(s for s in shards if not (d / s).is_file())
        if missing:
            raise M2DError(f"{what} {d} lacks {len(missing)} weight file(s) named in {index.name}, e.g. {missing[0]}; re-download or re-export it")
    files = [p for p in d.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    if not files:
        raise M2DError(f"{what} {d} holds no weights (*.safetensors); give a saved model directory")
    for f in files:
        if f.suffix == ".safetensors":
            _check_safetensors(f)


def _check_safetensors(path: Path) -> None:
    size = path.stat().st_size
    bad = f"{path} is not a whole safetensors file"
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _MAX_HEADER):
            raise M2DError(f"{bad} (unreadable header; truncated or corrupt): re-download or re-export the model")
        try:
            header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            raise M2DError(f"{bad} (corrupt header): re-download or re-export the model") from None
    if 8 + n + end > size:
        raise M2DError(f"{bad}: its header needs {8 + n + end:,} bytes but it has {size:,} (truncated): re-download or re-export the model")


def nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, inf count) of a tensor, in bounded memory."""
    if not (t.is_floating_point() or t.is_complex()):
        return 0, 0
    nan = inf = 0
    for part in t.detach().reshape(-1).split(_CHUNK):
        nan += int(part.isnan().sum())
        inf += int(part.isinf().sum())
    return nan, inf


def _where(key: str, t: torch.Tensor) -> str:
    """'layer 3, expert 5' for an expert tensor (per-expert key or fused [E, ...] parameter)."""
    layer = re.search(r"layers\.(\d+)\.", key)
    expert = re.search(r"experts\.(\d+)\.", key)
    parts = [f"layer {layer.group(1)}"] if layer else []
    if expert:
        parts.append(f"expert {expert.group(1)}")
    elif "experts" in key and t.dim() == 3:
        bad = (~torch.isfinite(t.detach())).flatten(1).any(1).nonzero().flatten().tolist()
        parts.append(f"expert{'s' * (len(bad) > 1)} {', '.join(map(str, bad[:8]))}{' …' * (len(bad) > 8)}")
    return f" ({', '.join(parts)})" if parts else ""


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], what: str, fix: str) -> None:
    """Raise on the first tensor with NaN/inf: '<what> <key> (layer 3, expert 5) has 1 NaN; <fix>'."""
    for key, t in tensors:
        nan, inf = nonfinite(t)
        if nan or inf:
            counts = " and ".join(f"{n:,} {w}" for n, w in ((nan, "NaN"), (inf, "inf")) if n)
            raise M2DError(f"{what} {key}{_where(key, t)} has {counts}; {fix}")


def scan(name: str, what: str = "model") -> None:
    """Whole files and finite values of a local model, read one tensor at a time (no-op for hub names)."""
    d = local_dir(name)
    if d is None:
        return
    check_files(name, what)
    from safetensors import safe_open

    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            check_finite(((k, st.get_tensor(k)) for k in st.keys()), f"{what} weight", f"{f.name} is damaged: re-download or re-export the model")


def check_model_finite(model: torch.nn.Module, what: str = "model") -> None:
    """Finite parameters of a loaded model (one pass over memory, no copy)."""
    check_finite(model.named_parameters(), f"{what} weight", "the checkpoint is damaged: re-download or re-export the model")
