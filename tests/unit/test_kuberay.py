"""k8s/ (KubeRay): the RayCluster and the RayJob validated against KubeRay v1.7.0's CRD schemas (tests/data/kuberay/,
with the unknown-field check of `kubectl apply --validate=strict`), every pod template and the volume claim against
Kubernetes' own core types (the `kubernetes` client's models: fields, required fields, quantities), the worker groups
read as Ray's autoscaler reads them, and the RayJob's run planned on them as `m2d plan --cluster` plans one on
cluster.yaml; then what a first run needs of the pods: a head that can write its run directory, that fits its node,
GPU pods with room for the teacher, a submitter that does not give up on a long run. No Kubernetes here: what that
leaves untried is in docs/how-to/kubernetes.md."""

from __future__ import annotations

import copy
import json
import re
from pathlib import PurePosixPath

import jsonschema
import pytest
import ray
import yaml
from conftest import ROOT
from remote import on_head

from m2d_ray.config import load_config
from m2d_ray.errors import M2DError
from m2d_ray.models import model_config
from m2d_ray.pipeline import plan as make_plan
from m2d_ray.plan.devices import cluster_settings, from_cluster_yaml
from m2d_ray.plan.prices import hourly
from m2d_ray.plan.run_plan import Devices
from m2d_ray.shipped import EXPERIMENTS, configs

K8S = ROOT / "k8s"
SCHEMAS = ROOT / "tests" / "data" / "kuberay"
IMAGE_ROOT = PurePosixPath("/home/ray/m2d_ray")  # the checkout inside the image (k8s/Dockerfile's WORKDIR)


def manifests() -> list[dict]:
    return [d for path in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]


def of_kind(kind: str) -> dict:
    return next(d for d in manifests() if d["kind"] == kind)


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict]:
    out = {}
    for path in SCHEMAS.glob("*.schema.json"):
        data = json.loads(path.read_text())
        assert "kuberay v1.7.0" in data["source"]
        out[data["kind"]] = data
    return out


def unknown_fields(value, schema: dict, where: str = "") -> list[str]:
    """Fields the schema does not declare (a structural schema prunes them; `kubectl apply --validate=strict`, the
    default, refuses them), at any depth."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict) and "properties" in schema:
        out = []
        for key, item in value.items():
            if key in schema["properties"]:
                out += unknown_fields(item, schema["properties"][key], f"{where}.{key}")
            elif not schema.get("additionalProperties"):
                out.append(f"{where}.{key}")
        return out
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return [e for k, v in value.items() for e in unknown_fields(v, schema["additionalProperties"], f"{where}.{k}")]
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [e for i, v in enumerate(value) for e in unknown_fields(v, schema["items"], f"{where}[{i}]")]
    return []


def problems(doc: dict, schemas: dict) -> list[str]:
    data = schemas[doc["kind"]]
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validate(doc, data["schema"])]
    if doc["apiVersion"] != data["apiVersion"]:
        errors.append(f"apiVersion {doc['apiVersion']}, the schema's is {data['apiVersion']}")
    return errors + [f"{f}: unknown field" for f in unknown_fields(doc, data["schema"])]


def validate(doc: dict, schema: dict):
    return jsonschema.Draft7Validator(schema).iter_errors(doc)


def test_the_manifests_hold_a_raycluster_and_a_rayjob_on_it():
    kinds = [d["kind"] for d in manifests()]
    assert kinds.count("RayCluster") == 1 and kinds.count("RayJob") == 1
    cluster, job = of_kind("RayCluster"), of_kind("RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert cluster["spec"]["rayVersion"] == ray.__version__  # the image's Ray is the one pyproject.toml pins
    assert f"ARG BASE_IMAGE=rayproject/ray:{ray.__version__}-" in (K8S / "Dockerfile").read_text()
    images = {c["image"] for g in _groups(cluster) for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1  # one image on every pod (the submitter pod takes the head's)


def test_the_manifests_are_valid_against_kuberay_s_crd_schemas(schemas):
    for doc in manifests():
        if doc["kind"] in schemas:
            assert problems(doc, schemas) == [], doc["kind"]


def _misspelt(doc):
    doc["spec"]["workerGroupSpecs"][0]["maxReplica"] = doc["spec"]["workerGroupSpecs"][0].pop("maxReplicas")


def _replicas_as_text(doc):
    doc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"


def _unknown_upscaling_mode(doc):
    doc["spec"]["autoscalerOptions"]["upscalingMode"] = "Fast"


def _container_field_misspelt(doc):
    doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imag"] = "x"


def _group_without_template(doc):
    del doc["spec"]["workerGroupSpecs"][0]["template"]


@pytest.mark.parametrize(
    "mutate",
    [_misspelt, _replicas_as_text, _unknown_upscaling_mode, _container_field_misspelt, _group_without_template],
)
def test_the_schema_check_can_fail(schemas, mutate):
    doc = copy.deepcopy(of_kind("RayCluster"))
    mutate(doc)
    assert problems(doc, schemas)


def test_gpu_groups_scale_from_zero_under_a_cpu_head():
    spec = of_kind("RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
    assert not any(k.endswith("gpu") for k in head["limits"])
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] == group["replicas"] == 0 < group["maxReplicas"], group["groupName"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpu_type = [k for k in group["resources"] if k.startswith("accelerator_type:")]
        assert int(limits["nvidia.com/gpu"]) > 0 and len(gpu_type) == 1, group["groupName"]


def test_the_worker_groups_are_node_types_as_ray_s_autoscaler_reads_them(tmp_path):
    nodes = {n.name: n for n in from_cluster_yaml(K8S / "raycluster.yaml")}
    head, idle = cluster_settings(K8S / "raycluster.yaml")
    assert idle == 10.0 and nodes[head].gpus == 0 and nodes[head].resources["CPU"] == 6
    h100 = nodes["gpu-h100-8x"]
    assert (h100.gpus, h100.accelerator, h100.max_workers, h100.instance, h100.spot) == (8, "H100", 2, "p5.48xlarge", 0)
    assert hourly(h100) > hourly(nodes[head]) > 0  # priced by the nodeSelector's instance type
    cluster = copy.deepcopy(of_kind("RayCluster"))
    spot = copy.deepcopy(cluster["spec"]["workerGroupSpecs"][0])  # a spot group, as docs/how-to/kubernetes.md adds one
    spot["groupName"], spot["resources"]["spot"] = "gpu-h100-8x-spot", "1"
    spot["template"]["spec"]["nodeSelector"]["karpenter.sh/capacity-type"] = "spot"
    cluster["spec"]["workerGroupSpecs"].append(spot)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    read = {n.name: n for n in from_cluster_yaml(tmp_path / "c.yaml")}
    assert read["gpu-h100-8x-spot"].spot and read["gpu-h100-8x-spot"].resources["spot"] == 1
    assert 0 < hourly(read["gpu-h100-8x-spot"]) < hourly(h100)
    del cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cluster))
    with pytest.raises(M2DError, match="cannot read this RayCluster"):
        from_cluster_yaml(tmp_path / "bad.yaml")


def entrypoint_argv() -> list[str]:
    """The driver's argv on the head: KubeRay's submitter shell runs `ray job submit ... -- ENTRYPOINT`."""
    job = of_kind("RayJob")
    return on_head(
        f"ray job submit --address http://m2d-head-svc:8265 -- {job['spec']['entrypoint']}", "/root", "/home/ray"
    )


def test_the_rayjob_s_run_plans_on_the_raycluster_s_worker_groups():
    """What `m2d run` checks before calibration, against the worker groups: every stage has a group that holds it
    and fits its GPU; its run directory is on the head's persistent volume, its storage a bucket."""
    argv = entrypoint_argv()
    assert argv[:2] == ["m2d", "run"]
    config = argv[2]  # a config shipped in the package the image installs, by name
    overrides = [a for a in argv[3:] if "=" in a and not a.startswith("-")]
    options = dict(zip(argv[3::1], argv[4::1]))
    cluster_file = PurePosixPath(options["--cluster"])  # a KubeRay head has no bootstrap config to read groups from
    assert ROOT / cluster_file.relative_to(IMAGE_ROOT) == K8S / "raycluster.yaml"
    assert config in configs()
    cfg = load_config(config, overrides)
    assert cfg.ray.address is None  # the job's RAY_ADDRESS
    head = of_kind("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    claims = {v["name"] for v in head["volumes"] if "persistentVolumeClaim" in v}
    mounts = [PurePosixPath(m["mountPath"]) for m in head["containers"][0]["volumeMounts"] if m["name"] in claims]
    assert any(PurePosixPath(options["--out"]).is_relative_to(m) for m in mounts), options["--out"]
    assert options["--storage"].startswith(("s3://", "gs://"))
    nodes = tuple(from_cluster_yaml(K8S / "raycluster.yaml"))
    head_type, idle = cluster_settings(K8S / "raycluster.yaml")
    teacher = model_config(str(EXPERIMENTS / "configs" / "Qwen--Qwen3-30B-A3B"))
    plan = make_plan(cfg, teacher, Devices(nodes=nodes, head=head_type, idle_minutes=idle))
    assert plan.problems() == []
    assert all(s.holders and (s.fits is True or not s.share) for s in plan.stages)
    assert plan.cost.totals()["dollars"] > 0
    without_fix = [a for a in overrides if not a.startswith("ray.trial_accelerator=")]
    refused = make_plan(load_config(config, without_fix), teacher, Devices(nodes=nodes))
    assert "ray.trial_accelerator=A10G (no node type has an A10G" in refused.problems()[0]


def _groups(cluster: dict) -> list[dict]:
    return [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]


def test_the_schemas_are_kuberay_s_as_stored():
    for path in SCHEMAS.glob("*.schema.json"):
        data = json.loads(path.read_text())
        assert data["schema"]["properties"]["spec"]["type"] == "object" and len(data["source_sha256"]) == 64
    assert "v1.7.0" in (SCHEMAS / "README.md").read_text()


# --- Kubernetes' own core types, and what the pods need of them ---------------------------------------------------


def core_problems(data: dict, model: str) -> list[str]:
    """What Kubernetes' API types (the `kubernetes` client's models, generated from its OpenAPI) make of `data`:
    a missing required field raises; an unknown field, or a value of another type, does not survive the round trip."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    try:
        back = api.sanitize_for_serialization(api._ApiClient__deserialize(copy.deepcopy(data), model))
    except (ValueError, TypeError) as exc:
        return [str(exc)]
    return [] if back == data else [f"not kept as written: {_diff(data, back)}"]


def _diff(a, b, where=""):
    if isinstance(a, dict) and isinstance(b, dict):
        return next((_diff(a[k], b.get(k), f"{where}.{k}") for k in a if a[k] != b.get(k)), where)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next((_diff(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)) if x != y), where)
    return f"{where}: {a!r} -> {b!r}"


def pod_templates() -> dict[str, dict]:
    cluster = of_kind("RayCluster")
    return {g.get("groupName", "head"): g["template"] for g in _groups(cluster)}


def test_every_pod_template_and_claim_is_valid_as_kubernetes_core_types():
    pytest.importorskip("kubernetes")
    for name, template in pod_templates().items():
        assert core_problems(template, "V1PodTemplateSpec") == [], name
    claim = next(d for d in manifests() if d["kind"] == "PersistentVolumeClaim")
    assert core_problems(claim, "V1PersistentVolumeClaim") == []


def test_the_core_type_check_can_fail():
    pytest.importorskip("kubernetes")
    head = copy.deepcopy(pod_templates()["head"])
    misspelt = copy.deepcopy(head)
    misspelt["spec"]["securityContext"]["fsGruop"] = 100
    as_text = copy.deepcopy(head)
    as_text["spec"]["securityContext"]["fsGroup"] = "100"
    nameless = copy.deepcopy(head)
    del nameless["spec"]["containers"][0]["name"]
    for bad in (misspelt, as_text, nameless):
        assert core_problems(bad, "V1PodTemplateSpec")


def quantity(value) -> float:
    from kubernetes.utils import parse_quantity

    return float(parse_quantity(value))


#: KubeRay's autoscaler sidecar on the head pod (its defaults in v1.7.0: 500m CPU, 512Mi)
SIDECAR = {"cpu": 0.5, "memory": 512 * 2**20}
#: an EKS node's allocatable (its kube-reserved and eviction formula) less a margin for DaemonSets (VPC CNI, kube-proxy,
#: EBS CSI node, the device plugin, a log agent): what a pod may ask of the node
FITS = {"m5.2xlarge": {"cpu": 8 - 0.09 - 0.6, "memory": (32 - 0.87 - 0.1 - 1.5) * 2**30}}


def test_the_head_pod_fits_its_node_with_kuberay_s_sidecar():
    pytest.importorskip("kubernetes")
    spec = pod_templates()["head"]["spec"]
    fits = FITS[spec["nodeSelector"]["node.kubernetes.io/instance-type"]]
    requests = spec["containers"][0]["resources"]["requests"]
    for key in ("cpu", "memory"):
        assert quantity(requests[key]) + SIDECAR[key] <= fits[key], key
    assert quantity("7") + SIDECAR["cpu"] > FITS["m5.2xlarge"]["cpu"]  # what the head asked before: Pending


def test_the_head_may_write_its_run_directory_on_a_fresh_volume():
    """Ray's image runs as uid 1000 gid 100; a fresh volume's root belongs to root: fsGroup gives it to gid 100."""
    spec = pod_templates()["head"]["spec"]
    ctx = spec["securityContext"]
    assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (1000, 100, 100)
    claims = {v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    out = PurePosixPath(dict(zip(entrypoint_argv(), entrypoint_argv()[1:]))["--out"])
    assert any(out.is_relative_to(m["mountPath"]) for m in spec["containers"][0]["volumeMounts"] if m["name"] in claims)


def test_gpu_pods_keep_the_teacher_on_a_volume_the_scheduler_counts():
    """Each GPU pod downloads the teacher (~61 GB) into its cache: an emptyDir at the caches' home, bounded, and an
    ephemeral-storage request that covers it and the image's writable layer, so a pod lands only on a node with the
    disk for it."""
    for name, template in pod_templates().items():
        if name == "head":
            continue
        spec = template["spec"]
        container = spec["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        cache = next(v for v in spec["volumes"] if v["name"] == mounts["/home/ray/.cache"])
        size = quantity(cache["emptyDir"]["sizeLimit"])
        assert size >= 2 * 61e9, name  # the teacher and room for the students' copies
        for kind in ("requests", "limits"):
            assert quantity(container["resources"][kind]["ephemeral-storage"]) >= size + 50 * 2**30, (name, kind)
        assert spec["securityContext"]["fsGroup"] == 100
        (data,) = re.findall(r"^ENV M2D_DATA_DIR=(\S+)$", (K8S / "Dockerfile").read_text(), flags=re.M)
        hidden = [m for m in mounts if PurePosixPath(data).is_relative_to(m)]
        assert not hidden, f"the image's paper data ({data}) under a volume: {hidden}"  # `m2d fetch-data`'s copy


def test_the_submitter_survives_lost_log_streams():
    """KubeRay marks the RayJob Failed when its submitter Job fails: that Job only follows the log, and the run takes
    hours, so it may retry for as long as the run goes on."""
    job = of_kind("RayJob")["spec"]
    assert job["submissionMode"] == "K8sJobMode" and job["submitterConfig"]["backoffLimit"] >= 50


def test_the_image_holds_what_the_rayjob_reads():
    """The RayJob's --cluster is the image's copy (its config ships in the package): the .dockerignore keeps it, and
    keeps out what would bloat the image (environments, runs, teachers)."""
    ignored = [
        line for line in (K8S / "Dockerfile.dockerignore").read_text().splitlines() if line and not line[0] == "#"
    ]
    argv = entrypoint_argv()
    for path in (dict(zip(argv, argv[1:]))["--cluster"],):
        top = PurePosixPath(path).relative_to(IMAGE_ROOT).parts[0]
        assert top not in ignored, path
    assert {".git", ".venv", "runs", "teachers"} <= set(ignored)


# --- who may do what: the namespace's PodSecurity level, the head's and the workers' service accounts -----------------

#: the volume types PodSecurity `restricted` admits (Kubernetes' Pod Security Standards)
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected"}


def restricted_problems(spec: dict, extra_containers: tuple[dict, ...] = ()) -> list[str]:
    """What PodSecurity `restricted` (Kubernetes' Pod Security Standards, as the admission controller checks them)
    refuses in a pod spec: host namespaces, privileged or root containers, privilege escalation, capabilities beyond
    NET_BIND_SERVICE, no seccomp profile, a volume type outside its list. `extra_containers`: containers KubeRay adds
    (its autoscaler sidecar) with their securityContext."""
    ctx = spec.get("securityContext", {})
    out = [f"spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    out += [f"volume {v['name']}" for v in spec.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    if ctx.get("runAsUser") == 0:
        out.append("runs as root")
    containers = [*spec.get("initContainers", []), *spec["containers"], *extra_containers]
    for c in containers:
        sc, name = c.get("securityContext") or {}, c.get("name", "?")
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities not dropped")
        if not sc.get("runAsNonRoot", ctx.get("runAsNonRoot")) or sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsNonRoot not set")
        seccomp = sc.get("seccompProfile", ctx.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: no seccomp profile")
    return out


def sidecar(cluster: dict) -> dict:
    """KubeRay's autoscaler container on the head, with the securityContext autoscalerOptions gives it."""
    return {
        "name": "autoscaler",
        **{k: v for k, v in cluster["spec"]["autoscalerOptions"].items() if k == "securityContext"},
    }


def test_everything_runs_in_a_namespace_of_its_own_under_restricted_pod_security():
    """Every pod of the cluster (the head with KubeRay's autoscaler sidecar, the GPU pods, whose wait-gcs-ready init
    container copies the Ray container's securityContext, the RayJob's submitter) meets PodSecurity `restricted`, which
    the namespace enforces."""
    (ns,) = [d for d in manifests() if d["kind"] == "Namespace"]
    labels = ns["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    for doc in manifests():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == ns["metadata"]["name"], (doc["kind"], doc["metadata"]["name"])
    cluster, job = of_kind("RayCluster"), of_kind("RayJob")
    for name, template in pod_templates().items():
        extra = (sidecar(cluster),) if name == "head" else ()
        assert restricted_problems(template["spec"], extra) == [], name
    submitter = job["spec"]["submitterPodTemplate"]
    assert restricted_problems(submitter["spec"]) == []
    assert core_problems(submitter, "V1PodTemplateSpec") == []
    images = {c["image"] for c in submitter["spec"]["containers"]}
    assert images == {c["image"] for g in _groups(cluster) for c in g["template"]["spec"]["containers"]}


def test_the_restricted_check_can_fail():
    """The head's pod as it was (no seccomp profile, no capabilities dropped, escalation allowed), KubeRay's sidecar
    without autoscalerOptions.securityContext, a hostPath volume, a root container."""
    old = {
        "securityContext": {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100},
        "containers": [{"name": "ray-head", "image": "x"}],
    }
    assert restricted_problems(old) == [
        "ray-head: allowPrivilegeEscalation not false",
        "ray-head: capabilities not dropped",
        "ray-head: runAsNonRoot not set",
        "ray-head: no seccomp profile",
    ]
    head = copy.deepcopy(pod_templates()["head"]["spec"])
    assert restricted_problems(head, ({"name": "autoscaler"},))[0] == "autoscaler: allowPrivilegeEscalation not false"
    head["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    head["containers"][0]["securityContext"] = {**head["containers"][0]["securityContext"], "runAsUser": 0}
    assert restricted_problems(head) == ["volume host", "ray-head: runAsNonRoot not set"]


def test_the_workers_run_apart_from_the_head():
    """KubeRay binds its autoscaler's Role (pods and this RayCluster: read and patch) to the head's service account:
    the GPU pods, where any Ray task runs, have another one, with no Role, no API token, and a cloud role of their own
    (the run's bucket alone)."""
    accounts = {d["metadata"]["name"]: d for d in manifests() if d["kind"] == "ServiceAccount"}
    head = pod_templates()["head"]["spec"]
    workers = [t["spec"] for name, t in pod_templates().items() if name != "head"]
    assert head["serviceAccountName"] == "m2d-head" and head["automountServiceAccountToken"] is False  # next test
    for spec in workers:
        assert spec["serviceAccountName"] == "m2d-worker" and spec["automountServiceAccountToken"] is False
    assert (
        set(accounts) == {"m2d-head", "m2d-worker"} and accounts["m2d-worker"]["automountServiceAccountToken"] is False
    )
    roles = {name: a["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] for name, a in accounts.items()}
    assert roles == {
        "m2d-head": "arn:aws:iam::MY-ACCOUNT:role/m2d-k8s-head",
        "m2d-worker": "arn:aws:iam::MY-ACCOUNT:role/m2d-k8s-worker",
    }
    assert not [d for d in manifests() if d["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]
    job = of_kind("RayJob")["spec"]["submitterPodTemplate"]["spec"]
    assert job["automountServiceAccountToken"] is False and "serviceAccountName" not in job
    how_to = (ROOT / "docs" / "how-to" / "kubernetes.md").read_text()
    for name, arn in roles.items():  # the how-to makes each role for its account, in the namespace
        assert f"--name {name}" in how_to and f"--role-name {arn.rsplit('/', 1)[1]}" in how_to, name
    assert how_to.count("--namespace m2d --name m2d-") == 2


def token_holders(cluster: dict) -> list[str]:
    """The head pod's containers that hold the head account's API token: all of them under automount (Kubernetes'
    default), else those that mount a projected service-account token (KubeRay's sidecar by autoscalerOptions)."""
    from ray.autoscaler._private.kuberay.node_provider import IN_CLUSTER_CA_CERT_PATH, IN_CLUSTER_TOKEN_PATH

    spec = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    containers = [*spec["containers"], {"name": "autoscaler", **cluster["spec"]["autoscalerOptions"]}]
    if spec.get("automountServiceAccountToken", True):
        return [c["name"] for c in containers]
    projected = {v["name"]: v["projected"]["sources"] for v in spec.get("volumes", []) if "projected" in v}
    paths = {
        name: {s["serviceAccountToken"]["path"] for s in sources if "serviceAccountToken" in s}
        | {i["path"] for s in sources if "configMap" in s for i in s["configMap"]["items"]}
        for name, sources in projected.items()
    }
    out = []
    for c in containers:
        for m in c.get("volumeMounts", []):
            if "token" in paths.get(m["name"], set()):
                # Ray's KubeRay node provider reads the token and the CA where automount puts them
                files = {f"{m['mountPath']}/{p}" for p in paths[m["name"]]}
                assert files >= {IN_CLUSTER_TOKEN_PATH, IN_CLUSTER_CA_CERT_PATH}, files
                out.append(c["name"])
    return out


def test_the_head_s_api_token_is_in_the_autoscaler_sidecar_alone():
    """The head's account has KubeRay's autoscaler Role (patch pods and the RayCluster); Ray places the driver and CPU
    tasks in `ray-head`, so the token is not automounted there but projected into the sidecar alone, where Ray's
    autoscaler reads it. The manifest as it was (automount on) gave it to every head container."""
    cluster = of_kind("RayCluster")
    assert token_holders(cluster) == ["autoscaler"]
    old = copy.deepcopy(cluster)
    del old["spec"]["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"]
    assert token_holders(old) == ["ray-head", "autoscaler"]
    text = (K8S / "raycluster.yaml").read_text()
    assert "nothing of the cluster's API" in text and "sidecar alone" in text
    security = " ".join((ROOT / "docs" / "explanation" / "security.md").read_text().split())
    assert "projected into KubeRay's autoscaler sidecar alone" in security


def test_mlflow_s_login_is_in_the_head_s_environment_not_a_job_s(tmp_path, monkeypatch):
    """A password in `ray job submit --runtime-env-json` is stored with the job and shown by the dashboard: the docs
    give MLflow's login to the head instead, as a file MLflow's client reads (AWS: the page's own example, read here by
    MLflow) or the Secret m2d-mlflow in the head container's environment (KubeRay), never to the GPU pods."""
    from mlflow.utils import credentials

    security = (ROOT / "docs" / "explanation" / "security.md").read_text()
    flat = " ".join(security.split())
    assert "MLFLOW_TRACKING_PASSWORD" in flat and not re.search(r"--runtime-env-json[^.]*MLFLOW_TRACKING", flat)
    assert not re.search(r"MLFLOW_TRACKING_PASSWORD[^.]*--runtime-env-json", flat)
    (ini,) = re.findall(r"```ini\n(.*?)```", security, flags=re.S)
    (tmp_path / ".mlflow").mkdir()
    (tmp_path / ".mlflow" / "credentials").write_text(ini)
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(key, raising=False)
    creds = credentials.read_mlflow_creds()
    assert creds.username and creds.password and "~/.mlflow/credentials" in flat
    head = pod_templates()["head"]["spec"]["containers"][0]
    assert {"secretRef": {"name": "m2d-mlflow", "optional": True}} in head["envFrom"]
    assert "kubectl create secret generic m2d-mlflow" in flat
    for name, template in pod_templates().items():
        if name != "head":
            assert all("envFrom" not in c for c in template["spec"]["containers"]), name
