"""What the cluster's nodes and image install, and how they build flash-attn, read from the files: every install line of
cluster.yaml and k8s/Dockerfile takes constraints.txt (the versions the suite last passed with), so the head, workers
that join hours later and the image agree on torch (the wheel cache's key), flash-attn and MLflow (a copied run's
store); the Dockerfile builds flash-attn from no more of the tree than it needs, before the tree is copied; the build's
parallelism is sized to the memory it sees (scripts/flash-attn-jobs.sh, run here on planted /proc/meminfo and cgroup
files); and a setup command stops at its first failing step, the bucket checked before any build (cluster.yaml's build
command run here under bash with stand-ins for aws and python). Each check is shown failing on the file as it was."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

CLUSTER_YAML = ROOT / "cluster.yaml"
DOCKERFILE = ROOT / "k8s" / "Dockerfile"
JOBS = ROOT / "scripts" / "flash-attn-jobs.sh"
SETUP_LISTS = ("setup_commands", "head_setup_commands", "worker_setup_commands")
INSTALL = re.compile(r"\b(?:uv pip install|pip install|pip wheel)\b")


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def dockerfile_runs(text: str) -> list[str]:
    """The Dockerfile's instructions, continued lines joined."""
    lines = re.sub(r"\\\n\s*", " ", text).splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def install_calls(command: str) -> list[str]:
    """Each pip / uv pip invocation of a shell command line (split at &&, ||, ; and |)."""
    return [part.strip() for part in re.split(r"&&|\|\||;|\|", command) if INSTALL.search(part)]


def unconstrained(commands: list[str]) -> list[str]:
    return [c for cmd in commands for c in install_calls(cmd) if not re.search(r"(?:^|\s)-c\s+\S*constraints\.txt", c)]


def cluster_commands(text: str) -> list[str]:
    raw = yaml.safe_load(text)
    return [c for key in SETUP_LISTS for c in raw[key]]


def test_every_install_of_the_cluster_and_the_image_takes_the_constraints():
    commands = cluster_commands(CLUSTER_YAML.read_text())
    runs = [line for line in dockerfile_runs(DOCKERFILE.read_text()) if line.startswith("RUN ")]
    calls = [c for cmd in commands + runs for c in install_calls(cmd)]
    assert len(calls) >= 10, calls  # the project, ray[default], awscli, build tools, boto3, flash-attn, [gpu]
    assert unconstrained(commands + runs) == []
    # what the old files did: no constraints on the project's install (the planted check can fail)
    old = '~/.local/bin/uv pip install --python ~/venv/bin/python -e "$HOME/m2d_ray" "ray[default]==2.60.0"'
    assert unconstrained([old, "RUN pip install --no-cache-dir torch==2.13.0 && pip install -e '.[gpu]'"]) == [
        old,
        "RUN pip install --no-cache-dir torch==2.13.0",
        "pip install -e '.[gpu]'",
    ]


def test_the_constraints_pin_what_machines_must_agree_on():
    """torch (the wheel cache's key and flash-attn's ABI), flash-attn and liger-kernel (the [gpu] extra, outside the CPU
    suite's freeze), MLflow (a copied run's store), Ray (the nodes and the laptop), boto3/awscli (the head's launches,
    the bucket); a version written beside an install line is the constraints' own."""
    pins = constraints()
    for name in ("torch", "flash-attn", "liger-kernel", "mlflow", "ray", "boto3", "awscli", "botocore"):
        assert name in pins, name
    text = CLUSTER_YAML.read_text() + DOCKERFILE.read_text()
    for name, version in re.findall(r"\b(torch|ray)(?:\[[\w,]+\])?==([\w.]+)", text):
        assert pins[name] == version, (name, version)


def test_the_image_builds_flash_attn_before_the_tree_is_copied():
    """An edit of the tree (the bucket, the image's name) rebuilds only the layers after `COPY . .`: flash-attn's wheel
    is built in a stage that copies constraints.txt and the jobs script alone, and installed before the tree comes."""
    text = DOCKERFILE.read_text()
    assert layer_problems(text) == []
    old = (
        "FROM rayproject/ray:2.60.0-py311-cu130\nWORKDIR /home/ray/m2d_ray\nCOPY --chown=ray:users . .\n"
        'RUN pip install --no-cache-dir torch==2.13.0 && FLASH_ATTN_CUDA_ARCHS="80;90" MAX_JOBS=4 pip install '
        '--no-build-isolation "flash-attn>=2.6"\n'
    )
    assert layer_problems(old)


def layer_problems(text: str) -> list[str]:
    lines = dockerfile_runs(text)
    tree = [i for i, line in enumerate(lines) if re.fullmatch(r"COPY (--chown=\S+ )?\. \.", line)]
    build = [i for i, line in enumerate(lines) if "flash-attn" in line and "pip wheel" in line]
    install = [i for i, line in enumerate(lines) if "pip install" in line and "flash_attn-" in line]
    problems = []
    if len(tree) != 1 or len(build) != 1 or len(install) != 1:
        return [f"one tree copy, one flash-attn build, one wheel install: {tree}, {build}, {install}"]
    if not build[0] < install[0] < tree[0]:
        problems.append("flash-attn built or installed after the tree is copied")
    copies = [line for line in lines[: build[0]] if line.startswith("COPY")]
    copied = {p for line in copies for p in line.split()[1:-1] if not p.startswith("--")}
    if not copied <= {"constraints.txt", "scripts/flash-attn-jobs.sh"}:
        problems.append(f"the build's layers copy {copied}")
    if re.search(r"MAX_JOBS=\d", text):
        problems.append("a fixed MAX_JOBS")
    if "flash-attn-jobs.sh" not in lines[build[0]]:
        problems.append("the build's jobs not sized to its memory")
    return problems


def wheel_problems(text: str) -> list[str]:
    """How the deps stage gets flash-attn's wheel: a bind mount of the build stage's folder for the install's RUN alone
    (no layer keeps the wheel, nothing to delete), not a COPY, whose missing destination BuildKit makes as root (mode
    0755: the image's uid 1000 cannot remove it, and the layer keeps the wheel anyway)."""
    lines = dockerfile_runs(text)
    out = [f"copied into a layer: {line}" for line in lines if re.match(r"COPY\b.*--from=flash-attn\b", line)]
    (built,) = re.findall(r"pip wheel .*-w (\S+) flash-attn", text)
    (install,) = [line for line in lines if "pip install" in line and "flash_attn-" in line]
    mount = re.match(r"RUN --mount=type=bind,from=flash-attn,source=(\S+?),target=(\S+) ", install)
    if not mount or mount.group(1) != built or f"{mount.group(2)}/flash_attn-" not in install:
        out.append(f"the install does not bind-mount the build's {built}: {install}")
    if re.search(r"\brm\b", install):
        out.append(f"removes what a COPY made: {install}")
    return out


def test_the_image_takes_flash_attn_s_wheel_through_a_bind_mount():
    assert wheel_problems(DOCKERFILE.read_text()) == []
    old = (  # the deps stage as it was: the rm is denied to uid 1000 (and the wheel stays in the COPY's layer)
        "RUN pip wheel --no-deps -c constraints.txt -w /tmp/wheels flash-attn\nFROM base AS deps\n"
        "COPY --from=flash-attn /tmp/wheels /tmp/wheels\n"
        "RUN pip install --no-cache-dir -c constraints.txt /tmp/wheels/flash_attn-*.whl && rm -rf /tmp/wheels\n"
    )
    assert len(wheel_problems(old)) == 3


def test_the_build_tools_are_pinned_and_uv_is_its_release_s():
    """pip freeze leaves pip, setuptools and wheel out, so `-c constraints.txt` pinned none of them; flash-attn's
    setup.py builds with them (no build isolation). uv came from an unversioned `curl | sh`: now its installer is the
    release constraints.txt names, and a node with another uv gets that one."""
    pins = constraints()
    assert {"pip", "setuptools", "wheel", "uv"} <= set(pins)
    text = CLUSTER_YAML.read_text()
    assert unversioned_uv(text) == [] and unversioned_uv("curl -LsSf https://astral.sh/uv/install.sh | sh") != []
    (base,) = [line for line in dockerfile_runs(DOCKERFILE.read_text()) if "torch==" in line]
    assert re.search(r"pip install [^&]*-c constraints.txt pip setuptools wheel\b", base), base
    (tools,) = [c for c in cluster_commands(text) if "setuptools" in c]
    assert re.search(r"-c \S*constraints.txt\S* pip setuptools wheel\b", tools), tools


def unversioned_uv(text: str) -> list[str]:
    """uv installers fetched without constraints.txt's version (`$uv`, read from it)."""
    urls = re.findall(r"https://astral\.sh/uv/\S*install\.sh", text)
    if "uv=$(sed -n 's/^uv==//p' ~/m2d_ray/constraints.txt)" not in text:
        return urls
    return [u for u in urls if "/uv/$uv/install.sh" not in u]


#: curl fetching uv's installer for the URL's release (`curl -LsSf URL -o FILE`): it puts that uv in ~/.local/bin
CURL_UV = r"""echo "curl $*" >> "$HOME/log"
v=${2#https://astral.sh/uv/}; v=${v%/install.sh}
cat > "$4" <<EOF
mkdir -p "\$HOME/.local/bin"
printf '#!/bin/sh\necho "uv %s (0123abc 2026-01-01)"\n' "$v" > "\$HOME/.local/bin/uv"
chmod +x "\$HOME/.local/bin/uv"
EOF"""


def test_a_node_installs_constraints_uv_once(node):
    (install,) = [c for c in yaml.safe_load(CLUSTER_YAML.read_text())["setup_commands"] if "astral.sh/uv" in c]
    uv = node / ".local" / "bin" / "uv"
    rc, log = run_on(node, install, {"curl": CURL_UV})
    assert rc == 0 and f"https://astral.sh/uv/{constraints()['uv']}/install.sh" in log, log
    assert constraints()["uv"] in uv.read_text()
    (node / "log").unlink()
    rc, log = run_on(node, install, {"curl": CURL_UV})
    assert rc == 0 and "curl" not in log  # the pinned uv is there
    uv.write_text("#!/bin/sh\necho uv 0.1.0\n")
    rc, log = run_on(node, install, {"curl": CURL_UV})
    assert rc == 0 and log.count("curl") == 1 and constraints()["uv"] in uv.read_text()  # another uv: replaced


# --- failed setups: the driver first, and what ends the nodes --------------------------------------------------------


def test_a_gpu_node_s_driver_is_checked_before_any_install(node):
    """A GPU node's setup_commands start with the driver check, guarded by `nvidia-smi -L` (the CPU head, the same
    DLAMI, lists no GPU), so a p5.48xlarge with an old driver stops in seconds, not after the installs."""
    setup = yaml.safe_load(CLUSTER_YAML.read_text())["setup_commands"]
    first = setup[0]
    assert "nvidia-smi -L" in first and not install_calls(first)
    smi = 'case "$1" in -L) test -n "$GPU" && echo "GPU 0: NVIDIA H100" ;; *) echo "$DRIVER" ;; esac'
    for gpu, driver, ok in (("", "", True), ("1", "580.65.06", True), ("1", "550.54.15", False)):
        rc, _ = run_on(node, first, {"nvidia-smi": smi}, GPU=gpu, DRIVER=driver)
        assert (rc == 0) is ok, (gpu, driver)


def failure_messages(text: str) -> list[str]:
    """Every `echo "m2d: ..." >&2` of cluster.yaml's setup commands."""
    commands = cluster_commands(text)
    return [m for c in commands for m in re.findall(r'echo "(m2d: [^"]*)" >&2', c)]


def test_every_failed_setup_says_how_to_end_the_nodes():
    """A node whose setup failed keeps running (and billing, ~$55 an hour for a p5.48xlarge): each message says
    `ray down cluster.yaml` last."""
    messages = failure_messages(CLUSTER_YAML.read_text())
    assert len(messages) >= 5, messages  # driver (version, none), bucket, CUDA toolkit, the build's memory
    assert [m for m in messages if not m.endswith("ray down cluster.yaml")] == []
    old = "setup_commands: ['test -d x || { echo \"m2d: pick a DLAMI (cluster.yaml, AMI)\" >&2; exit 1; }']"
    assert failure_messages(old + "\nhead_setup_commands: []\nworker_setup_commands: []") == [
        "m2d: pick a DLAMI (cluster.yaml, AMI)"
    ]


# --- the build's parallelism ------------------------------------------------------------------------------------------


def jobs(tmp_path: Path, available_gib: float, cpus: int = 8, cgroup: tuple[float, float] | None = None) -> str:
    """scripts/flash-attn-jobs.sh's output on a machine with that much MemAvailable, CPUs and cgroup (limit, usage)."""
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {int(available_gib * 2**20)} kB\n")
    cg = tmp_path / "cgroup"
    cg.mkdir(exist_ok=True)
    if cgroup:
        (cg / "memory.max").write_text(f"{int(cgroup[0] * 2**30)}\n")
        (cg / "memory.current").write_text(f"{int(cgroup[1] * 2**30)}\n")
    env = {"PATH": "/usr/bin:/bin", "M2D_MEMINFO": str(tmp_path / "meminfo"), "M2D_CGROUP": str(cg)}
    out = subprocess.run(["sh", str(JOBS)], env={**env, "M2D_NPROC": str(cpus)}, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else f"exit {out.returncode}: {out.stderr.strip()}"


def test_the_build_s_jobs_fit_the_memory_it_sees(tmp_path):
    """flash-attn's setup.py: ~8-9 GB a compile job at nvcc's 4 threads (its default). The head (m5.2xlarge, 32 GiB,
    ~30.5 available) gets 3 jobs, not the 4 (~36 GB) that ran out of memory; Docker Desktop's 8 GiB VM one job at fewer
    threads; a container's cgroup limit counts, not the host's memory; under one thread's share it stops at once."""
    assert jobs(tmp_path, 30.5) == "MAX_JOBS=3 NVCC_THREADS=4"
    assert 4 * 9 > 30.5  # the old MAX_JOBS=4 on the head
    assert jobs(tmp_path, 2000, cpus=192) == "MAX_JOBS=96 NVCC_THREADS=4"  # a p5: half the CPUs, flash-attn's cap
    assert jobs(tmp_path, 7.5) == "MAX_JOBS=1 NVCC_THREADS=3"
    assert jobs(tmp_path, 120, cgroup=(8, 0.5)) == "MAX_JOBS=1 NVCC_THREADS=3"  # docker build --memory 8g on a big host
    assert jobs(tmp_path, 1.5).startswith("exit 1: m2d: ") and "9 GiB" in jobs(tmp_path, 1.5)
    for gib in (3, 9, 17.9, 18, 30.5, 64, 100):
        out = dict(kv.split("=") for kv in jobs(tmp_path, gib, cpus=64).split())
        assert int(out["MAX_JOBS"]) * int(out["NVCC_THREADS"]) * 2.25 <= gib, (gib, out)


def test_the_ram_the_build_needs_is_said_where_it_runs():
    for page in ("docs/how-to/kubernetes.md", "docs/tutorials/cluster.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert "9 GiB" in text and "scripts/flash-attn-jobs.sh" in text, page
    assert "flash-attn-jobs.sh" in CLUSTER_YAML.read_text() and not re.search(r"MAX_JOBS=\d", CLUSTER_YAML.read_text())


# --- setup commands stop at their first failure -----------------------------------------------------------------------


def not_stopping(commands: list[str]) -> list[str]:
    """Commands of several steps (joined by `;`, outside a `{ ...; exit 1; }` failure branch) that do not start with
    `set -e`: a failing step would be passed over."""
    return [c for c in commands if ";" in re.sub(r"\{[^{}]*\}", "", c) and not c.lstrip().startswith("set -e")]


def test_every_setup_command_of_several_steps_stops_at_its_first_failure():
    raw = yaml.safe_load(CLUSTER_YAML.read_text())
    assert not_stopping(cluster_commands(CLUSTER_YAML.read_text())) == []
    old_build = "if command -v aws >/dev/null; then aws=aws; fi; mkdir -p ~/wheels && $aws s3 sync x ~/wheels; ls ~/w"
    assert not_stopping([old_build]) == [old_build]
    setup = raw["setup_commands"]
    check = next(i for i, c in enumerate(setup) if re.match(r"\S*aws s3 ls s3://MY-BUCKET/", c))
    build = next(i for i, c in enumerate(setup) if "pip wheel" in c)
    assert check < build and "exit 1" in setup[check]


@pytest.fixture
def node(tmp_path) -> Path:
    """A head's home with stand-ins: python (torch's version; `pip wheel` writes a wheel and logs it) and aws (logs its
    call, fails when the file `aws-fails` exists), the checkout's constraints and jobs script."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    home = tmp_path / "home"
    (home / "venv" / "bin").mkdir(parents=True)
    (home / "m2d_ray" / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "constraints.txt", home / "m2d_ray")
    shutil.copy(JOBS, home / "m2d_ray" / "scripts")
    fa = constraints()["flash-attn"]
    stubs = {
        "python": f"""case "$*" in
  *"import torch"*) echo 2.13.0 ;;
  *"pip wheel"*) echo "built $MAX_JOBS $NVCC_THREADS" >> "$HOME/log"
    touch "$HOME/wheels/flash_attn-{fa}-cp311-linux_x86_64.whl" ;;
esac""",
        "aws": 'echo "aws $*" >> "$HOME/log"; test ! -e "$HOME/aws-fails"',
    }
    for name, body in stubs.items():
        (home / "venv" / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        os.chmod(home / "venv" / "bin" / name, 0o755)
    (tmp_path / "meminfo").write_text("MemAvailable: 31981568 kB\n")
    return home


def run_on(home: Path, command: str, stubs: dict[str, str] | None = None, **extra: str) -> tuple[int, str]:
    """The command as Ray's updater runs it (in a subshell, after the login shell's own lines), with `stubs` (name:
    shell body) first on PATH and `extra` in the environment."""
    bin_ = home.parent / "stubs"
    bin_.mkdir(exist_ok=True)
    for name, body in (stubs or {}).items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        os.chmod(bin_ / name, 0o755)
    env = {"HOME": str(home), "PATH": f"{bin_}:/usr/bin:/bin", "TMPDIR": str(home.parent), "M2D_NPROC": "8"}
    env |= {"M2D_MEMINFO": str(home.parent / "meminfo"), **extra}
    out = subprocess.run(["bash", "--norc", "-c", f"true && ({command})"], env=env, capture_output=True, text=True)
    log = home / "log"
    return out.returncode, log.read_text() if log.exists() else ""


def test_the_wheel_cache_builds_once_and_stops_on_a_bucket_it_cannot_reach(node):
    (build,) = [c for c in yaml.safe_load(CLUSTER_YAML.read_text())["setup_commands"] if "pip wheel" in c]
    rc, log = run_on(node, build)
    assert rc == 0 and "built 3 4" in log, log  # the head's memory: 3 jobs at 4 threads
    assert log.count("aws s3 sync") == 2 and log.index("s3://MY-BUCKET") < log.index("built")
    (node / "log").unlink()
    rc, log = run_on(node, build)
    assert rc == 0 and "built" not in log  # the wheel is there: no build
    shutil.rmtree(node / "wheels")
    (node / "log").unlink()
    (node / "aws-fails").touch()  # MY-BUCKET left in place, or a role without it
    rc, log = run_on(node, build)
    assert rc != 0 and "built" not in log, log  # stops at the first failing step, before an hour's compile
    (node / "log").unlink()
    rc, log = run_on(node, build.replace("set -e;", "", 1))  # as it was: steps joined with `;`
    assert rc != 0 or "built" in log
    assert "built" in log  # compiled for an hour, then the upload failed


# --- the tutorial's account setup (aws/setup.sh) and the docs' shell --------------------------------------------------

AWS_STUB = r"""#!/usr/bin/env bash
# An account as the environment describes it (nothing exists unless said): M2D_PROFILES (the instance profiles and roles
# exist: "full" with their role, "empty" without), M2D_DEFAULT_VPC, M2D_OUR_VPC (the m2d-ray VPC of an earlier run),
# M2D_IGW (its gateway), M2D_ROUTE (its route to it), M2D_SUBNETS (its subnets' zones), M2D_PUBLIC_SUBNETS, M2D_SG,
# M2D_SSH (the group's SSH sources), M2D_OWN (its source groups); M2D_FAIL: the call that fails.
echo "aws $*" >> "$M2D_LOG"
case " $* " in *" $M2D_FAIL "*) echo "An error occurred (AccessDenied)" >&2; exit 254 ;; esac
arg() { local want=$1; shift; while [ $# -gt 1 ]; do [ "$1" = "$want" ] && { echo "$2"; return; }; shift; done; }
case "$*" in
  "sts get-caller-identity"*) echo 123456789012 ;;
  "iam get-instance-profile"*) test -n "$M2D_PROFILES" || exit 254
    if [ "$M2D_PROFILES" = full ]; then arg --instance-profile-name "$@"; else echo; fi ;;
  "iam get-"*) test -n "$M2D_PROFILES" || exit 254 ;;
  "ec2 describe-vpcs"*is-default*) echo "${M2D_DEFAULT_VPC:-None}" ;;
  "ec2 describe-vpcs"*) echo "${M2D_OUR_VPC:-None}" ;;
  "ec2 create-vpc"*) echo vpc-0new ;;
  "ec2 describe-internet-gateways"*) echo "${M2D_IGW:-None}" ;;
  "ec2 create-internet-gateway"*) echo igw-0new ;;
  "ec2 describe-route-tables"*association.main*) echo rtb-0main ;;
  "ec2 describe-route-tables"*) echo "${M2D_ROUTE:-}" ;;
  "ec2 describe-subnets"*"Subnets[0]"*) all="$*"; zone=${all##*availability-zone,Values=}; zone=${zone%% *}
    case " $M2D_SUBNETS " in *" $zone "*) echo "subnet-0old-$zone" ;; *) echo None ;; esac ;;
  "ec2 create-subnet"*) echo "subnet-$RANDOM" ;;
  "ec2 describe-subnets"*) echo "${M2D_PUBLIC_SUBNETS:-4}" ;;
  "ec2 describe-security-groups"*FromPort*) echo "${M2D_SSH:-}" ;;
  "ec2 describe-security-groups"*UserIdGroupPairs*) echo "${M2D_OWN:-}" ;;
  "ec2 describe-security-groups"*) echo "${M2D_SG:-None}" ;;
  "ec2 create-security-group"*) echo sg-0new ;;
  "ec2 describe-images"*--image-ids*) echo "Supported EC2 instances: ... NVIDIA driver 580, CUDA 13.0" ;;
  "ec2 describe-images"*) echo ami-0new ;;
esac
"""


def setup_run(
    tmp_path: Path, script: str | None = None, args: tuple[str, ...] = (), cluster: str | None = None, **env: str
) -> tuple[int, str, str]:
    """aws/setup.sh in a copy of the repository's files it reads and edits (cluster.yaml's text: `cluster`), with `aws`
    and `curl` stood in for: (exit status, the aws calls in order, cluster.yaml after); its stderr in tmp_path/stderr,
    its temporary files (the policies it puts) under tmp_path/tmp."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "aws", repo / "aws")
    (repo / "cluster.yaml").write_text(CLUSTER_YAML.read_text() if cluster is None else cluster)
    (tmp_path / "tmp").mkdir()
    if script is not None:
        (repo / "aws" / "setup.sh").write_text(script)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in {"aws": AWS_STUB, "curl": "#!/bin/sh\necho 203.0.113.7\n"}.items():
        (bin_ / name).write_text(body)
        os.chmod(bin_ / name, 0o755)
    log = tmp_path / "calls"
    log.touch()
    full = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "M2D_LOG": str(log), "M2D_PROFILE_WAIT": "0"}
    full |= {"TMPDIR": str(tmp_path / "tmp"), "M2D_FAIL": "-"}
    out = subprocess.run(["bash", str(repo / "aws" / "setup.sh"), "my-bucket", *args], env={**full, **env},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    (tmp_path / "stderr").write_text(out.stderr)
    return out.returncode, log.read_text(), (repo / "cluster.yaml").read_text()


def test_the_account_setup_fills_cluster_yaml_in_a_default_vpc(tmp_path):
    rc, calls, cluster = setup_run(tmp_path, M2D_DEFAULT_VPC="vpc-0default")
    assert rc == 0, calls
    assert "MY-BUCKET" not in cluster and "s3://my-bucket/m2d/wheels" in cluster
    assert "SecurityGroupIds: &sg [sg-0new]" in cluster and "ImageId: &dlami ami-0new" in cluster
    assert "create-vpc" not in calls and "--vpc-id vpc-0default --group-name m2d-ray" in calls
    assert "--cidr 203.0.113.7/32" in calls
    lines = calls.splitlines()
    first = {what: next(i for i, c in enumerate(lines) if what in c) for what in ("head-bucket", "create-role", "ec2 ")}
    assert first["head-bucket"] < first["create-role"]  # the bucket before anything is made
    waits = [i for i, c in enumerate(lines) if "wait instance-profile-exists" in c]
    assert len(waits) == 2 and max(waits) < first["ec2 "]  # the new profiles exist before anything launches
    policy = next(c for c in lines if "--policy-name launch-workers" in c)
    assert "put-role-policy --role-name m2d-ray-head" in policy


def test_the_account_setup_makes_a_public_network_where_there_is_no_default_vpc(tmp_path):
    rc, calls, _ = setup_run(tmp_path)
    assert rc == 0, calls
    zones = re.search(r"availability_zone: (\S+)", CLUSTER_YAML.read_text()).group(1).split(",")
    subnets = [c for c in calls.splitlines() if "create-subnet" in c]
    assert [re.search(r"--availability-zone (\S+)", c).group(1) for c in subnets] == zones
    assert calls.count("--map-public-ip-on-launch") == len(zones)
    assert "attach-internet-gateway" in calls and "--destination-cidr-block 0.0.0.0/0 --gateway-id igw-0new" in calls
    assert "--vpc-id vpc-0new --group-name m2d-ray" in calls
    rc, calls, cluster = setup_run(tmp_path / "2", M2D_DEFAULT_VPC="vpc-0private", M2D_PUBLIC_SUBNETS="0")
    assert rc != 0 and "create-security-group" not in calls and "MY-BUCKET" in cluster  # no subnet Ray could use


def test_the_account_setup_stops_at_its_first_failing_command(tmp_path):
    for n, fail in enumerate(("head-bucket", "put-role-policy", "create-security-group")):
        rc, calls, cluster = setup_run(tmp_path / str(n), M2D_DEFAULT_VPC="vpc-0d", M2D_FAIL=fail)
        assert rc != 0 and calls.splitlines()[-1].split()[2] == fail, (fail, calls)  # nothing after it
        assert "sg-REPLACE_WITH_M2D_SG" in cluster, fail
    script = (ROOT / "aws" / "setup.sh").read_text()
    assert "\nset -euo pipefail\n" in script
    rc, calls, _ = setup_run(tmp_path / "old", script.replace("set -euo pipefail", ""), M2D_DEFAULT_VPC="vpc-0d",
                             M2D_FAIL="put-role-policy")  # fmt: skip
    assert "create-security-group" in calls  # without set -e it went on past the failure


def regions(calls: str) -> set[str]:
    return set(re.findall(r"--region (\S+)", calls))


def test_the_account_setup_works_in_cluster_yaml_s_region(tmp_path):
    """The region and zones are cluster.yaml's: the script as it was made the network in its REGION argument (default
    us-west-2) while the zones and provider.region stayed cluster.yaml's, so elsewhere it failed half-way. A REGION
    argument that is not cluster.yaml's, or a zone of another region, is refused before any AWS call."""
    text = CLUSTER_YAML.read_text()
    assert re.search(r"^  region: us-west-2$", text, flags=re.M)
    eu = text.replace("  region: us-west-2", "  region: eu-west-1").replace(
        "availability_zone: us-west-2a,us-west-2b,us-west-2c,us-west-2d", "availability_zone: eu-west-1a,eu-west-1b"
    )
    rc, calls, _ = setup_run(tmp_path / "eu", cluster=eu)
    assert rc == 0 and regions(calls) == {"eu-west-1"}, calls
    subnets = re.findall(r"create-subnet .*--availability-zone (\S+)", calls)
    assert subnets == ["eu-west-1a", "eu-west-1b"]
    rc, calls, _ = setup_run(tmp_path / "same", args=("eu-west-1",), cluster=eu, M2D_DEFAULT_VPC="vpc-0d")
    assert rc == 0 and regions(calls) == {"eu-west-1"}
    rc, calls, cluster = setup_run(tmp_path / "other", args=("us-east-1",), cluster=eu)
    assert rc != 0 and calls == "" and cluster == eu
    assert "cluster.yaml's provider.region is eu-west-1, not us-east-1" in (tmp_path / "other" / "stderr").read_text()
    mixed = eu.replace("eu-west-1b", "us-west-2b")
    rc, calls, _ = setup_run(tmp_path / "mixed", cluster=mixed)
    assert rc != 0 and calls == "" and "us-west-2b is not in" in (tmp_path / "mixed" / "stderr").read_text()


def test_a_re_run_completes_what_a_partial_run_left(tmp_path):
    """What a run stopped half-way leaves, a re-run repairs: instance profiles without their role get it (and the wait
    for new profiles), a security group without its rules gets them, the m2d-ray VPC without its gateway, route and
    some subnets gets what it lacks; what is complete is left as it is."""
    rc, calls, _ = setup_run(tmp_path / "profiles", M2D_PROFILES="empty", M2D_DEFAULT_VPC="vpc-0d")
    assert rc == 0 and calls.count("add-role-to-instance-profile") == 2 and "create-instance-profile" not in calls
    assert "create-role" not in calls
    rc, calls, _ = setup_run(tmp_path / "done", M2D_PROFILES="full", M2D_DEFAULT_VPC="vpc-0d")
    assert rc == 0 and "add-role-to-instance-profile" not in calls
    rc, calls, _ = setup_run(tmp_path / "sg", M2D_DEFAULT_VPC="vpc-0d", M2D_SG="sg-0old")
    assert rc == 0 and "create-security-group" not in calls
    assert "--group-id sg-0old --protocol tcp --port 22 --cidr 203.0.113.7/32" in calls
    assert "--group-id sg-0old --protocol -1 --source-group sg-0old" in calls
    rules = {"M2D_SSH": "198.51.100.1/32\t203.0.113.7/32", "M2D_OWN": "sg-0old"}
    rc, calls, _ = setup_run(tmp_path / "sg-done", M2D_DEFAULT_VPC="vpc-0d", M2D_SG="sg-0old", **rules)
    assert rc == 0 and "authorize-security-group-ingress" not in calls
    half = {"M2D_OUR_VPC": "vpc-0half", "M2D_SUBNETS": "us-west-2a us-west-2c"}
    rc, calls, _ = setup_run(tmp_path / "vpc", **half)
    assert rc == 0 and "create-vpc" not in calls
    assert "attach-internet-gateway --region us-west-2 --internet-gateway-id igw-0new --vpc-id vpc-0half" in calls
    assert "--route-table-id rtb-0main --destination-cidr-block 0.0.0.0/0 --gateway-id igw-0new" in calls
    made = re.findall(r"create-subnet .*--availability-zone (\S+) --cidr-block (\S+)", calls)
    assert made == [("us-west-2b", "10.42.16.0/20"), ("us-west-2d", "10.42.48.0/20")]  # each zone's own block
    assert calls.count("--map-public-ip-on-launch") == 4
    rc, calls, _ = setup_run(tmp_path / "vpc-done", **half, M2D_IGW="igw-0old", M2D_ROUTE="igw-0old\tlocal")
    assert rc == 0 and not re.search(r"create-(internet-gateway|route) ", calls)


def test_new_instance_profiles_get_a_minute_before_anything_launches():
    """EC2 refuses a new instance profile for a while after IAM has it, and Ray's launch retries 5 times at once:
    the script waits a minute after making one (it waited 15 s), and the tutorial says what to do if `ray up` is still
    refused."""
    waits = {int(w) for w in re.findall(r"M2D_PROFILE_WAIT:-(\d+)", (ROOT / "aws" / "setup.sh").read_text())}
    assert waits and min(waits) >= 60, waits
    tutorial = " ".join((ROOT / "docs" / "tutorials" / "cluster.md").read_text().split())
    assert "Invalid IAM Instance Profile name" in tutorial and "run `ray up cluster.yaml` again" in tutorial


def test_the_head_s_launch_policy_names_the_network_the_script_found(tmp_path):
    """aws/iam/head-launch.json narrows the head's launches to the cluster's VPC and security group (tests/unit/
    test_iam.py): the script puts it with the ids it found or made, after making them."""
    rc, calls, _ = setup_run(tmp_path, M2D_DEFAULT_VPC="vpc-0default")
    assert rc == 0
    (document,) = (tmp_path / "tmp").glob("*/head-launch.json")
    text = document.read_text()
    assert "vpc/vpc-0default" in text and "security-group/sg-0new" in text and "MY-" not in text
    lines = calls.splitlines()
    put = next(i for i, c in enumerate(lines) if "--policy-name launch-workers" in c)
    assert put > next(i for i, c in enumerate(lines) if "create-security-group" in c)


#: what each kind of resource aws/setup.sh creates is called in the tutorial's teardown table
TEARDOWN_NAMES = {
    "create-role": "roles",
    "create-instance-profile": "instance profiles",
    "create-service-linked-role": "spot service-linked role",
    "create-vpc": "the VPC `m2d-ray`",
    "create-internet-gateway": "internet gateway",
    "create-route": "route",
    "create-subnet": "subnets",
    "create-security-group": "security group `m2d-ray`",
}


def teardown_missing(script: str, page: str) -> list[str]:
    """The resources the script can create that the tutorial's "What stays" table does not name."""
    table = " ".join(page[page.index("| what stays |") :].split("\n\n")[0].split())
    made = sorted(set(re.findall(r"\baws (?:iam|ec2) (create-[a-z-]+)", script)))
    return [kind for kind in made if TEARDOWN_NAMES[kind] not in table]


def test_the_teardown_names_everything_the_script_can_make():
    page = (ROOT / "docs" / "tutorials" / "cluster.md").read_text()
    assert teardown_missing((ROOT / "aws" / "setup.sh").read_text(), page) == []
    old_row = (
        "| the roles and instance profiles `m2d-ray-head` and `m2d-ray-worker`, the security group `m2d-ray` | - |\n"
    )
    assert teardown_missing("aws ec2 create-vpc\naws ec2 create-subnet", "| what stays |\n" + old_row) == [
        "create-subnet",
        "create-vpc",
    ]


def shell_blocks() -> list[tuple[str, str]]:
    """(page, block) of every ```bash block of the docs, dedented (blocks inside list items are indented)."""
    import textwrap

    out = []
    for path in sorted((ROOT / "docs").rglob("*.md")):
        for block in re.findall(r"^( *)```bash\n(.*?)^\1```", path.read_text(), flags=re.S | re.M):
            out.append((str(path.relative_to(ROOT)), textwrap.dedent(block[1])))
    return out


def gnu_sed_i(text: str) -> list[str]:
    """`sed -i` without a suffix joined to it: GNU sed's form, which macOS's sed reads as `-i SUFFIX` and fails."""
    return re.findall(r"\bsed\s+(?:-\w+\s+)*-i(?=\s|$)[^\n]*", text)


def test_every_shell_block_of_the_docs_parses_and_runs_on_macos_sed():
    blocks = shell_blocks()
    assert len(blocks) >= 20 and any("aws/setup.sh" in b for _, b in blocks)
    for page, block in blocks:
        out = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert out.returncode == 0, (page, out.stderr, block[:300])
        assert gnu_sed_i(block) == [], page
    for script in (ROOT / "aws" / "setup.sh", JOBS):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
        assert gnu_sed_i(script.read_text()) == [], script
    old = 'sed -i "s/sg-REPLACE_WITH_M2D_SG/$SG/" cluster.yaml'  # the tutorial's line before
    assert gnu_sed_i(old) == [old] and gnu_sed_i("sed -i.bak 's/a/b/' f && rm f.bak") == []
    assert subprocess.run(["bash", "-n"], input="for x in a; do\n", capture_output=True, text=True).returncode != 0


def test_the_base_image_s_tag_is_checked_before_the_build_and_every_node_has_disk_for_the_image():
    """The how-to's build line inspects the Dockerfile's base tag before `docker build` (an hour's build on a missing
    tag fails at its first line), and says the fallback; every EKS node group's disk holds the ~20 GB image, the head's
    included (EKS's default is 20Gi)."""
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE.read_text(), flags=re.M)
    how_to = (ROOT / "docs" / "how-to" / "kubernetes.md").read_text()
    (build,) = [b for _, b in shell_blocks() if "docker build" in b]
    assert build.index(f"docker manifest inspect {base} >/dev/null &&") < build.index("docker build")
    assert "--build-arg BASE_IMAGE=" in how_to and "no such manifest" in how_to
    disk = " ".join(how_to[how_to.index("- **Disk on every node group") :].split("\n- **")[0].split())
    assert "head's node group (`m5.2xlarge`) a root disk of 100Gi" in disk and "GPU machines 600Gi" in disk
