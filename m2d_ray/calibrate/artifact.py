"""The statistics artifact: `stats.safetensors` + `manifest.json` (model, data, token count, checksum).

Written atomically; `load_matching` returns the stored statistics only when the manifest names the
same teacher and the same calibration tokens, so repeated runs reuse them instead of recomputing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from m2d_ray.artifacts import atomic_dir, sha256_file
from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.checkpoint import check_finite
from m2d_ray.errors import M2DError

FORMAT = "m2d-calibration-stats"
VERSION = 1
STATS_FILE = "stats.safetensors"
MANIFEST_FILE = "manifest.json"


@dataclass
class StatsArtifact:
    layers: dict[int, LayerStats]
    manifest: dict

    @property
    def checksum(self) -> str:
        return self.manifest["sha256"]


def _prefix(layer: int) -> str:
    return f"layer{layer}."


def save_stats(
    out: str | Path,
    layers: dict[int, LayerStats],
    model: dict,
    data: dict,
    extra: dict | None = None,
    overwrite: bool = False,
) -> StatsArtifact:
    """Write the artifact atomically; statistics with NaN/inf are refused (the teacher overflowed on the data)."""
    tensors = {}
    for i, st in layers.items():
        tensors.update(st.to_tensors(_prefix(i)))
    check_finite(
        tensors.items(),
        "statistic",
        "the teacher's outputs overflow on this data; check the teacher and the calibration text",
    )
    with atomic_dir(out, "statistics", overwrite) as tmp:
        save_file(tensors, str(tmp / STATS_FILE))
        first = next(iter(layers.values()))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": model,
            "data": data,
            "layers": sorted(layers),
            "num_experts": first.num_experts,
            "n_tokens": int(first.n),
            "sha256": sha256_file(tmp / STATS_FILE),
            **(extra or {}),
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return StatsArtifact(layers=layers, manifest=manifest)


def load_stats(path: str | Path) -> StatsArtifact:
    path = Path(path)
    mf = path / MANIFEST_FILE
    if not mf.exists():
        raise M2DError(
            f"{path} is not a statistics directory (no {MANIFEST_FILE}); run `m2d calibrate --out {path}` first"
        )
    try:
        manifest = json.loads(mf.read_text())
    except ValueError:
        raise M2DError(f"{mf} is not valid JSON (corrupted?); recalibrate") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise M2DError(
            f"{path} holds {manifest.get('format')} v{manifest.get('version')}; expected {FORMAT} v{VERSION}: "
            "recalibrate"
        )
    if not (path / STATS_FILE).is_file() or sha256_file(path / STATS_FILE) != manifest["sha256"]:
        raise M2DError(f"{path / STATS_FILE} does not match its manifest checksum (corrupted?); recalibrate")
    tensors = load_file(str(path / STATS_FILE))
    check_finite(tensors.items(), f"statistic in {path / STATS_FILE}:", "recalibrate (m2d calibrate --overwrite)")
    layers = {i: LayerStats.from_tensors(tensors, _prefix(i)) for i in manifest["layers"]}
    return StatsArtifact(layers=layers, manifest=manifest)


def load_matching(path: str | Path, model: dict, data: dict) -> StatsArtifact | None:
    """The stored artifact if it was computed from the same teacher and tokens, else None."""
    path = Path(path)
    if not (path / MANIFEST_FILE).exists():
        return None
    try:
        art = load_stats(path)
    except M2DError:
        return None
    same_data = all(art.manifest["data"].get(k) == data.get(k) for k in ("tokens_sha256", "n_tokens", "seq_len"))
    return art if art.manifest["model"] == model and same_data else None
