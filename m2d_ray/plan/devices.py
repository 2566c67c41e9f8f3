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
    """The node types of a Ray cluster launcher config (its `available_node_types`), or of a KubeRay manifest (a
    RayCluster, or a RayJob with its own rayClusterSpec): its head and worker groups as Ray's autoscaler reads them."""
    return [_node_type(name, t or {}) for name, t in _launcher_config(path)["available_node_types"].items()]


def cluster_settings(path: str | Path) -> tuple[str | None, float]:
    """(the head node type's name, idle_timeout_minutes) of a cluster config: what a plan prices besides the stages
    (the head for the whole run, every worker node's idle tail)."""
    raw = _launcher_config(path)
    return raw.get("head_node_type"), float(raw.get("idle_timeout_minutes", 5))


def _launcher_config(path: str | Path) -> dict:
    """The cluster launcher config of `path`, a KubeRay manifest's derived the way Ray's autoscaler derives it."""
    p = Path(path)
    if not p.is_file():
        raise M2DError(
            f"cluster config {path} not found; give a Ray cluster launcher YAML such as cluster.yaml, or a KubeRay "
            "RayCluster such as k8s/raycluster.yaml"
        )
    try:
        docs = [d for d in yaml.safe_load_all(p.read_text()) if isinstance(d, dict)]
    except yaml.YAMLError as e:
        raise M2DError(f"{path} is not YAML ({str(e).splitlines()[0]}); give a cluster config") from None
    spec = next((s for s in map(_ray_cluster_spec, docs) if s is not None), None)
    raw = _from_kuberay(path, spec) if spec is not None else (docs[0] if docs else {})
    if not isinstance(raw.get("available_node_types"), dict) or not raw["available_node_types"]:
        raise M2DError(f"{path} has no available_node_types; m2d checks a run against a cluster's node types")
    return raw


def _ray_cluster_spec(doc: dict) -> dict | None:
    if doc.get("kind") == "RayCluster":
        return doc
    if doc.get("kind") == "RayJob" and (doc.get("spec") or {}).get("rayClusterSpec"):
        return {"metadata": doc.get("metadata") or {}, "spec": doc["spec"]["rayClusterSpec"]}
    return None


def _from_kuberay(path: str | Path, cr: dict) -> dict:
    """Ray's own translation of a RayCluster into its autoscaler's config (the node types: resources from each group's
    `resources`, rayStartParams and container limits; max_workers from maxReplicas), each group's pod nodeSelector
    kept as its node_config: the instance type it is priced by and whether it asks for spot capacity."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (  # lazy: a KubeRay manifest only; internal API,
        _derive_autoscaling_config_from_ray_cr,  # pinned by pyproject.toml's ray==2.60.0
    )

    cr = {**cr, "metadata": {"namespace": "default", **(cr.get("metadata") or {})}}
    try:
        raw = _derive_autoscaling_config_from_ray_cr(cr)
    except Exception as e:  # Ray's checks: a group without CPUs, a bad quantity, ...
        why = str(e).strip().splitlines()[0]
        raise M2DError(
            f"{path}: Ray's autoscaler cannot read this RayCluster ({why}); give every group its CPUs (its "
            "container's limits or rayStartParams) in Kubernetes quantities"
        ) from None
    spec = cr.get("spec") or {}
    groups = {
        raw["head_node_type"]: spec.get("headGroupSpec") or {},
        **{g["groupName"]: g for g in spec.get("workerGroupSpecs") or []},
    }
    for name, node in raw["available_node_types"].items():
        node["resources"].pop("memory", None)  # bytes of the pod's limit: no stage asks Ray for memory
        selector = ((groups.get(name, {}).get("template") or {}).get("spec") or {}).get("nodeSelector") or {}
        node["node_config"] = {"InstanceType": selector.get(INSTANCE_LABEL)}
        if any(str(selector.get(k, "")).lower() in ("spot", "true") for k in SPOT_LABELS):
            node["node_config"]["InstanceMarketOptions"] = {"MarketType": "spot"}
    return raw


#: the Kubernetes node labels a KubeRay group's nodeSelector names its machines by: the instance type (well known), and
#: spot capacity (Karpenter; EKS managed node groups; GKE)
INSTANCE_LABEL = "node.kubernetes.io/instance-type"
SPOT_LABELS = ("karpenter.sh/capacity-type", "eks.amazonaws.com/capacityType", "cloud.google.com/gke-spot")


def _node_type(name: str, t: dict) -> NodeType:
    nc = t.get("node_config") or {}
    market = ((nc.get("InstanceMarketOptions") or {}).get("MarketType") or "").lower()
    return NodeType(
        name, dict(t.get("resources") or {}), t.get("max_workers"), nc.get("InstanceType"), market == "spot"
    )


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
    return NodeType("this machine", resources, max_workers=1)  # a local Ray is this one node
