"""Connecting to Ray: a running cluster (ray.address / RAY_ADDRESS / `ray job submit`) or a local one."""

from __future__ import annotations

import os
from pathlib import Path

import ray

from m2d_ray import console
from m2d_ray.config import RayConfig


_CONNECTED: bool | None = None  # whether ensure_ray joined an existing cluster (None: Ray was up already)


def on_cluster() -> bool:
    """Whether this run's Ray is a cluster (an address was given, or it has several nodes) rather than a
    local instance: then nothing may be passed through the driver's disk."""
    if _CONNECTED is not None:
        return _CONNECTED
    return ray.is_initialized() and sum(n["Alive"] for n in ray.nodes()) > 1


def ensure_ray(cfg: RayConfig) -> None:
    """Use the Ray already initialised in this process, else connect or start one.

    A local Ray gets more logical CPUs than cores (`num_cpus`, default 4): with as many as the
    cores a Tune trial that starts workers deadlocked here (stack-notes). Token auth, on by default
    for local clusters since Ray 2.59, is turned off for a local instance only. Under a command's
    console session the workers' output is forwarded to the driver, i.e. into the command's log.
    """
    global _CONNECTED
    if ray.is_initialized():
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    logs = console.active()
    if address:
        ray.init(address=address, log_to_driver=logs)
        _CONNECTED = True
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, log_to_driver=logs)
    _CONNECTED = False


def trial_error(trial) -> str:
    """The last line of a failed Tune trial's error (the driver-side file: get_error() reads a synced copy, often None)."""
    local = trial.error_file
    err = Path(local).read_text() if local and Path(local).exists() else trial.get_error()
    lines = [ln for ln in str(err or "trial raised").splitlines() if ln.strip()]
    return lines[-1][:500] if lines else "trial raised"


def node_types() -> tuple[list, str]:
    """(node types, where from) of the Ray this process is connected to: the autoscaler's node types when
    there is one (reported to the GCS, or the cluster launcher's config on the head), else the live nodes."""
    from m2d_ray.plan.devices import NodeType, from_cluster_yaml

    try:
        from ray._private.state import state  # internal API: pinned ray==2.60.0

        reported = state.get_cluster_config()
    except Exception:
        reported = None
    if reported is not None and reported.node_group_configs:
        return [NodeType(g.name, dict(g.resources)) for g in reported.node_group_configs if g.max_count != 0], "the autoscaler's node types"
    boot = Path.home() / "ray_bootstrap_config.yaml"  # what `ray up` gives the head's autoscaler
    if on_cluster() and boot.is_file():
        return from_cluster_yaml(boot), f"the autoscaler's node types ({boot})"
    live = [n for n in ray.nodes() if n.get("Alive")]
    return [NodeType(n.get("NodeManagerAddress") or n["NodeID"][:8], dict(n.get("Resources") or {})) for n in live], "the live nodes"
