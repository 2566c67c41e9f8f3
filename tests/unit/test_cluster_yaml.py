"""cluster.yaml (Ray cluster launcher, AWS) validated offline with Ray's own config checks.

`ray up` has no dry run, so this runs the steps `ray up` takes before it talks to AWS:
`prepare_config` (merge with the AWS provider's defaults.yaml, merge setup commands, fill per-type
min/max workers) and `validate_config` (ray-schema.json via jsonschema, plus head type and
min/max workers checks). Both are internal Ray API (ray.autoscaler._private.util), pinned by
pyproject.toml to ray==2.60.0. No boto3 call and no network: sockets are blocked while they run.
"""

from __future__ import annotations

import copy
import re
import socket

import jsonschema
import pytest
import ray
import yaml
from conftest import ROOT
from ray.autoscaler._private.util import prepare_config, validate_config
from remote import HEAD_HOME, LAPTOP_HOME, on_head

CLUSTER_YAML = ROOT / "cluster.yaml"

COMMAND_LISTS = (
    "initialization_commands",
    "setup_commands",
    "head_setup_commands",
    "worker_setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection (boto3, pip, metadata service) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("cluster.yaml validation tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def raw() -> dict:
    with open(CLUSTER_YAML) as f:
        return yaml.safe_load(f)


@pytest.fixture
def prepared(raw, no_network) -> dict:
    return prepare_config(copy.deepcopy(raw))


def _worker_types(cfg: dict) -> dict:
    return {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}


# --- Ray's own validation -------------------------------------------------------------------


def test_ray_validator_accepts_cluster_yaml(raw, prepared, no_network):
    validate_config(prepared)  # what `ray up` checks after filling defaults
    validate_config(copy.deepcopy(raw))  # the file as written is complete on its own too
    assert prepared["provider"]["type"] == "aws"
    assert prepared["cluster_name"] == "m2d-ray"


def test_no_provider_defaults_leak_in(raw, prepared):
    """prepare_config merges the AWS defaults.yaml *shallowly*: a command list left out of
    cluster.yaml would silently become Ray's example (a Ray nightly wheel, conda paths)."""
    for key in COMMAND_LISTS:
        assert key in raw, f"{key} missing: Ray would fill in its AWS example commands"
    assert prepared["head_setup_commands"] == raw["setup_commands"] + raw["head_setup_commands"]
    assert prepared["worker_setup_commands"] == raw["setup_commands"] + raw["worker_setup_commands"]
    every = [c for key in COMMAND_LISTS for c in prepared[key]]
    assert not [c for c in every if "ray-wheels" in c or "anaconda3" in c]


# --- our invariants -------------------------------------------------------------------------


def test_head_is_cpu_only(prepared):
    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert head["resources"].get("GPU") == 0
    assert head["resources"].get("CPU", 0) > 0  # Tune/Train drivers run there
    assert head["max_workers"] == 0


def test_gpu_worker_types_scale_from_zero(raw, prepared):
    workers = _worker_types(prepared)
    assert workers
    for name, node in workers.items():
        assert raw["available_node_types"][name].get("min_workers") == 0, name
        assert node["min_workers"] == 0, name
        assert node["max_workers"] >= 1, name
        assert node["resources"].get("GPU", 0) > 0, name
        assert node["resources"].get("CPU", 0) > 0, name
    assert max(n["resources"]["GPU"] for n in workers.values()) >= 8  # a distillation node


def test_every_node_has_its_least_privilege_role_and_the_tutorial_s_security_group(raw):
    """A run's storage (--storage s3://...) is read and written by the workers: each has the worker role (the run's
    bucket alone), the head the role that launches them; every node is in the one security group the tutorial creates,
    so Ray creates none (its own admits SSH from anywhere). The policies themselves: tests/unit/test_iam.py."""
    head = raw["head_node_type"]
    for name, node in raw["available_node_types"].items():
        profile = "m2d-ray-head" if name == head else "m2d-ray-worker"
        assert node["node_config"]["IamInstanceProfile"] == {"Name": profile}, name
        assert node["node_config"]["SecurityGroupIds"] == ["sg-REPLACE_WITH_M2D_SG"], name


def test_spot_worker_type_and_on_demand_fallback(prepared):
    def market(node):
        return node["node_config"].get("InstanceMarketOptions", {}).get("MarketType")

    markets = [market(n) for n in _worker_types(prepared).values()]
    assert "spot" in markets
    assert None in markets  # at least one on-demand GPU type


def test_every_node_type_pins_the_same_ami(prepared):
    # Without ImageId Ray falls back to an Ubuntu 18.04 / CUDA 11.2 DLAMI, too old for torch 2.13.
    amis = {n["node_config"].get("ImageId") for n in prepared["available_node_types"].values()}
    assert len(amis) == 1 and None not in amis


def test_setup_installs_the_project_with_gpu_extra(prepared):
    mounts = prepared["file_mounts"]
    assert mounts.get("~/m2d_ray") == "."
    worker = prepared["worker_setup_commands"]
    assert any("pip install" in c and "/m2d_ray[gpu]" in c for c in worker), worker
    head = prepared["head_setup_commands"]
    assert any("pip install" in c and "/m2d_ray" in c for c in head), head
    # Ray on the nodes must be the version that wrote and validated this config.
    assert any(f"ray[default]=={ray.__version__}" in c for c in head), head
    for c in head + worker:
        assert '"~/' not in c and "'~/" not in c, f"quoted ~ is not expanded by the shell: {c}"


def test_start_commands(prepared):
    head = " ; ".join(prepared["head_start_ray_commands"])
    assert "ray start --head --port=6379" in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    worker = " ; ".join(prepared["worker_start_ray_commands"])
    assert "ray start --address=$RAY_HEAD_IP:6379" in worker


# --- the validator can fail -----------------------------------------------------------------


def _misspelled_key(cfg):
    cfg["max_worker"] = cfg.pop("max_workers")


def _max_workers_wrong_type(cfg):
    cfg["max_workers"] = "twelve"


def _node_type_without_resources(cfg):
    del cfg["available_node_types"]["gpu_a10g_1x"]["resources"]


def _fractional_gpu_resource(cfg):
    cfg["available_node_types"]["gpu_a10g_1x"]["resources"]["GPU"] = 0.5


def _auth_typo(cfg):
    cfg["auth"]["ssh_usr"] = "ubuntu"


@pytest.mark.parametrize(
    "mutate",
    [_misspelled_key, _max_workers_wrong_type, _node_type_without_resources, _fractional_gpu_resource, _auth_typo],
)
def test_ray_validator_rejects_schema_errors(prepared, mutate, no_network):
    bad = copy.deepcopy(prepared)
    mutate(bad)
    with pytest.raises(jsonschema.ValidationError):
        validate_config(bad)


def test_ray_validator_rejects_inconsistent_node_types(prepared, no_network):
    bad = copy.deepcopy(prepared)
    bad["head_node_type"] = "no_such_type"
    with pytest.raises(ValueError, match="head_node_type"):
        validate_config(bad)
    bad = copy.deepcopy(prepared)
    bad["available_node_types"]["gpu_a10g_1x"]["min_workers"] = bad["max_workers"] + 1
    with pytest.raises(ValueError, match="min_workers"):
        validate_config(bad)


# --- the tutorial's path on AWS -----------------------------------------------------------------


def submit_commands() -> list[tuple[str, str]]:
    """(where, command) of every `ray job submit` in the docs' bash blocks and in cluster.yaml's comments, continued
    lines joined."""
    out = []
    for path in sorted((ROOT / "docs").rglob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            out += [(path.name, c) for c in _joined(block) if c.startswith("ray job submit")]
    comments = "\n".join(
        re.sub(r"^#\s*(\d\.\s+)?", "", line) for line in CLUSTER_YAML.read_text().splitlines() if line.startswith("#")
    )
    out += [("cluster.yaml", c) for c in _joined(comments) if c.startswith("ray job submit")]
    return out


def _joined(text: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in re.sub(r"\\\n\s*", " ", text).splitlines()]


#: the head's home where a page's cluster is not cluster.yaml's (ssh_user ubuntu): KubeRay's image runs as `ray`
HEAD_HOMES = {"kubernetes.md": "/home/ray"}


def test_every_submitted_path_is_the_head_s():
    """A `ray job submit` line as a laptop's shell and then the head's shell see it (Ray joins the arguments with
    shlex.join): the run directory is a path on the head, never the laptop's home; m2d expands a quoted `~` there."""
    commands = submit_commands()
    assert {w for w, _ in commands} >= {"cluster.md", "cluster.yaml", "kubernetes.md"} and len(commands) >= 4
    for where, command in commands:
        home = HEAD_HOMES.get(where, HEAD_HOME)
        argv = on_head(command, head_home=home)
        assert argv[:2] == ["m2d", "run"], (where, argv)
        paths = [argv[i + 1] for i, a in enumerate(argv) if a in ("--out", "--resume")]
        assert paths, (where, argv)
        for path in paths:
            on_head_path = home + path[1:] if path.startswith("~") else path  # Path.expanduser, on the head
            assert LAPTOP_HOME not in path and on_head_path.startswith(home + "/"), (where, path)


def test_the_unquoted_trap_is_caught():
    """The check above fails on what the tutorial used to say: `--out ~/runs/...` reaches the head as the laptop's
    home."""
    argv = on_head("ray job submit --address http://localhost:8265 -- m2d run x.yaml --out ~/runs/x")
    assert argv[argv.index("--out") + 1] == f"{LAPTOP_HOME}/runs/x"


def test_ray_down_ends_what_the_run_started(raw):
    """Nodes are terminated, never stopped (a stopped node's volume bills on), and every volume goes with its node."""
    assert raw["provider"]["cache_stopped_nodes"] is False
    for name, node in raw["available_node_types"].items():
        for mapping in node["node_config"]["BlockDeviceMappings"]:
            assert mapping["Ebs"]["DeleteOnTermination"] is True, name


def test_what_the_tunnel_reaches_listens_on_the_head_s_loopback(prepared):
    """The dashboard (its job API runs code) and MLflow (no authentication) bind 127.0.0.1: `ray dashboard`'s SSH
    tunnel reaches them, no other node or address does (docs/explanation/security.md)."""
    head = " ; ".join(prepared["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "mlflow server --host 127.0.0.1" in head
    every = [c for key in COMMAND_LISTS for c in prepared[key]]
    assert not [c for c in every if "0.0.0.0" in c]


def test_flash_attn_is_built_once_into_the_bucket_not_on_gpu_nodes(raw, prepared):
    """The wheel is built (if the bucket has none) by setup_commands, which the head runs at `ray up`; GPU workers
    install the cached wheel. The bucket is the one the tutorial names."""
    build = [c for c in raw["setup_commands"] if "pip wheel" in c]
    assert len(build) == 1 and "flash-attn" in build[0] and "s3 sync ~/wheels" in build[0]
    assert build[0].index('s3 sync "$cache" ~/wheels') < build[0].index("pip wheel")  # the cache first
    worker = prepared["worker_setup_commands"]
    assert any("~/wheels/flash_attn-" in c for c in worker)
    bucket = re.search(r"s3://([\w-]+)/m2d/wheels", build[0]).group(1)
    assert f"s3://{bucket}/" in (ROOT / "docs" / "tutorials" / "cluster.md").read_text()
