"""GPUs by accelerator type, a cluster's node types, and whether a stage's resource request fits one.

A node type is what the autoscaler can start (cluster.yaml's `available_node_types`) or, without an
autoscaler, a node that is up. Its GPU's memory comes from Ray's `accelerator_type:<GPU>` resource (Ray
adds it on a node with that GPU; cluster.yaml's GPU types name it) through GPU_MEMORY.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from m2d_ray.accelerators import GPU_MEMORY, RESOURCE, pin
from m2d_ray.errors import M2DError

# Imported inside functions: what may be missing (optional packages, Ray's internal API), where its absence is handled;
# Ray (`m2d plan` and the checks read this module without importing it).


@dataclass(frozen=True)
class NodeType:
    name: str
    resources: dict = field(default_factory=dict)
    max_workers: int | None = None  # how many the autoscaler may start (None = not known)
    instance: str | None = None  # the cloud's instance type (node_config.InstanceType): what it is priced by
    spot: bool = False  # node_config asks for spot capacity

    @property
    def accelerator(self) -> str | None:
        return next((k.removeprefix(RESOURCE) for k in self.resources if k.startswith(RESOURCE)), None)

    @property
    def gpus(self) -> float:
        return float(self.resources.get("GPU", 0))

    @property
    def gpu_memory(self) -> int | None:
        return GPU_MEMORY.get(self.accelerator) if self.accelerator else None

    def holds(self, bundle: dict) -> bool:
        return all(self.resources.get(k, 0) >= v for k, v in bundle.items() if v > 0)

    def describe(self) -> str:
        res = ", ".join(f"{k} {v:g}" for k, v in self.resources.items() if v)
        return f"{self.name} ({res})"


def bundle(cpus: float, gpus: float, accelerator: str | None = None) -> dict:
    """A Ray resource request as the stages make it (an accelerator pin is a sliver of its resource)."""
    return {"CPU": float(cpus), "GPU": float(gpus), **pin(accelerator)}


def from_cluster_yaml(path: str | Path) -> list[NodeType]:
    """The node types of a Ray cluster launcher config (its `available_node_types`)."""

    p = Path(path)
    if not p.is_file():
        raise M2DError(f"cluster config {path} not found; give a Ray cluster launcher YAML such as cluster.yaml")
    raw = yaml.safe_load(p.read_text()) or {}
    types = raw.get("available_node_types")
    if not isinstance(types, dict) or not types:
        raise M2DError(f"{path} has no available_node_types; m2d checks a run against a cluster's node types")
    return [_node_type(name, t or {}) for name, t in types.items()]


def _node_type(name: str, t: dict) -> NodeType:
    nc = t.get("node_config") or {}
    market = ((nc.get("InstanceMarketOptions") or {}).get("MarketType") or "").lower()
    return NodeType(
        name, dict(t.get("resources") or {}), t.get("max_workers"), nc.get("InstanceType"), market == "spot"
    )


def cluster_settings(path: str | Path) -> tuple[str | None, float]:
    """(the head node type's name, idle_timeout_minutes) of a cluster launcher config: what a plan prices
    besides the stages (the head for the whole run, every worker node's idle tail)."""

    raw = yaml.safe_load(Path(path).read_text()) or {}
    return raw.get("head_node_type"), float(raw.get("idle_timeout_minutes", 5))


def holders(nodes: list[NodeType], request: dict) -> list[NodeType]:
    return [n for n in nodes if n.holds(request)]


def pin_fix(request: dict, nodes: list[NodeType], keys: str) -> str | None:
    """When a request's GPU pin alone keeps every node type from holding it: the pin's key set as it is, and what to
    set it to instead (a GPU type the node types have that holds the rest of the request, or null: any GPU)."""
    pinned = [k.removeprefix(RESOURCE) for k in request if k.startswith(RESOURCE)]
    key = next((k for k in keys.split(" / ") if k.endswith("accelerator")), None)
    rest = {k: v for k, v in request.items() if not k.startswith(RESOURCE)}
    found = holders(nodes, rest)
    if not pinned or key is None or not found:
        return None
    kinds = sorted({n.accelerator for n in found if n.accelerator})
    instead = f"set {key}={kinds[0]}, or null for any GPU" if kinds else f"set {key}=null: any GPU"
    return f"{key}={pinned[0]} (no node type has an {pinned[0]}: {instead})"


def smallest_gpu(nodes: list[NodeType]) -> int | None:
    """The memory of the smallest GPU among `nodes` (None when none names its GPU type)."""
    mems = [n.gpu_memory for n in nodes if n.gpus > 0 and n.gpu_memory]
    return min(mems) if mems else None


def local_node(num_cpus: int) -> NodeType:
    """The node a local Ray (started with `num_cpus` logical CPUs) will have: those CPUs, this machine's GPUs and
    their type as Ray names it; known before Ray starts."""
    resources: dict = {"CPU": float(num_cpus)}
    try:
        import torch

        if torch.cuda.is_available():
            resources["GPU"] = float(torch.cuda.device_count())
            from ray._private.accelerators import (
                get_accelerator_manager_for_resource,  # lazy, GPU only; internal: pinned ray==2.60.0
            )

            kind = get_accelerator_manager_for_resource("GPU").get_current_node_accelerator_type()
            if kind:
                resources[f"accelerator_type:{kind}"] = 1.0
    except Exception:
        pass
    return NodeType("this machine", resources)
