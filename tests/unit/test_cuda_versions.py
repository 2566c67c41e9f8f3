"""One CUDA major version from the image to the driver: k8s/Dockerfile's base image (Ray's tag -> its CUDA, from Ray's
own image list), the torch it installs (the CUDA its Linux wheel requires, from the wheel's METADATA as PyPI serves it),
and the NVIDIA driver that CUDA needs (stated where the nodes are chosen, and checked by cluster.yaml's worker setup).
torch's cpp_extension refuses to build flash-attn against a toolkit of another major version, and a CUDA 13 torch
finds no GPU under a driver older than 580. What the test reads was recorded once (tests/data/cuda/versions.json: how);
no network here."""

from __future__ import annotations

import json
import re

import pytest
from conftest import ROOT
from packaging.requirements import Requirement

DATA = json.loads((ROOT / "tests" / "data" / "cuda" / "versions.json").read_text())
DOCKERFILE = ROOT / "k8s" / "Dockerfile"


def image_cuda(tag: str) -> str:
    """The CUDA version (major.minor) of a rayproject/ray tag, by Ray's own tag rule and platform list."""
    images = DATA["ray_images"]
    suffix = tag.rsplit("-", 1)[1]
    platform = images["gpu_platform"] if suffix == "gpu" else None
    for p in images["platforms"]:
        m = re.fullmatch(r"cu(\d+)\.(\d+)\.\d+-.*", p)
        if m and suffix == f"cu{m[1]}{m[2]}":
            platform = p
    if platform is None:
        raise ValueError(f"{tag}: not a CUDA image of Ray's list")
    return ".".join(platform[2:].split("-")[0].split(".")[:2])


def torch_cuda_major(requires_dist: list[str]) -> str:
    """The CUDA major version torch's Linux wheel requires: cuda-toolkit's pin, which every nvidia-*-cuN wheel agrees
    with."""
    linux = [r for r in map(Requirement, requires_dist) if r.marker and r.marker.evaluate({"platform_system": "Linux"})]
    toolkit = [r for r in linux if r.name == "cuda-toolkit"]
    assert len(toolkit) == 1, requires_dist
    (spec,) = toolkit[0].specifier
    major = spec.version.split(".")[0]
    suffixes = {r.name.rsplit("-cu", 1)[1] for r in linux if r.name.startswith("nvidia-")}
    assert suffixes == {major}, (major, suffixes)
    return major


def dockerfile() -> tuple[str, str]:
    """(base image tag, the torch version it installs)."""
    text = DOCKERFILE.read_text()
    (tag,) = re.findall(r"^ARG BASE_IMAGE=rayproject/ray:(\S+)$", text, flags=re.M)
    assert re.findall(r"^FROM (\S+)", text, flags=re.M)[0] == "${BASE_IMAGE}"  # the first stage is built on it
    (torch_pin,) = re.findall(r"torch==([\w.]+)", text)
    return tag, torch_pin


def test_the_image_s_cuda_is_the_one_torch_s_wheel_requires():
    tag, torch_pin = dockerfile()
    assert torch_pin == DATA["torch"]["version"]
    assert DATA["torch"]["wheel"].startswith(f"torch-{torch_pin}-") and "manylinux" in DATA["torch"]["wheel"]
    major = torch_cuda_major(DATA["torch"]["requires_dist"])
    assert major == "13"  # torch 2.13.0 on PyPI: cuda-toolkit==13.0.3
    assert image_cuda(tag).split(".")[0] == major, tag


def test_every_torch_pin_is_the_recorded_wheel_s():
    """The image, the constraints the tests run with and pyproject.toml's range name the torch whose metadata is
    recorded: a new torch means a new record (and perhaps a new image)."""
    version = DATA["torch"]["version"]
    assert f"\ntorch=={version}\n" in (ROOT / "constraints.txt").read_text()
    (rng,) = re.findall(r'"torch(>=[\d.]+,<[\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert version in Requirement(f"torch{rng}").specifier


def test_the_check_fails_on_ray_s_default_gpu_tag():
    """Ray's `-gpu` alias is CUDA 12.1 (what k8s/Dockerfile said before): the image's major is not torch's."""
    assert image_cuda("2.60.0-py311-gpu") == "12.1"
    assert image_cuda("2.60.0-py311-cu128") == "12.8"
    with pytest.raises(ValueError):
        image_cuda("2.60.0-py311-cu999")
    cu12 = [r.replace("cu13", "cu12").replace("==13.0.3", "==12.8.1") for r in DATA["torch"]["requires_dist"]]
    assert torch_cuda_major(cu12) == "12"
    mixed = [*DATA["torch"]["requires_dist"], 'nvidia-nccl-cu12==2.27.3; platform_system == "Linux"']
    with pytest.raises(AssertionError):
        torch_cuda_major(mixed)


def test_the_driver_that_cuda_needs_is_stated_and_checked():
    """The GPU nodes' driver floor for torch's CUDA major, in the pages that choose the nodes and in the check
    cluster.yaml's GPU workers run before anything else."""
    major = torch_cuda_major(DATA["torch"]["requires_dist"])
    floor = DATA["driver"]["minimum_by_cuda_major"][major].split(".")[0]
    for page in ("docs/how-to/kubernetes.md", "docs/tutorials/cluster.md", "docs/how-to/gpu.md"):
        assert f"driver ≥ {floor}" in " ".join((ROOT / page).read_text().split()), page
    cluster = (ROOT / "cluster.yaml").read_text()
    assert f'test "${{driver%%.*}}" -ge {floor}' in cluster
    assert f"CUDA {major}" in DOCKERFILE.read_text() and f">= {floor}" in DOCKERFILE.read_text()
