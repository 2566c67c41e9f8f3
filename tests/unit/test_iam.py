"""The AWS path's IAM policies (aws/iam/*.json) read as AWS reads them, against what is actually called: every EC2 call
in Ray 2.60's AWS node provider (its source, read here) that the head's autoscaler makes with cluster.yaml's settings,
and the S3 calls of the run's storage (pyarrow.fs, `aws s3 sync`). Least privilege both ways: each call is allowed, and
the calls a worker or a stolen credential could abuse are not (launching or ending other instances, passing another
role, another bucket). The evaluator below covers what these policies use: Allow statements, `*`/`?` wildcards in
actions and resources, StringEquals conditions. No AWS here: the policies are not tried against IAM itself."""

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


def policy(name: str) -> dict:
    text = (IAM / f"{name}.json").read_text().replace("MY-BUCKET", BUCKET).replace("MY-ACCOUNT", ACCOUNT)
    return json.loads(text)


def allowed(policies: list[dict], action: str, resource: str = "*", context: dict | None = None) -> bool:
    """Whether an Allow statement of `policies` covers the call (no Deny statements are used; IAM denies by
    default)."""
    context = context or {}
    for p in policies:
        for s in p["Statement"]:
            assert s["Effect"] == "Allow" and set(s) <= {"Sid", "Effect", "Action", "Resource", "Condition"}, s
            actions, resources = _list(s["Action"]), _list(s["Resource"])
            if not any(fnmatch.fnmatchcase(action.lower(), a.lower()) for a in actions):
                continue
            if not any(fnmatch.fnmatchcase(resource, r) for r in resources):
                continue
            if all(_holds(op, cond, context) for op, cond in s.get("Condition", {}).items()):
                return True
    return False


def _holds(op: str, cond: dict, context: dict) -> bool:
    assert op == "StringEquals", op  # the only operator these policies use
    return all(context.get(k) in _list(v) for k, v in cond.items())


def _list(v) -> list:
    return v if isinstance(v, list) else [v]


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
    assert allowed(HEAD, "ec2:RunInstances", INSTANCE)
    assert allowed(HEAD, "ec2:CreateTags", INSTANCE, {"ec2:CreateAction": "RunInstances"})  # TagSpecifications
    assert allowed(HEAD, "ec2:CreateTags", INSTANCE, own)  # set_node_tags on a running node
    assert allowed(HEAD, "ec2:TerminateInstances", INSTANCE, own)
    # a worker's instance profile: RunInstances with IamInstanceProfile needs iam:PassRole on its role
    assert allowed(HEAD, "iam:PassRole", WORKER_ROLE, {"iam:PassedToService": "ec2.amazonaws.com"})
    for action in NOT_ON_THIS_HEAD:
        assert not allowed(HEAD, action, INSTANCE, own), action


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
    with pytest.raises(AssertionError):
        allowed([{"Statement": [{**wide["Statement"][0], "Effect": "Deny"}]}], "s3:GetObject")


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
