"""Connecting to Ray: a running cluster (ray.address / RAY_ADDRESS / `ray job submit`) or a local one."""

from __future__ import annotations

import os
import re
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from m2d_ray import console
from m2d_ray.config import RayConfig
from m2d_ray.plan.devices import NodeType, from_cluster_yaml

# Imported inside functions: what may be missing (optional packages, Ray's internal API), where its absence is handled.

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
    for local clusters since Ray 2.59, and Ray Train's preemption watcher are turned off for a local instance
    only. Under a command's console session the workers' output is forwarded to the driver, i.e. into the
    command's log.
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
    # a local Ray is one machine, no node of which is preempted: Ray Train's preemption watcher would only be one more
    # actor process started for each student (the workers inherit this environment)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    ray.init(
        address="local", num_cpus=cfg.num_cpus, include_dashboard=False, log_to_driver=logs
    )  # never a cluster found in /tmp/ray
    _CONNECTED = False


def on_driver_node() -> dict:
    """Ray options that place an actor on the driver's node: it lives as long as the run's driver, not as
    long as a worker node that the autoscaler removes when idle or a spot market reclaims."""

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


# a unit's failure because its node went away (Ray's own words, from its exceptions and its core's messages)
_NODE_LOST = re.compile(
    r"ActorDiedError|ActorUnavailableError|NodeDiedError|WorkerCrashedError|OwnerDiedError|its node has died|"
    r"node it was running on is dead|node was terminated|is unavailable|worker died unexpectedly"
)
_ADDRESS = re.compile(r"Node IP: ([^\s,]+)|\bip: (\S+)|node_ip(?:_address)?[=:] ?'?([\w.:-]+)|Node Id: ([0-9a-f]{12})")
_BLIND = re.compile(
    r"node [^\s{]+ cannot see the run's storage [^\n]*"
)  # RunStorage.ensure_visible's line (not its source, quoted in a traceback)


def failure(text: str, stage: str, retried: int, retries: int, address: str | None = None) -> str:
    """A failed trial's or task's error as the run records it: a node that cannot see the storage in its own
    line; a lost node in the user's words ("node ADDRESS lost during STAGE (spot reclaim or crash); retried
    N of M times"), Ray's own error going to the log; else the error's last line. `address`: where the unit last
    ran, for an error that does not say (an unavailable actor)."""
    if blind := _BLIND.findall(text):
        return blind[-1][:500]
    if _NODE_LOST.search(text):
        m = _ADDRESS.search(text)
        address = next((g for g in m.groups() if g), None) if m else address
        console.note(f"{stage}: Ray's error for a lost node:\n{text.strip()}")
        where = f" (Ray's error: {console.log_path()})" if console.log_path() else ""
        node = address or "(address not reported)"
        return f"node {node} lost during {stage} (spot reclaim or crash); retried {retried} of {retries} times{where}"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:500] if lines else "failed"


def trial_traceback(trial) -> str:
    """A failed Tune trial's whole error text (the driver-side file: get_error() reads a synced copy, often None)."""
    local = trial.error_file
    return str((Path(local).read_text() if local and Path(local).exists() else trial.get_error()) or "trial raised")


def trial_error(trial, stage: str, retries: int) -> str:
    """A failed Tune trial's error (`failure`). Tune calls back on the trial's last failure, after `retries`
    retries."""
    last = trial.last_result or {}  # Tune's results carry the node each came from
    return failure(
        trial_traceback(trial), stage, max(0, min(trial.num_failures - 1, retries)), retries, last.get("node_ip")
    )


def node_types() -> tuple[list | None, str]:
    """(node types, where from) of the Ray this process is connected to: the autoscaler's node types when
    there is one (reported to the GCS, or the cluster launcher's config on the head), else the live nodes;
    None when an autoscaler runs whose node types are not known here (then the live nodes say nothing)."""

    try:
        from ray._private.state import state  # internal API: pinned ray==2.60.0

        reported = state.get_cluster_config()
    except Exception:
        reported = None
    if reported is not None and reported.node_group_configs:
        return [
            NodeType(g.name, dict(g.resources), g.max_count if g.max_count > 0 else None)
            for g in reported.node_group_configs
            if g.max_count != 0
        ], "the autoscaler's node types"
    boot = Path.home() / "ray_bootstrap_config.yaml"  # what `ray up` gives the head's autoscaler
    if on_cluster() and boot.is_file():
        return from_cluster_yaml(boot), f"the autoscaler's node types ({boot})"
    if on_cluster() and _autoscaler_running():  # (a local instance's monitor reports a status too, but adds no node)
        return (
            None,
            "an autoscaler whose node types are unknown here (give --cluster CLUSTER_YAML to check against them)",
        )
    live = [n for n in ray.nodes() if n.get("Alive")]
    return [
        NodeType(n.get("NodeManagerAddress") or n["NodeID"][:8], dict(n.get("Resources") or {})) for n in live
    ], "the live nodes"


def _autoscaler_running() -> bool:
    """Whether an autoscaler reports to this cluster (its status, what `ray status` prints, is in the GCS)."""
    try:
        from ray._private import ray_constants
        from ray.experimental.internal_kv import _internal_kv_get

        return _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS) is not None
    except Exception:
        return False
