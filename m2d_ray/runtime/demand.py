"""While a stage waits for resources: what Ray's autoscaler itself says about them.

`m2d run` checks every stage's request against the node types before any work (`Stage.needs`), but the
driver cannot always read them (Ray's fake provider, KubeRay, a head without ~/ray_bootstrap_config.yaml).
The autoscaler always knows: it reports a demand no node type can ever hold as an event ("No available node
types can fulfill resource request {...}", the driver's "(autoscaler …)" lines), and what it is launching in
its status in the GCS (what `ray status` prints). `Waiting` (`RunContext.waiting(stage)`), around every Ray
request a stage makes (tasks, actors, Ray Data passes, Tune and Train):

    an infeasible demand of the stage's   the stage fails with one line (the request, the node types the
                                          autoscaler runs, the config keys to change): `Unservable`, an
                                          M2DError, so the command exits 2 and no later stage runs
    a demand still pending                a progress line about every minute ("waiting for 8 × {GPU: 1}:
                                          autoscaler launching 1 gpu_h100_8x"), where an autoscaler runs

A demand is the stage's when it asks only for resources the stage asks for (another job's demand on a shared
cluster is not this run's). Both reports are internal to Ray (pinned ray==2.60.0); where either cannot be
read, the stage waits as before.
"""

from __future__ import annotations

import ast
import json
import re
import threading
import time
from collections import Counter

import ray
from ray import tune
from ray._private.worker import filter_autoscaler_events

from m2d_ray.console import note, say
from m2d_ray.errors import M2DError
from m2d_ray.runtime.ray_env import on_cluster

# Imported inside functions: what may be missing (optional packages, Ray's internal API), where its absence is handled.

_INFEASIBLE = re.compile(r"No available node types can fulfill resource requests? (.*?)(?:\. Add suitable|$)")
_BUNDLE = re.compile(r"\{[^{}]*\}")
_TYPE = re.compile(r"Adding \d+ node\(s\) of type (\S+?)\.")
ALWAYS = {"memory", "object_store_memory"}  # what Ray may add to any request
_ACTIVE: dict[str, Waiting] = {}  # stage -> its Waiting while it waits (TuneCheck looks it up)


class Unservable(M2DError):
    """A stage's request that the autoscaler reports no node type can ever hold."""


def infeasible_requests(message: str) -> list[dict]:
    """The resource requests an autoscaler event reports infeasible (v1: one; v2: `{...}*n, {...}*m`)."""
    m = _INFEASIBLE.search(message)
    if not m:
        return []
    out = []
    for text in _BUNDLE.findall(m.group(1)):
        try:
            out.append({str(k): float(v) for k, v in ast.literal_eval(text).items()})
        except (ValueError, SyntaxError, AttributeError):
            continue
    return out


def is_ours(request: dict, wanted: dict) -> bool:
    """Whether `request` asks only for resources the stage asks for (`wanted`, e.g. {"CPU": 1, "GPU": 1})."""
    asked = {k for k, v in request.items() if v}
    return bool(asked) and asked <= {k for k, v in wanted.items() if v} | ALWAYS


def fmt(bundle: dict) -> str:
    """A resource bundle in one fixed order (CPU, GPU, then the rest by name): the autoscaler's dicts come in any
    order."""
    return "{" + ", ".join(f"{k}: {bundle[k]:g}" for k in sorted(bundle) if bundle[k]) + "}"


def demands(status: dict) -> list[tuple[dict, int]]:
    """(bundle, count) of every task, actor and placement-group bundle waiting in an autoscaler v1 status."""
    lm = status.get("load_metrics_report") or {}
    out = [(dict(b), int(n)) for b, n in lm.get("resource_demand") or []]
    for pg, n in lm.get("pg_demand") or []:
        out += [(dict(b), int(c) * int(n)) for b, c in pg.get("bundles", [])]
    return out


def launching(status: dict) -> Counter:
    """Nodes the autoscaler is launching, by type."""
    ar = status.get("autoscaler_report") or {}
    return Counter(ar.get("pending_launches") or {}) + Counter(node[1] for node in ar.get("pending_nodes") or [])


def waiting_line(stage: str, status: dict, wanted: dict) -> str | None:
    """The progress line of a stage whose demands wait (None: nothing of the stage's waits)."""
    mine = [(b, n) for b, n in demands(status) if is_ours(b, wanted)]
    if not mine:
        return None
    up = launching(status)
    how = (
        ("autoscaler launching " + ", ".join(f"{n} {t}" for t, n in sorted(up.items())))
        if up
        else "no node launching yet"
    )
    return f"{stage}: waiting for " + ", ".join(f"{n} × {fmt(b)}" for b, n in mine) + f": {how}"


def node_types_seen(status: dict, launched: set[str]) -> list[str]:
    """The node types the autoscaler runs or has launched (all the driver can know without its config)."""
    ar = status.get("autoscaler_report") or {}
    return sorted(
        set(ar.get("active_nodes") or {}) | set(ar.get("idle_nodes") or {}) | set(launching(status)) | launched
    )


def read_status() -> dict | None:
    """The autoscaler's status (v1's JSON in the GCS; v2's cluster status in the same shape), None without one."""
    try:
        from ray._private import ray_constants
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        if raw:
            return json.loads(raw)
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        if not is_autoscaler_v2():
            return None
        import ray
        from ray.autoscaler.v2.sdk import get_cluster_status

        s = get_cluster_status(ray.get_runtime_context().gcs_address)
        d = s.resource_demands
        return {
            "load_metrics_report": {
                "resource_demand": [(r.bundle, r.count) for x in d.ray_task_actor_demand for r in x.bundles_by_count],
                "pg_demand": [
                    ({"bundles": [(r.bundle, r.count) for r in x.bundles_by_count]}, 1)
                    for x in d.placement_group_demand
                ],
            },
            "autoscaler_report": {
                "pending_launches": dict(Counter({lr.ray_node_type_name: lr.count for lr in s.pending_launches})),
                "pending_nodes": [(n.ip_address, n.ray_node_type_name, "pending") for n in s.pending_nodes],
                "active_nodes": dict(Counter(n.ray_node_type_name for n in s.active_nodes)),
            },
        }
    except Exception:
        return None


class Waiting:
    """Around every Ray request of a stage (`with ctx.waiting(stage) as w:`): `w.get(ref)`, `w.call(fn, ...)` and
    `w.check()` in the stage's own loops fail the stage once the autoscaler reports one of its requests infeasible.
    Progress lines only where an autoscaler runs: on a local Ray a stage's units simply queue for its CPUs."""

    def __init__(self, stage: str, wanted: dict, keys: str, every: float = 60.0, poll: float = 5.0) -> None:
        self.stage, self.wanted, self.keys, self.every, self.poll = stage, wanted, keys, every, poll
        self.failure: str | None = None
        self.launched: set[str] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"m2d-waiting-{stage}", daemon=True)
        self._status: dict = {}

    @classmethod
    def of(cls, stage, cfg) -> Waiting:
        """The waiter of a pipeline stage: the request its units make and the config keys that set it."""
        return cls(stage.name, stage.request(cfg), stage.keys)

    def __enter__(self) -> Waiting:
        try:
            from ray._private.worker import global_worker_stdstream_dispatcher

            global_worker_stdstream_dispatcher.add_handler(self._thread.name, self.on_logs)
        except Exception:  # no driver log stream: the status alone (progress lines, no infeasible events)
            pass
        self._thread.start()
        _ACTIVE[self.stage] = self
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.pop(self.stage, None)
        self._done.set()
        self._thread.join(timeout=10)
        try:
            from ray._private.worker import global_worker_stdstream_dispatcher

            global_worker_stdstream_dispatcher.remove_handler(self._thread.name)
        except Exception:
            pass

    def on_logs(self, data: dict) -> None:
        """The driver's log stream: the autoscaler's events (its monitor's, published by Ray's log monitor)."""
        if data.get("pid") != "autoscaler":
            return

        for message in filter_autoscaler_events(data.get("lines", [])):
            self.event(message)

    def event(self, message: str) -> None:
        if m := _TYPE.search(message):
            self.launched.add(m.group(1))
        for request in infeasible_requests(message):
            if self.failure is None and is_ours(request, self.wanted):
                note(f"autoscaler: {message}")  # its own words, in the log
                types = node_types_seen(
                    self._status or read_status() or {}, self.launched
                )  # (a report before the first poll)
                self.failure = (
                    f"{self.stage}: the autoscaler reports that no node type can hold {fmt(request)} "
                    f"(node types it runs or launched: {', '.join(types) or 'none'}); change {self.keys}, "
                    "or add a node type that has it to the cluster"
                )

    def check(self) -> None:
        """Fail the stage (raise Unservable) once the autoscaler has reported one of its demands infeasible."""
        if self.failure:
            raise Unservable(self.failure)

    def get(self, ref):
        """`ray.get(ref)`, checked every `poll` seconds while it waits."""

        while not ray.wait([ref], timeout=self.poll)[0]:
            self.check()
        return ray.get(ref)

    def call(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` (a Ray Data pass, a blocking Ray call) in a thread, checked every `poll` seconds: a
        stage whose request cannot be served fails here, while the call is left to end with the command's Ray."""
        out: dict = {}

        def target() -> None:
            try:
                out["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # re-raised in the stage's own thread
                out["error"] = exc

        thread = threading.Thread(target=target, name=f"m2d-{self.stage}-call", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(self.poll)
            self.check()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def _watch(self) -> None:
        last, autoscaled = time.monotonic(), on_cluster()
        while not self._done.wait(self.poll):
            self._status = read_status() or {}
            line = waiting_line(self.stage, self._status, self.wanted) if autoscaled else None
            if line is None:
                last = time.monotonic()
            elif time.monotonic() - last >= self.every:
                say(line)
                last = time.monotonic()


class TuneCheck(tune.Callback):
    """Fails the stage from Tune's own loop (the driver's main thread) once its `Waiting` has a failure. Tune
    pickles its callbacks with the experiment, so this one holds the stage's name, not the `Waiting`."""

    def __init__(self, stage: str) -> None:
        self.stage = stage

    def on_step_begin(self, iteration, trials, **info):
        waiting = _ACTIVE.get(self.stage)
        if waiting is not None:
            waiting.check()


def tune_check(stage: str) -> TuneCheck:
    """Tune's callback that fails the stage from Tune's own loop (the stage's `Waiting` must be active)."""
    return TuneCheck(stage)
