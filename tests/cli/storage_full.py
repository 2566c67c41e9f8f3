"""`m2d run` on a disk that fills while it runs (driven by tests/cli/test_storage_full.py).

Run as `unshare -pfm --mount-proc python tests/cli/storage_full.py WORK`: in private PID and mount namespaces, with a
32 MiB tmpfs over WORK/small (gone with the namespace). One Ray for the three runs, started here:

    filled    a small run on WORK/small; once its stage 2 begins, a file takes all but 256 KiB of the tmpfs: the run
              stops with one line and exit 3
    resumed   the filler removed, `m2d run --resume` of it
    whole     the same run on WORK (a disk with room), uninterrupted, beside the other two: the resumed run's
              students must equal its

Results in WORK/results.json (each command's exit code, stderr and wall time).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from m2d_ray.shipped import EXPERIMENTS

ROOT = Path(__file__).resolve().parents[2]
TINY = EXPERIMENTS / "smoke.yaml"
#: one recipe, a few steps: one student, stage 1 skipped by naming the recipe
SMALL = [  # overrides of m2d_ray/experiments/smoke.yaml: its one recipe named, so stage 1 is skipped
    "stage2.recipes=[sf/rr/K2/uniform]",
    "stage3.limit=4",
    "stage3.teacher=false",
    "stage3.analysis.enabled=false",
    "ray.data_actors=1",
]
SIZE_MIB = 32  # room for the plan's peak and the records (22 MiB), so the check before work lets it start


def m2d(args: list[str], env: dict, name: str, work: Path) -> dict:
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "m2d_ray.cli", *args], env=env, capture_output=True, text=True)
    (work / f"{name}.stderr").write_text(r.stderr)
    return {"rc": r.returncode, "stderr": r.stderr, "wall_s": round(time.time() - t0, 1)}


def fill_when(started: Path, small: Path, stop: threading.Event) -> None:
    """Once `started` exists, a file takes all but 256 KiB of the filesystem under `small`."""
    while not stop.is_set() and not started.exists():
        time.sleep(0.05)
    if stop.is_set():
        return
    free = shutil.disk_usage(small).free - (256 << 10)
    with open(small / "filler", "wb") as f:
        f.write(b"\0" * max(0, free))


def main(work: Path) -> None:
    small = work / "small"
    small.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE_MIB}m", "tmpfs", str(small)], check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RAY_AUTH_MODE": "disabled",
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    }
    subprocess.run(
        ["ray", "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
         "--node-ip-address=127.0.0.1", "--disable-usage-stats"],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    results = {}
    run = small / "run"
    stop = threading.Event()
    filler = threading.Thread(target=fill_when, args=(run / "stage2", small, stop), daemon=True)
    filler.start()
    whole = {}  # the reference run goes on beside the other two (one Ray, 4 logical CPUs): most of a small run waits
    side = threading.Thread(
        target=lambda: whole.update(m2d(["run", str(TINY), "--out", str(work / "whole"), *SMALL], env, "whole", work))
    )
    side.start()
    results["filled"] = m2d(["run", str(TINY), "--out", str(run), *SMALL], env, "filled", work)
    stop.set()
    (small / "filler").unlink(missing_ok=True)
    results["resumed"] = m2d(["run", "--resume", str(run)], env, "resumed", work)
    side.join()
    results["whole"] = whole
    shutil.copytree(run, work / "resumed_run")  # the tmpfs goes with the namespace
    (work / "results.json").write_text(json.dumps(results))  # this namespace's Ray ends with it (--kill-child)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
