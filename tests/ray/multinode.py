"""A two-node Ray cluster on one machine, and `m2d run` on it (driven by tests/ray/test_multinode.py).

Run as `unshare -pf --mount-proc python tests/ray/multinode.py WORK`: in a private PID namespace, so every
Ray process ends with it. The head node has no CPUs (the driver's node: nothing runs there); the worker
node is started in its own mount namespace with an empty tmpfs over WORK/hidden, where the runs' driver
directories and the driver's copy of a teacher live, so any worker that reads or writes the driver's
disk fails. An S3 endpoint is served on 127.0.0.1 by moto. Node caches: M2D_CACHE under WORK/hidden
(the worker's is its own tmpfs).

Every text file of the runs (calibration, evaluation, distillation) lies under WORK/hidden/data, where only
the head sees it: the workers get it through the run's storage.

Scenarios (results in WORK/results.json; the run directories stay for the test to read):
  blind   m2d run with --storage under WORK/hidden, which the worker node does not see: each stage-1 trial fails
          with one line naming the node and the storage (each node checks the storage's mark itself)
  shared  m2d run with --storage on a directory both nodes see, with the d2d baseline; then a resume of the finished
  run, and one
          with another stage-3 suite
  (both distil from cached teacher targets, stage2.targets=hidden: made once in the storage, for each teacher;
  the students read the teacher's output head alone, from S3 by ranged reads in the second run)
  s3      m2d run with --storage s3://… and the teacher on the driver's disk (copied to storage once), its distillation
          corpus a Parquet shard under an S3 prefix (read there, never copied; one row: the same stream as train.txt);
          the driver is SIGKILLed after the first distilled student and the run resumed
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from m2d_ray.shipped import EXPERIMENTS
from workshop.local_group import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = EXPERIMENTS / "smoke.yaml"
SMALL = [  # overrides of m2d_ray/experiments/smoke.yaml
    "grid.scoring=[sf,do-acp]",
    "stage3.limit=8",
    "ray.data_actors=1",
    "stage2.targets=hidden",
]
BUCKET = "m2d-test"


def sh(cmd: list[str], env: dict, log: Path, timeout: float = 300) -> None:
    with log.open("a") as f:
        subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=timeout)


def start_cluster(work: Path, env: dict) -> str:
    port = free_port()
    common = ["--node-ip-address=127.0.0.1", "--object-store-memory=300000000", "--disable-usage-stats"]
    sh(
        ["ray", "start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false", *common],
        env,
        work / "head.log",
    )
    hidden = work / "hidden"
    worker = (
        f"mount -t tmpfs tmpfs {hidden} && exec ray start --address=127.0.0.1:{port} --num-cpus=4 {' '.join(common)}"
    )
    sh(["unshare", "-m", "sh", "-c", worker], env, work / "worker.log")
    return f"127.0.0.1:{port}"


def serve_s3(port: int, log, env: dict | None = None) -> subprocess.Popen:
    """A moto S3 server on 127.0.0.1:`port` holding an empty bucket BUCKET, once it answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    import boto3

    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
    for attempt in range(100):  # until the server answers
        try:
            s3.create_bucket(Bucket=BUCKET)
            break
        except Exception:
            if attempt == 99:
                raise
            time.sleep(0.2)
    return proc


def start_s3(work: Path, env: dict) -> str:
    port = free_port()
    serve_s3(port, (work / "moto.log").open("w"), env)
    return f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"


def m2d(args: list[str], env: dict, name: str, work: Path, timeout: float = 900) -> dict:
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "m2d_ray.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    (work / f"{name}.stderr").write_text(r.stderr)
    return {"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "wall_s": round(time.time() - t0, 1)}


def killed_then_resumed(args: list[str], env: dict, run_dir: Path, work: Path) -> dict:
    """Start `m2d run`, SIGKILL it once a first student is in the stage-2 ledger, then resume it."""
    log = (work / "s3-killed.stderr").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2d_ray.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )
    ledger = run_dir / "stage2" / "trials"
    deadline = time.time() + 900
    while proc.poll() is None and time.time() < deadline and not (ledger.exists() and any(ledger.glob("*.json"))):
        time.sleep(0.2)
    killed_at = sorted(p.stem for p in ledger.glob("*.json")) if ledger.exists() else []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = m2d(["run", "--resume", str(run_dir)], env, "s3-resumed", work)
    return {**resumed, "killed_after": killed_at, "first_rc": proc.returncode}


def head_only_data(hidden: Path) -> list[str]:
    """The embedded corpus' splits as the user's own text files, where only the head sees them."""
    from m2d_ray.data.synthetic import corpus_text

    data = hidden / "data"
    data.mkdir()
    for split in ("train", "valid", "test"):
        (data / f"{split}.txt").write_text(corpus_text(split))
    return [
        f"calib.data={data / 'valid.txt'}",
        f"eval.data={data / 'test.txt'}",
        f"distill.train_data={data / 'train.txt'}",
        f"distill.eval_data={data / 'valid.txt'}",
    ]


def s3_corpus(hidden: Path, query: str) -> str:
    """The train split as a Parquet shard under s3://BUCKET/corpus/ (column `content`); returns its spec."""
    import boto3
    import pyarrow as pa
    import pyarrow.parquet as pq

    from m2d_ray.data.synthetic import corpus_text

    local = hidden / "part-00000.parquet"
    pq.write_table(pa.table({"content": [corpus_text("train")]}), local)
    port = query.split(":")[1].split("&")[0]
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1").upload_file(
        str(local), BUCKET, "corpus/part-00000.parquet"
    )
    return f"s3://{BUCKET}/corpus/?{query}#column=content"


def main(work: Path, only: list[str] | None = None) -> None:
    work = work.resolve()
    hidden, shared = work / "hidden", work / "shared"
    for d in (hidden, shared):
        d.mkdir(parents=True, exist_ok=True)
    texts = head_only_data(hidden)
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    )  # moto's
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "M2D_CACHE": str(hidden / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    results: dict = {}
    try:
        query = start_s3(work, env)
        env["RAY_ADDRESS"] = start_cluster(work, env)
        # storage where only the head sees it: the worker node finds no mark there the first time it works for the run
        results["blind"] = m2d(
            [
                "run",
                str(TINY),
                "--out",
                str(hidden / "blind-run"),
                "--storage",
                str(hidden / "blind-storage"),
                *SMALL,
                *texts,
            ],
            env,
            "blind",
            work,
        )
        if only:
            return
        shared_run = hidden / "shared-run"
        results["shared"] = m2d(
            [
                "run",
                str(TINY),
                "--out",
                str(shared_run),
                "--storage",
                str(shared / "run"),
                *SMALL,
                *texts,
                "stage2.baselines=[d2d]",
            ],
            env,
            "shared",
            work,
        )

        def stamps():
            return {p.name: p.stat().st_mtime_ns for p in (shared_run / "stage3" / "results").glob("*.json")}

        before = stamps()
        results["shared_resume"] = {
            **m2d(["run", "--resume", str(shared_run)], env, "shared-resume", work),
            "redone": before != stamps(),
        }
        results["shared_other_suite"] = m2d(
            ["run", "--resume", str(shared_run), "stage3.limit=6"], env, "shared-other-suite", work
        )
        teacher = hidden / "teacher"
        from m2d_ray.models import default_teacher

        shutil.copytree(default_teacher(), teacher)
        corpus = s3_corpus(hidden, query)
        args = [
            "run",
            str(TINY),
            "--out",
            str(hidden / "s3-run"),
            "--storage",
            f"s3://{BUCKET}/run?{query}",
            f"model={teacher}",
            *SMALL,
            *texts,
            f"distill.train_data={corpus}",
        ]
        results["s3"] = killed_then_resumed(args, env, hidden / "s3-run", work)
        results["s3"]["storage"] = f"s3://{BUCKET}/run?{query}"
        import boto3

        port = query.split(":")[1].split("&")[0]
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
        keys = [
            o["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])
        ]
        results["s3"]["objects"] = keys
    finally:
        (work / "results.json").write_text(json.dumps(results))
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])  # `blind`: that run only
