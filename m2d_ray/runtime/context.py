"""One run's context, built once by the command (`RunContext.create` / `resume`) and handed to every stage: the
config, the run directory (the driver's records), the storage workers read and write, the teacher, MLflow's
tracker and the run's parent run, Ray, and each stage's resource waiter. No stage builds any of these itself.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property

from m2d_ray.artifacts import write_json_atomic, write_marker
from m2d_ray.catalog.distill import AUTO
from m2d_ray.config import SweepConfig, dump_config
from m2d_ray.errors import M2DError
from m2d_ray.models import absolute, default_teacher, load_tokenizer
from m2d_ray.plan.targets import TeacherTargets, configured, recorded
from m2d_ray.run_dir import Ledger, RunDir
from m2d_ray.runtime.demand import Waiting
from m2d_ray.runtime.ray_env import ensure_ray
from m2d_ray.runtime.record import StageRecorder
from m2d_ray.runtime.run_storage import RunStorage
from m2d_ray.track import run_tracker


@dataclass
class RunContext:
    """What every stage of one run shares (see the module docstring); `stages`: the pipeline's, in order."""

    cfg: SweepConfig
    rd: RunDir
    tracking_uri: str | None = None
    stages: tuple = ()
    targets: dict = field(default_factory=dict)  # stage-2 teacher key -> TeacherTargets: the plan's (m2d run's)
    _ray: bool = field(default=False, init=False, repr=False)

    @classmethod
    def create(
        cls,
        cfg: SweepConfig,
        rd: RunDir,
        tracking_uri: str | None = None,
        stages: tuple = (),
        targets: dict | None = None,
    ) -> RunContext:
        """A new run in `rd` (checked and refused before, by the command): its marker, config and id (sweep.json)."""
        rd.path.mkdir(parents=True, exist_ok=True)
        write_marker(rd.path, "run")
        dump_config(cfg, rd.config)
        write_json_atomic(
            rd.state, {"sweep_id": uuid.uuid4().hex, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "attempts": 0}
        )
        return cls(cfg, rd, tracking_uri, stages, targets or {})

    def choice(self, key: str) -> TeacherTargets:
        """How stage-2 teacher `key` gives its students their targets: as the run's plan chose it (given by the
        command, else recorded in memory_plan.json), else as the config says (an explicit stage2.targets)."""
        if key in self.targets:
            return self.targets[key]
        if self.cfg.stage2.targets != AUTO:
            return configured(self.cfg, [key])[key]
        planned = recorded(self.rd.read_memory_plan())
        if key not in planned:
            raise M2DError(
                f"stage2.targets=auto: no plan of {self.rd} chose the targets of {key}; m2d run plans it before any "
                "work"
            )
        return planned[key]

    @cached_property
    def store(self) -> RunStorage:
        """The run's storage: `storage:` / --storage, else the run directory."""
        return RunStorage(self.cfg.storage or str(self.rd.path))

    @cached_property
    def teacher(self) -> str:
        """The MoE teacher as the driver names it (a directory made absolute, a hub name or a storage URL)."""

        return absolute(self.cfg.model or default_teacher())

    @cached_property
    def workers_teacher(self) -> str:
        """The teacher as workers reach it (copied into the storage once when Ray is a cluster)."""
        self.ray()
        return self.store.put_model(self.teacher)

    @cached_property
    def tokenizer(self):

        return load_tokenizer(self.teacher)

    @cached_property
    def tracker(self):

        return run_tracker(self.cfg, self.rd, self.tracking_uri)

    def parent(self, params: dict | None = None, tags: dict | None = None) -> str:
        """The run's MLflow parent run (made by the first stage that logs, with `params` and `tags`; found by the run's
        id)."""
        return self.tracker.parent_run(self.rd.sweep_id(), self.cfg.name, params or {}, tags or {})

    def recorder(self, ledger: Ledger, fields, prefix: str = "") -> StageRecorder:
        """A stage's recorder (ledger, then its nested MLflow runs), with what a kill left half-logged logged now."""
        out = StageRecorder(ledger, self.tracker, self.parent(), fields, prefix)
        out.reconcile()
        return out

    def ray(self) -> None:
        """Ray, connected or started once; the storage's mark put where every node looks for it."""
        if not self._ray:
            ensure_ray(self.cfg.ray)
            self.store.mark()
            self._ray = True

    def waiting(self, stage) -> Waiting:
        """The resource waiter of `stage` (its request and keys): `with ctx.waiting(stage) as w:` around every Ray
        request the stage makes, so that a request no node type can hold fails the stage with one line."""
        return Waiting.of(stage, self.cfg)
