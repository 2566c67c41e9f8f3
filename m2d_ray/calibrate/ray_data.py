"""Distributed calibration on Ray Data: the same statistics artifact as `calibrate()`, computed by a pool.

The tokenised calibration set becomes a Ray Dataset of sequences; `map_batches` runs an actor pool
in which each actor loads the teacher once and turns a batch into the additive partial sums of
`collect_stats` (one output row per batch). The driver adds the rows up in float64 and writes the
artifact with `save_stats`, so it is interchangeable with the single-process one (and reused alike).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import ray
import torch

from m2d_ray.accelerators import pin
from m2d_ray.arch import get_adapter
from m2d_ray.calibrate import data_fingerprint
from m2d_ray.calibrate.artifact import StatsArtifact, load_matching, save_stats
from m2d_ray.calibrate.collect import collect_stats
from m2d_ray.calibrate.stats import LayerStats
from m2d_ray.calibrate.stream import collect_stats_streamed, should_stream
from m2d_ray.data.ray_tokens import in_order
from m2d_ray.data.text import TokenSet
from m2d_ray.models import load_teacher, model_config, model_fingerprint
from m2d_ray.weights import open_teacher


class StatsActor:
    """Holds one teacher (loaded whole, or streamed layer by layer when it does not fit the actor's device);
    called with a block of sequences, returns that block's partial sums, computed `batch_size` sequences
    at a time exactly as the single-process pass batches them."""

    def __init__(
        self, model: str, device: str, threads: int, batch_size: int, stream: bool | None, max_memory: str | None
    ) -> None:

        torch.set_num_threads(threads)
        self.device, self.batch_size = device, batch_size
        lazy = open_teacher(model, device=device)
        self.streamed = should_stream(lazy, device, stream, max_memory)
        self.teacher = lazy if self.streamed else load_teacher(model, device=device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:

        t = self.teacher
        seqs = torch.from_numpy(np.ascontiguousarray(batch["data"]))  # [B, 2, L]: ids, mask
        ids, mask = seqs[:, 0], seqs[:, 1]
        if self.streamed:
            stats = collect_stats_streamed(t, ids, mask, batch_size=self.batch_size, device=self.device, progress=False)
        else:
            stats = collect_stats(t.model, t.adapter, ids, mask, batch_size=self.batch_size, progress=False)
        out = {}
        for i, st in stats.items():
            out.update({name: v.numpy()[None] for name, v in st.to_tensors(f"layer{i}.").items()})
        return out


def calibrate_ray(
    model: str,
    tokens: TokenSet,
    data_spec: str,
    out: str | Path,
    batch_size: int = 8,
    actors: int = 2,
    gpus_per_actor: float = 0.0,
    accelerator: str | None = None,
    threads: int = 1,
    stream: bool | None = None,
    max_memory: str | None = None,
    load_from: str | None = None,
) -> tuple[StatsArtifact, bool]:
    """Statistics of `model` on `tokens` with a Ray Data actor pool; reuses `out` when it matches.

    Returns (artifact, reused). Needs a running Ray (`ray.init`). The driver never loads the weights;
    the actors read them from `load_from` (a storage URL every node reaches), default `model`. Each actor
    streams the teacher layer by layer when `stream` is set or it does not fit `max_memory`; `accelerator` pins the
    actors to nodes with that GPU type.
    """
    config = model_config(model)
    model_fp, data_fp = model_fingerprint(model, config), data_fingerprint(data_spec, tokens)
    if (found := load_matching(out, model_fp, data_fp)) is not None:
        return found, True

    adapter = get_adapter(config)
    seqs = torch.stack([tokens.ids, tokens.mask], dim=1).numpy()
    # blocks cut at batch boundaries: every actor call sees exactly a batch of the single-process pass
    n_batches = -(-len(seqs) // batch_size)
    per_block = max(1, -(-n_batches // (4 * actors))) * batch_size
    with in_order():  # the partial sums added in the blocks' order: the same float64 statistics on every run
        ds = ray.data.from_numpy([seqs[i : i + per_block] for i in range(0, len(seqs), per_block)])
        partials = ds.map_batches(
            StatsActor,
            batch_size=per_block,  # a streaming actor reads each layer once per block
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_gpus=gpus_per_actor,
            num_cpus=1,
            **({"resources": pin(accelerator)} if gpus_per_actor > 0 and accelerator else {}),
            fn_constructor_kwargs={
                "model": load_from or model,
                "device": "cuda" if gpus_per_actor > 0 else "cpu",
                "threads": threads,
                "batch_size": batch_size,
                "stream": stream,
                "max_memory": max_memory,
            },
            batch_format="numpy",
        )
        total: dict[str, np.ndarray] = {}
        for rows in partials.iter_batches(batch_size=None, batch_format="numpy"):
            for name, v in rows.items():
                s = np.asarray(v, dtype=np.float64).sum(0)
                total[name] = total[name] + s if name in total else s
    tensors = {name: torch.from_numpy(np.asarray(v)) for name, v in total.items()}
    layers = sorted({int(name.split(".")[0].removeprefix("layer")) for name in tensors})
    stats = {i: LayerStats.from_tensors(tensors, f"layer{i}.") for i in layers}
    return save_stats(
        out, stats, model_fp, data_fp, {"top_k": adapter.top_k(config), "engine": "ray-data"}, overwrite=True
    ), False
