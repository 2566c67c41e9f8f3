"""A gloo process group of ranks on this machine: how tests and benchmarks hold one rank against several.

Ray Train makes the real groups; these are the same environment variables and backend, started by
`torch.multiprocessing.spawn` so that a check of two ranks runs on a laptop without a cluster.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int) -> None:
    """This process as rank `rank` of a gloo group of `world`, with the environment Ray Train sets on a node (one
    thread: the ranks share the cores). The caller destroys the group (or uses `gloo_rank`)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[None]:
    """`join`, and the group left on exit."""
    join(rank, world, port)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args) -> None:
    """`fn(rank, world, port, *args)` in each of `world` fresh processes, joined (a rank's error raised here)."""
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)
