"""`m2d run` on Ray's own autoscaler (driven by tests/ray/test_autoscale.py).

Run as `unshare -pfn --mount-proc python tests/ray/autoscale.py WORK`: a private PID namespace (every Ray
process ends with it, and `ray stop --force` reaches no process outside it) and a private network
namespace with only the loopback up (every Ray address is 127.0.0.1, port 6379 is ours).

The cluster is Ray's fake multi-node autoscaler (`ray/autoscaler/_private/fake_multi_node/`, what
`ray.cluster_utils.AutoscalingCluster` drives; its base `example.yaml` is not in the wheel, so the config
is built here): the autoscaler's normal logic launches and terminates worker nodes — raylets on this
machine — from `available_node_types`, which are derived from cluster.yaml (`node_types`). The provider
is a subclass (fake_spot.py) that stops listing a node whose raylet died, as a cloud does with a
reclaimed instance. The run asks for CPUs only and every derived type has CPUs, so any type can serve
it; the autoscaler picks one by its own scoring (gpu_a10g_1x in the runs so far) and the test
checks only that what it launched is one of cluster.yaml's types. The head has no CPUs, so every task,
actor and trial of a run needs a launched node; it is started in its own mount namespace with an empty
tmpfs over WORK/hidden (the run directories and the user's text files), and the nodes the autoscaler
launches inherit it: only the driver (`m2d run`, outside) sees the user's text (the launched nodes share
that one tmpfs, and with it their M2D_CACHE, unlike machines of a real cluster).

Runs (results in WORK/results.json; the run directories, the autoscaler's log and each run's
timestamped console stay for the test to read):
  plain   m2d run, storage on WORK/shared (every node sees it); then the nodes are left to go idle
  lost    the same run with a worker node SIGKILLed (its raylet and every process under it, as a spot
          reclaim does) once in each stage: during calibration while a Ray Data actor runs on it, during
          stage 1 and stage 2 while a trial does, during stage 3 while an evaluation task does
  failed  the same run with ray.max_failures=0, one student at a time, and a node lost during stage 2:
          that student fails, the other is distilled, the run goes on
  unservable  the same run with the d2d baseline, asking a GPU per distillation rank (distill.gpus_per_worker=1),
          which no node type has (their GPUs are FAKE_GPU) and which the driver cannot check before the run (the
          fake provider's node types are not in the GCS): stage 2's first request (the d2d search's task) is
          reported infeasible by the autoscaler, which fails stage 2, exit 2
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from multinode import SMALL, TINY, head_only_data, sh

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CLUSTER_YAML = ROOT / "cluster.yaml"
FAKE_HEAD = "ray.head.default"  # the fake provider tags its head with this type name (FAKE_HEAD_NODE_TYPE)
FAKE_GPU = (
    "fake_GPU"  # what a node type's GPUs become on this CPU machine: a custom resource, so no CPU run asks for it
)
IDLE_MINUTES = 0.25  # the autoscaler compares idle seconds with 60 * idle_timeout_minutes: fractions work
MAX_WORKERS = 2  # nodes at once on a 2-core machine (cluster.yaml's per-type bounds are kept below it)
OBJECT_STORE = 300_000_000  # per node
# the tests' tiny run, with one retry of a trial (spot nodes) and students long enough (~17 ms a step here) that a
# node can be lost between a student's first checkpoint and its end
# node can be lost between a student's first checkpoint and its end; stage 1 evaluates two chunks (a probe round
# of one chunk, then the rest), so that its trials run long enough to lose a node under them
RUN = [
    *SMALL,
    "ray.max_failures=1",
    "distill.steps=160",
    "distill.eval_every=40",
    "eval.max_chars=24000",
    "eval.chunks=2",
]


def node_types(cluster_yaml: Path = CLUSTER_YAML) -> tuple[dict, dict]:
    """(head resources, worker node types) for the fake autoscaler, from cluster.yaml's `available_node_types`:
    the same names, CPU counts and custom resources (accelerator_type:…, spot …); GPUs become the custom
    resource FAKE_GPU. The head keeps its custom resources but gets no CPUs, so that the run's work
    (which asks for CPUs only) starts nodes."""
    cfg = yaml.safe_load(cluster_yaml.read_text())
    types = cfg["available_node_types"]
    head_type = cfg["head_node_type"]

    def mapped(res: dict) -> dict:
        out = {k: v for k, v in res.items() if k != "GPU"}
        if res.get("GPU"):
            out[FAKE_GPU] = res["GPU"]
        return out

    head = {**mapped(types[head_type]["resources"]), "CPU": 0}
    workers = {
        name: {
            "resources": {**mapped(t["resources"]), "object_store_memory": OBJECT_STORE},
            "node_config": {},
            "min_workers": t.get("min_workers", 0),
            "max_workers": min(t.get("max_workers", MAX_WORKERS), MAX_WORKERS),
        }
        for name, t in types.items()
        if name != head_type
    }
    return head, workers


def autoscaler_config(workers: dict, head: dict) -> dict:
    """A cluster config for the fake multi-node provider (what its missing example.yaml would hold)."""
    return {
        "cluster_name": "m2d-fake",
        "max_workers": MAX_WORKERS,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_MINUTES,
        # Ray's fake multi-node provider (`type: fake_multinode`), through a subclass whose reclaimed nodes disappear
        "provider": {
            "type": "external",
            "module": "fake_spot.SpotFakeProvider",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": "127.0.0.1:6379",
        },
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {**workers, FAKE_HEAD: {"resources": head, "node_config": {}, "max_workers": 0}},
        "head_node_type": FAKE_HEAD,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def start_cluster(work: Path, env: dict, temp: str) -> str:
    """The head (0 CPUs, its custom resources) with the autoscaler, in a mount namespace that hides WORK/hidden."""
    head, workers = node_types()
    config = work / "autoscaler.json"
    config.write_text(json.dumps(autoscaler_config(workers, head), indent=1))
    custom = {k: v for k, v in head.items() if k != "CPU"}
    start = [
        "ray",
        "start",
        "--head",
        "--port=6379",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=0",
        f"--resources={json.dumps(custom)}",
        f"--object-store-memory={OBJECT_STORE}",
        f"--autoscaling-config={config}",
        f"--temp-dir={temp}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    cmd = f"mount -t tmpfs tmpfs {work / 'hidden'} && exec " + " ".join(f"'{a}'" for a in start)
    path = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)  # the autoscaler imports fake_spot
    sh(
        ["unshare", "-m", "sh", "-c", cmd],
        {**env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "PYTHONPATH": path},
        work / "head.log",
    )
    return "127.0.0.1:6379"


# ---- what the autoscaler recorded -----------------------------------------------------------------
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")
_ADD = re.compile(r"Adding (\d+) node\(s\) of type (\S+?)\.")
_REMOVE = re.compile(r"Removing (\d+) nodes of type (\S+?) \((.+?)\)\.")
_RECLAIMED = re.compile(r"SpotFakeProvider: reclaimed node \S+ of type (\S+)")


def autoscaler_events(temp: str) -> list[dict]:
    """Launches and removals from the autoscaler's monitor.log (its event lines), with their times."""
    out = []
    log = Path(temp) / "session_latest" / "logs" / "monitor.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        m = _STAMP.match(line)
        if not m:
            continue
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        if a := _ADD.search(line):
            out.append({"t": t, "event": "launch", "n": int(a.group(1)), "type": a.group(2)})
        elif r := _REMOVE.search(line):
            out.append({"t": t, "event": "remove", "n": int(r.group(1)), "type": r.group(2), "why": r.group(3)})
        elif g := _RECLAIMED.search(
            line
        ):  # gone from the provider's list: the autoscaler records no removal of its own
            out.append({"t": t, "event": "remove", "n": 1, "type": g.group(1), "why": "reclaimed"})
    return out


# ---- processes of this namespace ------------------------------------------------------------------
def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process of this PID namespace."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out[int(d.name)] = (ppid, cmd)
    return out


def worker_raylets(procs: dict) -> list[int]:
    """Raylets of the launched nodes (the head's is the one started with --head's GCS beside it: the oldest)."""
    raylets = sorted(p for p, (_, cmd) in procs.items() if "/raylet " in cmd or cmd.endswith("/raylet"))
    return raylets[1:]


def raylet_of(pid: int, procs: dict) -> int | None:
    raylets = set(worker_raylets(procs))
    while pid in procs and pid not in raylets:
        pid = procs[pid][0]
    return pid if pid in raylets else None


def reclaim(raylet: int, procs: dict) -> list[int]:
    """SIGKILL a node as a spot reclaim does: its raylet and every process under it."""
    doomed = [raylet]
    for pid in list(procs):
        if pid != raylet and raylet_of(pid, procs) == raylet:
            doomed.append(pid)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return doomed


def work_on_a_node(procs: dict, title: str = "ray::ImplicitFunc") -> int | None:
    """A process of the run's work on a launched node, by its Ray process title: a Tune trial (a function
    trainable's actor: starting, or in its train call), a calibration actor, a stage-3 task."""
    return next((p for p, (_, cmd) in sorted(procs.items()) if cmd.startswith(title) and raylet_of(p, procs)), None)


def seen(lines: list, text: str) -> bool:
    return any(line.startswith(text) for _, line in lines)


def in_calibration(lines: list, storage: Path) -> bool:
    """The calibration pass runs (its Ray Data actors: the victim)."""
    return seen(lines, "== calibrate ==") and not seen(lines, "statistics: ")


in_calibration.victim = "ray::MapWorker"


def in_stage3(lines: list, storage: Path) -> bool:
    """Stage 3's evaluation tasks run."""
    return seen(lines, "== stage3 ==") and not seen(lines, "== report ==")


in_stage3.victim = "ray::_evaluate_task"


def in_stage1(lines: list, storage: Path) -> bool:
    """Stage 1's trials are running (calibration is done)."""
    return (
        seen(lines, "== stage1 ==")
        and seen(lines, "stage 1: ")
        and not seen(lines, "== targets ==")
        and not seen(lines, "== stage2 ==")
    )


def in_stage2(lines: list, storage: Path) -> bool:
    """Stage 2's trials run and a student has a checkpoint that Ray Train has registered (in its run's snapshot in
    the storage, what a retry restores from; a checkpoint directory alone is not yet one)."""
    return (
        seen(lines, "== stage2 ==")
        and not seen(lines, "== stage3 ==")
        and any(_registered(p) for p in (storage / "stage2" / "train").glob("*/checkpoint_manager_snapshot.json"))
    )


def _registered(snapshot: Path) -> bool:
    try:
        return bool(json.loads(snapshot.read_text()).get("checkpoint_results"))
    except (OSError, ValueError):  # being written
        return False


def watched(
    args: list[str], env: dict, work: Path, name: str, storage: Path, kills: tuple = (), timeout: float = 1200
) -> dict:
    """`m2d run` with its console lines timestamped; for each of `kills` (a stage's predicate, in order) a node
    running a trial is reclaimed once the predicate holds."""
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2d_ray.cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list = []
    out: list = []

    def read_err() -> None:
        for line in proc.stderr:
            lines.append((time.time(), line.rstrip("\n")))
            print(f"[{name} {time.time() - t0:6.1f}s] {line.rstrip()}", flush=True)  # progress

    threads = [
        threading.Thread(target=read_err, daemon=True),
        threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True),
    ]
    for t in threads:
        t.start()
    pending, done = list(kills), []
    while proc.poll() is None:
        if time.time() - t0 > timeout:
            proc.kill()
            break
        for when in [
            w for w in pending if w(lines, storage)
        ]:  # each stage's kill on its own (a missed one does not hold up the next)
            procs = processes()
            trial = work_on_a_node(procs, getattr(when, "victim", "ray::ImplicitFunc"))
            if trial:
                raylet = raylet_of(trial, procs)
                doomed = reclaim(raylet, procs)
                pending.remove(when)
                done.append(
                    {
                        "t": time.time(),
                        "when": when.__name__,
                        "raylet": raylet,
                        "trial_process": procs[trial][1],
                        "killed": len(doomed),
                    }
                )
                print(
                    f"[{name}] reclaimed the node of raylet {raylet} ({len(doomed)} processes) {done[-1]['when']}",
                    flush=True,
                )
        time.sleep(0.1)
    proc.wait()
    for t in threads:
        t.join(timeout=10)
    (work / f"{name}.stderr").write_text("".join(f"{t:.3f} {line}\n" for t, line in lines))
    return {
        "rc": proc.returncode,
        "stdout": "".join(out),
        "lines": lines,
        "t0": t0,
        "t1": time.time(),
        "wall_s": round(time.time() - t0, 1),
        "kills": done,
        "missed_kills": [p.__name__ for p in pending],
    }


def workers_up(events: list[dict], until: float) -> int:
    return sum(e["n"] if e["event"] == "launch" else -e["n"] for e in events if e["t"] <= until)


def wait_idle(temp: str, timeout: float) -> float | None:
    """Seconds until the autoscaler has removed every node it launched (None: not within `timeout`)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        events = autoscaler_events(temp)
        if workers_up(events, time.time() + 1) == 0:
            return round(time.time() - t0, 1)
        time.sleep(1)
    return None


def phases(lines: list, t0: float, t1: float) -> dict[str, tuple[float, float]]:
    """Each stage's time window from the run's console (stage 2's from its targets pass on, when it has one)."""

    def start(*texts: str) -> float | None:
        return next((t for t, line in lines if line.startswith(texts)), None)

    marks = [
        ("calibration", start("== calibrate ==")),
        ("stage1", start("== stage1 ==")),
        ("stage2", start("== targets ==", "== stage2 ==")),
        ("stage3", start("== stage3 ==")),
        ("report", start("== report ==")),
        ("end", t1),
    ]
    return {name: (a, b) for (name, a), (_, b) in zip(marks, marks[1:]) if a and b}


def by_phase(events: list[dict], windows: dict) -> dict:
    """Per stage: worker nodes up when it began, and the launches and removals the autoscaler recorded in it."""
    out = {}
    for name, (a, b) in windows.items():
        inside = [e for e in events if a <= e["t"] < b]
        out[name] = {
            "up_at_start": workers_up(events, a),
            "launched": [e["type"] for e in inside if e["event"] == "launch" for _ in range(e["n"])],
            "removed": [f"{e['type']} ({e['why']})" for e in inside if e["event"] == "remove" for _ in range(e["n"])],
            "wall_s": round(b - a, 1),
        }
    return out


def main(work: Path, only: list[str]) -> None:
    work = work.resolve()
    hidden, shared = work / "hidden", work / "shared"
    for d in (hidden, shared):
        d.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    texts = head_only_data(hidden)
    temp = tempfile.mkdtemp(prefix="m2d-as-")  # short: Ray's socket paths live under it
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "M2D_CACHE": str(hidden / "cache"),
        "PYTHONUNBUFFERED": "1",
        "TORCH_EXTENSIONS_DIR": str(work / "torch_extensions"),
    }
    env.pop("RAY_ADDRESS", None)
    results: dict = {"idle_timeout_minutes": IDLE_MINUTES}
    try:
        env["RAY_ADDRESS"] = start_cluster(work, env, temp)
        runs = {
            "plain": ((), RUN),
            "lost": ((in_calibration, in_stage1, in_stage2, in_stage3), RUN),
            "failed": ((in_stage2,), [*RUN, "ray.max_failures=0", "stage2.max_concurrent_trials=1"]),
            "unservable": ((), [*RUN, "distill.gpus_per_worker=1", "stage2.baselines=[d2d]"]),
        }
        for name, (kills, overrides) in runs.items():
            if only and name not in only:
                continue
            store = shared / name
            r = watched(
                ["run", str(TINY), "--out", str(hidden / name), "--storage", str(store), *overrides, *texts],
                env,
                work,
                name,
                store,
                kills,
            )
            # after the plain run only: a Train controller lost with its node leaves its resource request with Ray
            # Train's autoscaling coordinator, which keeps capacity asked for until it expires (180 s) — not waited for
            # here
            r["scale_down_s"] = wait_idle(temp, IDLE_MINUTES * 60 + 90) if name == "plain" else None
            events = autoscaler_events(temp)
            r["events"] = [e for e in events if r["t0"] <= e["t"]]
            r["phases"] = by_phase(events, phases(r["lines"], r["t0"], r["t1"]))
            r["up_before"] = workers_up(events, r["t0"])
            results[name] = r
            print(
                f"[{name}] rc {r['rc']}, {r['wall_s']} s, kills {r['kills']}, nodes gone {r['scale_down_s']} s after; "
                f"{json.dumps(r['phases'])}",
                flush=True,
            )
            (work / "results.json").write_text(json.dumps(results))
    finally:
        (work / "results.json").write_text(json.dumps(results))
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
        log = Path(temp) / "session_latest" / "logs" / "monitor.log"
        if log.exists():
            shutil.copy(log, work / "monitor.log")
        shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])  # optionally: the names of the runs to make
