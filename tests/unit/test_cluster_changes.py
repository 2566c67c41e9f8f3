"""A run and a cluster that changes under it, without a cluster: the storage check each node makes for
itself (RunStorage.ensure_visible), the autoscaler's reports a waiting stage reads (runtime/demand.py), and
failures told in the user's words (ray_env.failure). The same on Ray's fake autoscaler: tests/ray/."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from m2d_ray.config import load_config
from m2d_ray.errors import M2DError
from m2d_ray.pipeline import STAGES
from m2d_ray.runtime import demand, ray_env, run_storage
from m2d_ray.runtime.run_storage import RunStorage
from m2d_ray.shipped import EXPERIMENTS

# what Ray 2.60's v1 autoscaler wrote on the fake cluster with a {CPU: 1, GPU: 1} task and a 2-bundle placement group
# waiting (tests/ray's machinery, recorded by hand): its event and its status in the GCS
V1_EVENT = (
    "Error: No available node types can fulfill resource request {'GPU': 1.0, 'CPU': 1.0}. "
    "Add suitable node types to this cluster to resolve this issue."
)
V1_STATUS = {
    "load_metrics_report": {
        "resource_demand": [[{"GPU": 1.0, "CPU": 1.0}, 1]],
        "pg_demand": [[{"bundles": [[{"GPU": 1.0, "CPU": 1.0}, 2]], "strategy": "PACK"}, 1]],
    },
    "autoscaler_report": {
        "active_nodes": {"ray.head.default": 1, "gpu_a10g_1x": 1},
        "pending_nodes": [],
        "pending_launches": {},
        "failed_nodes": [],
    },
}


# ---- the storage check: each node, once, when it first works for the run --------------------------------
@pytest.fixture
def node(monkeypatch, tmp_path):
    """A fake Ray node id/address for ensure_visible, and a private node cache."""
    here = SimpleNamespace(id="a" * 56, ip="10.0.0.7")
    monkeypatch.setattr(run_storage.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: here.id))
    monkeypatch.setattr(run_storage, "_node_address", lambda: here.ip)
    monkeypatch.setattr(run_storage, "_node_cache", lambda: tmp_path / "seen")
    return here


def test_a_node_that_does_not_see_the_storage_fails_with_one_line_naming_it(node, tmp_path):
    store = RunStorage(str(tmp_path / "storage"))
    with pytest.raises(M2DError) as e:  # the driver's mark is not there: this node's view is another disk
        store.ensure_visible()
    line = str(e.value)
    assert "\n" not in line and line.startswith(
        f"node 10.0.0.7 cannot see the run's storage {tmp_path / 'storage'} (Ray node {'a' * 12})"
    )
    source = """    raise M2DError(f"node {address} cannot see the run's storage {self.root} (Ray node {node[:12]});
    give --storage a path \""""
    assert (
        ray_env.failure(f"Traceback ...\n{source}\nm2d_ray.errors.M2DError: {line}\n", "stage 1", 0, 0) == line
    )  # recorded as is


def test_each_node_checks_once_and_a_node_joining_later_is_checked_too(node, tmp_path):
    store = RunStorage(str(tmp_path / "storage"))
    store.mark()
    store.ensure_visible()
    (tmp_path / "storage" / run_storage.MARK).unlink()
    store.ensure_visible()  # cached on this node: no second look
    node.id, node.ip = "b" * 56, "10.0.0.8"  # a node the autoscaler adds later, without the shared path
    with pytest.raises(M2DError, match="node 10.0.0.8 cannot see the run.s storage"):
        store.ensure_visible()
    store.mark()
    store.mark()  # idempotent: a resumed run's mark stays
    store.ensure_visible()


def test_remote_storage_needs_no_mark(node):
    RunStorage(
        "s3://bucket/run"
    ).ensure_visible()  # every node reaches a URL alike; its credentials are checked by check()


# ---- what the autoscaler says while a stage waits ---------------------------------------------------------
def test_infeasible_events_of_both_autoscalers_are_read():
    assert demand.infeasible_requests(V1_EVENT) == [{"GPU": 1.0, "CPU": 1.0}]
    v2 = (
        "No available node types can fulfill resource requests {'CPU': 1.0, 'GPU': 1.0}*2, {'CPU': 4.0}*1. "
        "Add suitable node types to this cluster to resolve this issue."
    )
    assert demand.infeasible_requests(v2) == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 4.0}]
    assert demand.infeasible_requests("Adding 1 node(s) of type gpu_a10g_1x.") == []


def test_only_the_stage_s_own_demand_is_its_own():
    stage2 = {"CPU": 1.0, "GPU": 1.0}
    assert demand.is_ours({"GPU": 1.0, "CPU": 1.0}, stage2) and demand.is_ours({"CPU": 0.5}, stage2)
    assert not demand.is_ours({"TPU": 4.0}, stage2)  # another job's, on a shared cluster
    assert not demand.is_ours(
        {"GPU": 1.0, "CPU": 1.0}, {"CPU": 1.0, "GPU": 0.0}
    )  # a CPU stage is not failed by a GPU request


def test_an_infeasible_demand_fails_the_stage_with_one_line(monkeypatch):
    monkeypatch.setattr(demand, "read_status", lambda: V1_STATUS)
    w = demand.Waiting.of(STAGES["stage2"], load_config(EXPERIMENTS / "tiny.yaml", ["distill.gpus_per_worker=1"]))
    w._status = V1_STATUS
    w.event("Adding 1 node(s) of type cpu_8x.")
    w.check()  # nothing infeasible yet
    w.event(V1_EVENT)
    with pytest.raises(demand.Unservable) as e:
        w.check()
    line = str(e.value)
    assert isinstance(e.value, M2DError) and "\n" not in line  # exit 2: no later stage runs
    assert line.startswith("stage2: the autoscaler reports that no node type can hold {CPU: 1, GPU: 1}")
    assert "cpu_8x, gpu_a10g_1x, ray.head.default" in line and "distill.gpus_per_worker" in line
    cpu = demand.Waiting.of(STAGES["stage1"], load_config(EXPERIMENTS / "tiny.yaml"))
    cpu.event(V1_EVENT)
    cpu.check()  # not the CPU stage's request


def test_a_pending_demand_prints_a_progress_line_about_every_minute(monkeypatch):
    status = {
        **V1_STATUS,
        "autoscaler_report": {**V1_STATUS["autoscaler_report"], "pending_launches": {"gpu_h100_8x": 1}},
    }
    assert (
        demand.waiting_line("stage2", status, {"CPU": 1.0, "GPU": 1.0})
        == "stage2: waiting for 1 × {CPU: 1, GPU: 1}, 2 × {CPU: 1, GPU: 1}: autoscaler launching 1 gpu_h100_8x"
    )
    assert demand.waiting_line("stage1", status, {"CPU": 1.0, "GPU": 0.0}) is None
    assert (
        demand.fmt({"GPU": 1.0, "CPU": 2.0, "memory": 0.0})
        == demand.fmt({"CPU": 2.0, "GPU": 1.0})
        == "{CPU: 2, GPU: 1}"
    )  # any order in
    lines = []
    monkeypatch.setattr(demand, "read_status", lambda: status)
    monkeypatch.setattr(demand, "say", lines.append)
    import time

    monkeypatch.setattr(demand, "on_cluster", lambda: True)
    with demand.Waiting("stage2", {"CPU": 1.0, "GPU": 1.0}, "distill.gpus_per_worker", every=0.2, poll=0.05):
        time.sleep(0.7)
    assert 2 <= len(lines) <= 4 and all(x.startswith("stage2: waiting for") for x in lines), lines
    # a local Ray has no autoscaler to launch anything: its units queue for its CPUs, and nothing is said of launching
    monkeypatch.setattr(demand, "on_cluster", lambda: False)
    lines.clear()
    with demand.Waiting("stage3", {"CPU": 1.0}, "stage3.cpus_per_task", every=0.2, poll=0.05):
        time.sleep(0.5)
    assert lines == []


def test_a_blocking_call_under_the_waiter_fails_its_stage_when_its_request_is_infeasible():
    """Every Ray request of a stage goes through its waiter (a task's ray.get, a Ray Data pass): one the autoscaler
    reports infeasible fails the stage instead of blocking for ever; the call's own result and errors pass through."""
    import threading

    w = demand.Waiting("stage2", {"CPU": 1.0, "GPU": 1.0}, "distill.gpus_per_worker", poll=0.05)
    assert w.call(lambda x: x + 1, 1) == 2
    with pytest.raises(ValueError, match="bad"):
        w.call(lambda: (_ for _ in ()).throw(ValueError("bad")))
    never = threading.Event()
    threading.Timer(0.3, lambda: w.event(V1_EVENT)).start()
    with pytest.raises(demand.Unservable, match="stage2: the autoscaler reports"):
        w.call(never.wait)  # what a bare ray.get of an unservable task did: wait for ever


# ---- failures in the user's words ----------------------------------------------------------------------
ACTOR_DIED = """Traceback (most recent call last):
ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
\tclass_name: ImplicitFunc
\tactor_id: 0123
\tpid: 4242
\tip: 127.0.0.3
The actor died because its node has died. Node Id: 5f1e2d3c4b5a69788796a5b4c3d2e1f0
\tthe actor's node was terminated unexpectedly: health check failed"""
TASK_NODE_DIED = (
    "ray.exceptions.NodeDiedError: Task failed because the node it was running on is dead or unavailable. Node IP: "
    "127.0.0.4, "
    "node ID: abc. This can happen if the node was preempted, had a hardware failure, or its raylet crashed "
    "unexpectedly."
)


def test_a_lost_node_reads_in_the_user_s_words_and_ray_s_error_goes_to_the_log(monkeypatch):
    logged = []
    monkeypatch.setattr(ray_env.console, "note", logged.append)
    monkeypatch.setattr(ray_env.console, "log_path", lambda: "/runs/x/logs/m2d-run.log")
    line = ray_env.failure(ACTOR_DIED, "stage 2", 1, 1)
    assert (
        line == "node 127.0.0.3 lost during stage 2 (spot reclaim or crash); retried 1 of 1 times (Ray's error: "
        "/runs/x/logs/m2d-run.log)"
    )
    assert "ActorDiedError" in logged[0] and "Node Id: 5f1e" in logged[0]
    assert ray_env.failure(TASK_NODE_DIED, "stage 3", 2, 2).startswith(
        "node 127.0.0.4 lost during stage 3 (spot reclaim or crash); retried 2 of 2"
    )
    unavailable = (
        "ray.exceptions.ActorUnavailableError: The actor 0123 is unavailable: RPC Error message: Socket closed."
    )
    assert ray_env.failure(unavailable, "stage 2", 0, 0).startswith("node (address not reported) lost during stage 2")
    assert (
        ray_env.failure("Traceback\nValueError: K=3 is not in [2, 16]\n", "stage 1", 0, 1)
        == "ValueError: K=3 is not in [2, 16]"
    )


def test_trial_error_counts_the_retries_tune_made():
    trial = SimpleNamespace(error_file=None, get_error=lambda: ACTOR_DIED, num_failures=2, last_result={})
    assert "retried 1 of 1 times" in ray_env.trial_error(trial, "stage 1", 1)
    # an unavailable actor's error names no node: the node of the trial's last result does (what the fake cluster
    # showed)
    unavailable = (
        "Failure # 1 (occurred at 2026-11-25_02-16-57)\nThe actor bcc40b3b is unavailable: The actor is temporarily "
        "unavailable: "
        "RpcError: RPC error: recvmsg:Connection reset by peer rpc_code: 14. The task may or may not have been "
        "executed on the actor."
    )
    trial = SimpleNamespace(
        error_file=None, get_error=lambda: unavailable, num_failures=1, last_result={"node_ip": "127.0.0.5", "step": 40}
    )
    assert ray_env.trial_error(trial, "stage 2", 0).startswith(
        "node 127.0.0.5 lost during stage 2 (spot reclaim or crash); retried 0 of 0 times"
    )


def test_the_tune_check_pickles_with_the_experiment_and_fails_the_stage():
    """Tune pickles its callbacks with the experiment: the check holds the stage's name, not the waiting thread."""
    import pickle

    w = demand.Waiting("stage2", {"CPU": 1.0, "GPU": 1.0}, "distill.gpus_per_worker", poll=60)
    check = pickle.loads(pickle.dumps(demand.tune_check(w.stage)))
    check.on_step_begin(0, [])  # not waiting: nothing to check
    with w:
        w.event(V1_EVENT)
        with pytest.raises(demand.Unservable):
            check.on_step_begin(1, [])
    check.on_step_begin(2, [])
