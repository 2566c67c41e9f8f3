"""The AWS path's IAM policies (aws/iam/*.json) read as AWS reads them, against what is actually called: every EC2 call
in Ray 2.60's AWS node provider (its source, read here) that the head's autoscaler makes with cluster.yaml's settings,
and the S3 calls of the run's storage (pyarrow.fs, `aws s3 sync`). Least privilege both ways: each call is allowed, and
the calls a worker or a stolen credential could abuse are not (launching or ending other instances, passing another
role, another bucket). The evaluator below decides a request as IAM does for one identity-based policy set: every
resource the call touches must be allowed (RunInstances asks for the instance, the image, the subnet, the security
group, the network interface, the volume, the key pair, a spot request: a policy narrowed on the instance alone is
refused), an explicit Deny wins, and no statement means no; a request's tags (`aws:RequestTag/...`, `aws:TagKeys`) are
seen by the resources the request tags alone (Ray's TagSpecifications name the instance), the network resources carry
their VPC (`ec2:Vpc`). It covers what these policies use (`*`/`?` wildcards in actions and resources; StringEquals,
StringLike, StringNotEquals, their ForAllValues/ForAnyValue forms; ArnEquals and ArnLike, component by component). No
AWS here: the policies are not tried against IAM itself."""

from __future__ import annotations

import fnmatch
import inspect
import json
import re

import pytest
import yaml
from conftest import ROOT

IAM = ROOT / "aws" / "iam"
ACCOUNT, BUCKET, CLUSTER = "123456789012", "my-bucket", "m2d-ray"
WORKER_ROLE = f"arn:aws:iam::{ACCOUNT}:role/m2d-ray-worker"
INSTANCE = f"arn:aws:ec2:us-west-2:{ACCOUNT}:instance/i-0123456789abcdef0"
VPC, SG = "vpc-0123456789abcdef0", "sg-0123456789abcdef0"  # what aws/setup.sh writes in place of MY-VPC and MY-SG


def policy(name: str) -> dict:
    text = (IAM / f"{name}.json").read_text().replace("MY-BUCKET", BUCKET).replace("MY-ACCOUNT", ACCOUNT)
    text = text.replace("MY-VPC", VPC).replace("MY-SG", SG)
    return json.loads(text)


def decide(policies: list[dict], action: str, resources: list[tuple[str, dict]], context: dict | None = None) -> bool:
    """IAM's answer to one call: `resources` is every (ARN, that resource's condition keys) the call touches, `context`
    the request's own keys (aws:RequestTag/..., aws:TagKeys), seen by every resource. Allowed when no Deny statement
    matches any resource and an Allow statement matches each one."""
    context = context or {}
    for s in (s for p in policies for s in p["Statement"]):  # what this evaluator knows how to read
        assert s["Effect"] in ("Allow", "Deny") and set(s) <= {"Sid", "Effect", "Action", "Resource", "Condition"}, s
    for arn, own in resources:
        keys = {**context, **own}
        if any(_matches(s, action, arn, keys) for p in policies for s in p["Statement"] if s["Effect"] == "Deny"):
            return False
        if not any(_matches(s, action, arn, keys) for p in policies for s in p["Statement"] if s["Effect"] == "Allow"):
            return False
    return bool(resources)


def allowed(policies: list[dict], action: str, resource: str = "*", context: dict | None = None) -> bool:
    """A call that touches one resource."""
    return decide(policies, action, [(resource, {})], context)


def _matches(s: dict, action: str, resource: str, keys: dict) -> bool:
    if not any(fnmatch.fnmatchcase(action.lower(), a.lower()) for a in _list(s["Action"])):
        return False
    if not any(fnmatch.fnmatchcase(resource, r) for r in _list(s["Resource"])):
        return False
    return all(
        _holds(op, key, values, keys) for op, cond in s.get("Condition", {}).items() for key, values in cond.items()
    )


def _holds(op: str, key: str, values, keys: dict) -> bool:
    """One condition key of one operator; a key the request lacks fails a positive operator and passes a negated one
    (StringNotEquals), as in IAM; ForAllValues holds on an absent key, ForAnyValue does not."""
    qualifier, _, base = op.rpartition(":")
    assert qualifier in ("", "ForAllValues", "ForAnyValue") and base in (
        "StringEquals",
        "StringLike",
        "StringNotEquals",
        "ArnEquals",
        "ArnLike",
    )
    patterns = _list(values)

    def one(value) -> bool:
        if base == "StringEquals":
            return value in patterns
        if base == "StringLike":
            return any(fnmatch.fnmatchcase(value, p) for p in patterns)
        if base in ("ArnEquals", "ArnLike"):
            return any(_arn_matches(value, p) for p in patterns)
        return value not in patterns

    if key not in keys:
        return base == "StringNotEquals" or qualifier == "ForAllValues"
    got = _list(keys[key])
    if qualifier == "ForAllValues":
        return all(one(v) for v in got)
    return any(one(v) for v in got) if qualifier == "ForAnyValue" or len(got) == 1 else False


def _arn_matches(value: str, pattern: str) -> bool:
    """ArnEquals / ArnLike (the same in IAM): each of the six colon-separated parts matched on its own, wildcards
    included, so a `*` never spans a colon."""
    parts, wanted = value.split(":", 5), pattern.split(":", 5)
    return len(parts) == len(wanted) == 6 and all(fnmatch.fnmatchcase(v, w) for v, w in zip(parts, wanted))


def _list(v) -> list:
    return v if isinstance(v, list) else [v]


def run_instances(
    instance_type: str,
    spot: bool = False,
    tags: dict | None = None,
    image_owner: str = "amazon",
    vpc: str = VPC,
    sg: str = SG,
) -> list[tuple[str, dict]]:
    """What Ray's node provider asks EC2 for when it launches a worker (create_instances with cluster.yaml's
    node_config: InstanceType, ImageId, SecurityGroupIds, a SubnetId of that group's VPC, BlockDeviceMappings, the key
    pair Ray made, InstanceMarketOptions on a spot type, TagSpecifications for the instance alone with
    ray-cluster-name), as the resources IAM checks with their condition keys: the request's tags on the instance, the
    VPC on the subnet, the security group and the new network interface."""
    tags = {"ray-cluster-name": CLUSTER, "ray-node-type": "worker"} if tags is None else tags
    region = f"arn:aws:ec2:us-west-2:{ACCOUNT}"
    request = {f"aws:RequestTag/{k}": v for k, v in tags.items()} | {"aws:TagKeys": list(tags)}
    in_vpc = {"ec2:Vpc": f"{region}:vpc/{vpc}"}
    resources = [
        (f"{region}:instance/*", {"ec2:InstanceType": instance_type, **request}),
        ("arn:aws:ec2:us-west-2::image/ami-0123456789abcdef0", {"ec2:Owner": image_owner}),
        (f"{region}:subnet/subnet-0123456789abcdef0", in_vpc),
        (f"{region}:security-group/{sg}", in_vpc),
        (f"{region}:network-interface/*", in_vpc),
        (f"{region}:volume/*", {}),
        (f"{region}:key-pair/ray-autoscaler_us-west-2", {}),
    ]
    if spot:
        resources.append((f"{region}:spot-instances-request/*", {}))
    return resources


def worker_types() -> dict[str, tuple[str, bool]]:
    """cluster.yaml's worker node types: (instance type, spot)."""
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    return {
        name: (n["node_config"]["InstanceType"], "InstanceMarketOptions" in n["node_config"])
        for name, n in raw["available_node_types"].items()
        if name != raw["head_node_type"]
    }


def launch_problems(policies: list[dict]) -> list[str]:
    """What is wrong with a head's launch rights: a worker type of cluster.yaml it cannot launch, or a launch outside
    the cluster it can (another instance type, no cluster tag or another cluster's, an image not Amazon's, another VPC
    of the account, another security group)."""
    out = []
    for name, (itype, spot) in worker_types().items():
        if not decide(policies, "ec2:RunInstances", run_instances(itype, spot)):
            out.append(f"cannot launch {name} ({itype})")
    (itype, _), *_ = worker_types().values()
    wrong = {
        "another instance type": run_instances("p4de.24xlarge"),
        "untagged": run_instances(itype, tags={}),
        "another cluster's tag": run_instances(itype, tags={"ray-cluster-name": "someone-else"}),
        "an image not Amazon's": run_instances(itype, image_owner="111122223333"),
        "into another VPC": run_instances(itype, vpc="vpc-0another0000000000"),
        "with another security group": run_instances(itype, sg="sg-0another00000000000"),
    }
    out += [f"may launch {what}" for what, call in wrong.items() if decide(policies, "ec2:RunInstances", call)]
    return out


HEAD = [policy("head-launch"), policy("bucket")]
WORKER = [policy("bucket")]

#: Ray's boto3 call (as written in its node provider) -> the IAM action it needs
RAY_CALLS = {
    "instances.filter": "ec2:DescribeInstances",
    "wait_until_stopped": "ec2:DescribeInstances",
    "create_instances": "ec2:RunInstances",
    "create_tags": "ec2:CreateTags",
    "terminate_instances": "ec2:TerminateInstances",
    "terminate": "ec2:TerminateInstances",
    "stop_instances": "ec2:StopInstances",
    "stop": "ec2:StopInstances",
    "start_instances": "ec2:StartInstances",
    "describe_images": "ec2:DescribeImages",
    "describe_instance_types": "ec2:DescribeInstanceTypes",
}
#: calls cluster.yaml's settings keep the head from making: node caching (cache_stopped_nodes: false), the CloudWatch
#: agent (no `cloudwatch` in provider), resource autodetection (fillout_available_node_types_resources: `ray up` on the
#: laptop, with the laptop's credentials)
NOT_ON_THIS_HEAD = {"ec2:StopInstances", "ec2:StartInstances", "ec2:DescribeImages", "ec2:DescribeInstanceTypes"}


def ray_provider_calls() -> set[str]:
    """Every boto3 call of Ray's AWSNodeProvider (the class the head's autoscaler runs), by name."""
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider

    source = inspect.getsource(AWSNodeProvider)
    calls = set(re.findall(r"(?:\bclient|\bec2|ec2_fail_fast)\.(?!meta\b)([a-z_]+)", source))
    calls |= {f"instances.{m}" for m in re.findall(r"\binstances\.(filter)\(", source)}
    calls |= set(re.findall(r"\bnode\.([a-z_]+)\(", source))
    return calls - {"instances"}


def test_ray_s_node_provider_makes_only_calls_this_test_knows():
    """A Ray upgrade that adds an EC2 call fails here, before a head without its permission fails to launch."""
    calls = ray_provider_calls()
    assert calls >= {"instances.filter", "create_instances", "create_tags", "terminate_instances"}
    assert calls <= set(RAY_CALLS), calls - set(RAY_CALLS)


def test_the_head_may_make_every_call_its_autoscaler_makes():
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert raw["provider"]["cache_stopped_nodes"] is False and "cloudwatch" not in raw["provider"]
    assert raw["cluster_name"] == CLUSTER
    needed = {RAY_CALLS[c] for c in ray_provider_calls()} - NOT_ON_THIS_HEAD
    assert needed == {"ec2:DescribeInstances", "ec2:RunInstances", "ec2:CreateTags", "ec2:TerminateInstances"}
    own = {"ec2:ResourceTag/ray-cluster-name": CLUSTER}
    assert allowed(HEAD, "ec2:DescribeInstances")
    assert launch_problems(HEAD) == []  # every worker type, with every resource of its launch
    assert allowed(HEAD, "ec2:CreateTags", INSTANCE, {"ec2:CreateAction": "RunInstances"})  # TagSpecifications
    assert allowed(HEAD, "ec2:CreateTags", INSTANCE, own)  # set_node_tags on a running node
    assert allowed(HEAD, "ec2:TerminateInstances", INSTANCE, own)
    # a worker's instance profile: RunInstances with IamInstanceProfile needs iam:PassRole on its role
    assert allowed(HEAD, "iam:PassRole", WORKER_ROLE, {"iam:PassedToService": "ec2.amazonaws.com"})
    for action in NOT_ON_THIS_HEAD:
        assert not allowed(HEAD, action, INSTANCE, own), action


def test_the_head_launches_this_cluster_s_worker_types_and_nothing_else():
    """RunInstances is narrowed on the instance by the cluster's tag and the worker types of cluster.yaml (the policy's
    list is theirs), on the image by its owner; its other resources have a statement of their own."""
    (narrowed,) = [
        s
        for s in policy("head-launch")["Statement"]
        if s["Resource"] == "arn:aws:ec2:*:123456789012:instance/*" and s["Action"] == ["ec2:RunInstances"]
    ]
    types = narrowed["Condition"]["StringEquals"]["ec2:InstanceType"]
    assert sorted(types) == sorted({itype for itype, _ in worker_types().values()})
    assert narrowed["Condition"]["StringEquals"]["aws:RequestTag/ray-cluster-name"] == CLUSTER
    assert launch_problems(HEAD) == []


def test_a_launch_is_decided_on_every_resource_it_touches():
    """What the old policy allowed (RunInstances on `*`) launches anything; a policy narrowed on the instance alone
    passes a check of the instance ARN but IAM refuses it, since the image, subnet, security group, network interface,
    volume and key pair of the call are each checked too; an explicit Deny wins over an Allow."""
    old = {"Statement": [{"Effect": "Allow", "Action": ["ec2:RunInstances"], "Resource": "*"}]}
    assert launch_problems([old]) == [
        "may launch another instance type",
        "may launch untagged",
        "may launch another cluster's tag",
        "may launch an image not Amazon's",
        "may launch into another VPC",
        "may launch with another security group",
    ]
    instance_only = {
        "Statement": [
            s
            for s in policy("head-launch")["Statement"]
            if s["Resource"] == "arn:aws:ec2:*:123456789012:instance/*" and s["Action"] == ["ec2:RunInstances"]
        ]
    }
    resources = run_instances("g5.2xlarge")
    assert decide([instance_only], "ec2:RunInstances", resources[:1])  # the instance alone: allowed
    assert not decide([instance_only], "ec2:RunInstances", resources)  # the whole call: refused
    assert launch_problems([instance_only]) == [
        f"cannot launch {name} ({t})" for name, (t, _) in worker_types().items()
    ]
    deny_p5 = {
        "Statement": [
            {
                "Effect": "Deny",
                "Action": "ec2:RunInstances",
                "Resource": "*",
                "Condition": {"StringEquals": {"ec2:InstanceType": "p5.48xlarge"}},
            }
        ]
    }
    assert not decide([*HEAD, deny_p5], "ec2:RunInstances", run_instances("p5.48xlarge"))
    assert decide([*HEAD, deny_p5], "ec2:RunInstances", run_instances("g5.2xlarge"))


def test_the_head_launches_into_the_cluster_s_vpc_with_its_security_group_only():
    """Code on the head (Ray tasks may land there) could start a GPU node with the worker role and its own user-data
    in any network of the account while RunInstances allowed `subnet/*`, `security-group/*` and `network-interface/*`
    unconditioned (the policy as it was): now the subnet and the new interface must be in the cluster's VPC
    (`ec2:Vpc`, ArnEquals) and the group is the cluster's own, the ids aws/setup.sh writes in."""
    assert launch_problems(HEAD) == []
    statements = [s for s in policy("head-launch")["Statement"] if s["Action"] == ["ec2:RunInstances"]]
    for kind in ("subnet", "security-group", "network-interface"):
        (s,) = [s for s in statements if any(f":{kind}/" in r for r in _list(s["Resource"]))]
        assert s["Condition"]["ArnEquals"]["ec2:Vpc"] == f"arn:aws:ec2:*:{ACCOUNT}:vpc/{VPC}", kind
    network = {"subnet", "security-group", "network-interface"}
    kept = [
        s
        for s in policy("head-launch")["Statement"]
        if not {r.split(":")[-1].split("/")[0] for r in _list(s["Resource"])} & network
    ]
    region = f"arn:aws:ec2:*:{ACCOUNT}"
    old = {
        "Statement": [
            *kept,
            {"Effect": "Allow", "Action": ["ec2:RunInstances"], "Resource": [f"{region}:{k}/*" for k in network]},
        ]
    }
    assert launch_problems([old]) == ["may launch into another VPC", "may launch with another security group"]


def test_the_head_ends_and_passes_nothing_else():
    other = {"ec2:ResourceTag/ray-cluster-name": "someone-else"}
    assert not allowed(HEAD, "ec2:TerminateInstances", INSTANCE, other)
    assert not allowed(HEAD, "ec2:TerminateInstances", INSTANCE)  # an untagged instance of the account
    assert not allowed(HEAD, "ec2:CreateTags", INSTANCE)  # could otherwise adopt any instance into the cluster
    for role in ("m2d-ray-head", "Admin", "*"):
        arn = f"arn:aws:iam::{ACCOUNT}:role/{role}"
        assert not allowed(HEAD, "iam:PassRole", arn, {"iam:PassedToService": "ec2.amazonaws.com"}), role
    assert not allowed(HEAD, "iam:PassRole", WORKER_ROLE, {"iam:PassedToService": "lambda.amazonaws.com"})
    for action in ("iam:CreateRole", "iam:AttachRolePolicy", "ec2:ModifyInstanceAttribute", "ec2:CreateSecurityGroup"):
        assert not allowed(HEAD, action), action


#: the S3 operations of the run's storage (pyarrow.fs: HeadBucket, ListObjectsV2, Get/Head/PutObject, multipart,
#: DeleteObject(s); `aws s3 sync` of the wheel cache: the same) -> IAM actions, on the bucket or on an object
S3_CALLS = {
    "HeadBucket": ("s3:ListBucket", "bucket"),
    "ListObjectsV2": ("s3:ListBucket", "bucket"),
    "GetBucketLocation": ("s3:GetBucketLocation", "bucket"),
    "GetObject": ("s3:GetObject", "object"),
    "HeadObject": ("s3:GetObject", "object"),
    "PutObject": ("s3:PutObject", "object"),
    "CreateMultipartUpload": ("s3:PutObject", "object"),
    "UploadPart": ("s3:PutObject", "object"),
    "CompleteMultipartUpload": ("s3:PutObject", "object"),
    "AbortMultipartUpload": ("s3:AbortMultipartUpload", "object"),
    "ListParts": ("s3:ListMultipartUploadParts", "object"),
    "DeleteObject": ("s3:DeleteObject", "object"),
    "DeleteObjects": ("s3:DeleteObject", "object"),
}


def storage_prefixes() -> set[str]:
    """Where the documented runs write: --storage of the tutorial's and the RayJob's run, cluster.yaml's wheel cache."""
    texts = [(ROOT / p).read_text() for p in ("docs/tutorials/cluster.md", "k8s/rayjob.yaml", "cluster.yaml")]
    return {m for t in texts for m in re.findall(r"s3://MY-BUCKET/([\w/-]+)", t)}


@pytest.mark.parametrize("who", ["head", "worker"])
def test_every_node_may_do_what_the_run_s_storage_does_in_the_run_s_bucket(who):
    policies = HEAD if who == "head" else WORKER
    prefixes = storage_prefixes()
    assert {"m2d/qwen3-30b", "m2d/wheels/torch-"} <= prefixes, prefixes
    for op, (action, on) in S3_CALLS.items():
        for prefix in prefixes:
            resource = f"arn:aws:s3:::{BUCKET}" if on == "bucket" else f"arn:aws:s3:::{BUCKET}/{prefix}/x"
            assert allowed(policies, action, resource), (op, prefix)
            other = resource.replace(BUCKET, "another-bucket")
            assert not allowed(policies, action, other), (op, "another bucket")


def test_a_worker_may_use_the_bucket_and_nothing_else():
    """The blast radius of code running on a worker (any Ray task): the run's bucket, no EC2, no IAM."""
    for action in ("ec2:RunInstances", "ec2:TerminateInstances", "ec2:DescribeInstances", "iam:PassRole", "s3:*"):
        assert not allowed(WORKER, action, INSTANCE, {"ec2:ResourceTag/ray-cluster-name": CLUSTER}), action
    assert not allowed(WORKER, "s3:DeleteBucket", f"arn:aws:s3:::{BUCKET}")
    assert not allowed(WORKER, "s3:PutBucketPolicy", f"arn:aws:s3:::{BUCKET}")
    statements = [s for p in WORKER for s in p["Statement"]]
    assert all(a.startswith("s3:") and "*" not in a for s in statements for a in _list(s["Action"]))


def test_the_evaluator_can_fail():
    """The checks above would see a wider policy: Ray's default role, and a PassRole on every role."""
    wide = {"Statement": [{"Effect": "Allow", "Action": ["ec2:*", "s3:*"], "Resource": "*"}]}
    assert allowed([wide], "ec2:TerminateInstances", INSTANCE) and allowed([wide], "s3:GetObject", "arn:aws:s3:::b/k")
    passes_all = {"Statement": [{"Effect": "Allow", "Action": "iam:PassRole", "Resource": "*"}]}
    assert allowed([passes_all], "iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/Admin")
    denied = {"Statement": [{**wide["Statement"][0], "Effect": "Deny", "Action": "s3:*"}]}
    assert not allowed([wide, denied], "s3:GetObject", "arn:aws:s3:::b/k")  # an explicit Deny wins
    assert allowed([wide, denied], "ec2:TerminateInstances", INSTANCE)
    with pytest.raises(AssertionError):
        allowed([{"Statement": [{**wide["Statement"][0], "Effect": "Maybe"}]}], "s3:GetObject")
    vpc = f"arn:aws:ec2:us-west-2:{ACCOUNT}:vpc/{VPC}"
    assert _arn_matches(vpc, f"arn:aws:ec2:*:{ACCOUNT}:vpc/{VPC}") and not _arn_matches(vpc, "arn:aws:ec2:*:vpc/*")
    assert not _arn_matches(vpc, f"arn:aws:ec2:*:{ACCOUNT}:vpc/vpc-0another") and not _arn_matches(
        "vpc-1", "*:*:*:*:*:*"
    )
    # a request's tags are the instance's: a statement that asks them of the subnet is refused, as IAM refuses it
    on_subnet = {
        "Statement": [
            {
                "Effect": "Allow",
                "Action": "ec2:RunInstances",
                "Resource": "*",
                "Condition": {"StringEquals": {"aws:RequestTag/ray-cluster-name": CLUSTER}},
            }
        ]
    }
    assert not decide([on_subnet], "ec2:RunInstances", run_instances("g5.2xlarge"))
    assert decide([on_subnet], "ec2:RunInstances", run_instances("g5.2xlarge")[:1])


def test_the_roles_trust_ec2_and_every_page_uses_these_files():
    trust = json.loads((IAM / "ec2-trust.json").read_text())
    assert trust["Statement"] == [
        {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}
    ]
    tutorial = (ROOT / "docs" / "tutorials" / "cluster.md").read_text()
    for name in ("ec2-trust", "bucket", "head-launch"):
        assert f"aws/iam/{name}.json" in tutorial, name
    k8s = (ROOT / "docs" / "how-to" / "kubernetes.md").read_text()
    assert "aws/iam/bucket.json" in k8s and "associate-iam-oidc-provider" in k8s
    for page in (tutorial, k8s, (ROOT / "docs" / "explanation" / "security.md").read_text()):
        assert "arn:aws:iam::aws:policy/Amazon" not in page  # no AWS-managed full-access policy attached
