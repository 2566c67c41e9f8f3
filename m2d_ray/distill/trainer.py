"""Ray Train host of the distillation loop: a TorchTrainer whose workers run `loop.run_distill`.

Each worker loads the frozen teacher and the student, joins the process group Ray Train set up
(gloo on CPU, NCCL on GPU) and, with DeepSpeed, wraps the student in a ZeRO-2 engine. Reports carry
a checkpoint (every rank's ZeRO partition lands in the same checkpoint directory). A run started
again with the same name and storage resumes from its latest checkpoint (Train V2 restores the
checkpoint manager from storage), so a killed run continues from step N, not from 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from ray import train
from ray._private import ray_constants
from ray.experimental import internal_kv
from ray.train import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
)
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2.api.callback import UserCallback

from m2d_ray import console
from m2d_ray.distill.loop import DistillJob, WorkerIO, run_distill
from m2d_ray.storage import ray_storage

#: environment forwarded to the workers (DeepSpeed's compiled-ops cache: a stale lock there hangs every run)
FORWARDED_ENV = ("TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR")


def train_func(config: dict) -> None:
    """Ray Train worker entry point."""
    os.environ.update(config.get("env", {}))
    job: DistillJob = config["job"]
    torch.set_num_threads(job.cfg.threads_per_worker)
    ctx = train.get_context()
    if job.device == "cuda":
        torch.cuda.set_device(train.torch.get_device())

    def report(metrics: dict, path: Path | None) -> None:
        train.report(metrics, checkpoint=Checkpoint.from_directory(str(path)) if path else None)

    io = WorkerIO(rank=ctx.get_world_rank(), world=ctx.get_world_size(), report=report)
    ckpt = train.get_checkpoint()
    if ckpt is None:
        run_distill(job, io)
        return
    with ckpt.as_directory() as d:
        io.restore = Path(d)
        run_distill(job, io)


class MetricsLog(UserCallback):
    """Controller side: rank 0's reports appended to a JSONL file (the controller's own output is not
    forwarded to the driver; `follow` prints the file's lines there)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(Path(path).resolve())

    def after_report(self, run_context, metrics, checkpoint):
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics[0]) + "\n")


def progress_line(m: dict, label: str = "") -> str:
    head = f"[distill{' ' + label if label else ''}] step {m['step']}: "
    val = f"val ppl {m['val_ppl']:.2f} (start {m['val_ppl_initial']:.2f})"
    if "tokens_per_s" not in m:  # the final report repeated after a resume: no training in it
        return head + val
    loss = (
        f"train loss {m['train_loss']:.4f}"
        if "train_loss" in m
        else f"train loss (top-K buckets, a lower bound) {m['train_loss_buckets']:.4f}"
    )
    return (
        head + f"{loss}, {val}, {m['tokens_per_s']:,.0f} tok/s training "
        f"(MFU {m['mfu']:.1%}; eval {m['eval_s']:.1f} s, checkpoint {m['ckpt_s']:.1f} s)"
    )


@contextlib.contextmanager
def follow(path: str | Path, label: str = "", every_s: float = 1.0, total: int | None = None) -> Iterator[None]:
    """On the driver, while the block runs: a progress line for each line appended to a MetricsLog file,
    and a live bar over the `total` steps when stderr is a terminal."""
    path, stop = Path(path), threading.Event()
    seen = len(path.read_text().splitlines()) if path.exists() else 0

    def poll() -> None:
        nonlocal seen
        with console.bar(total, f"distill {label}".strip(), "step") as b:
            while True:
                done = stop.wait(every_s)
                lines = path.read_text().splitlines() if path.exists() else []
                for line in lines[seen:]:
                    m = json.loads(line)
                    console.say(progress_line(m, label))
                    b.update(m["step"] - b.n)
                seen = len(lines)
                if done:
                    return

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def has_dashboard() -> bool:
    """Whether Ray's dashboard, which serves the State API, answers at the address the GCS holds for it (Ray writes
    the address even when it starts no dashboard: a connection tells)."""
    key, namespace = ray_constants.DASHBOARD_ADDRESS, ray_constants.KV_NAMESPACE_DASHBOARD
    address = internal_kv._internal_kv_get(key, namespace=namespace)
    host, _, port = (address or b"").decode().rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return True
    except (OSError, ValueError):
        return False


class Trainer(TorchTrainer):
    """TorchTrainer less two of Ray Train's per-fit actors where they can do nothing, each a process that imports Ray
    before the student's first step:

    - the placement-group cleaner, on a cluster with no dashboard: it (a detached actor that removes the worker group's
      placement group should the controller die ungracefully) asks the State API whether the controller lives, and
      without a dashboard (a local Ray here: `ray[data,tune,train]` installs none) each ask waits out its 10-s timeout,
      so every fit ended 12 s late; the placement group is the controller's, and Ray removes it with its owner. Where
      a dashboard answers it stays;
    - the datasets' manager (an actor that imports Ray Data), when the trainer is given no Ray Dataset: a student reads
      its token shards itself (distill/tokens.py).
    """

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        idle = (PlacementGroupCleanerCallback,) * (not has_dashboard()) + (DatasetsCallback,) * (not self.datasets)
        return [c for c in callbacks if not isinstance(c, idle)]


def fit(job: DistillJob, callbacks: list | None = None):
    """Build and fit the TorchTrainer of one student, its checkpoints in `job.checkpoints` (a path or a storage
    URL every node reaches) under `job.run_name`; returns Ray Train's Result."""

    cfg = job.cfg
    use_gpu = cfg.gpus_per_worker > 0
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    trainer = Trainer(
        train_func,
        train_loop_config={"job": job, "env": env},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=cfg.workers,
            use_gpu=use_gpu,
            accelerator_type=cfg.accelerator if use_gpu else None,
            resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": cfg.gpus_per_worker} if use_gpu else {})},
        ),
        run_config=RunConfig(
            name=job.run_name,
            **(ray_storage(job.checkpoints) if job.checkpoints else {}),
            callbacks=callbacks or [],
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            failure_config=FailureConfig(max_failures=job.max_failures),
        ),
    )
    return trainer.fit()
