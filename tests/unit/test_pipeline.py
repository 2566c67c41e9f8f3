"""The pipeline's ordered registry of stages drives the plan, the checks, the run and the report: a stage defined and
registered only here (one class, one line) shows in each of them, with nothing else in the platform naming it."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT
from small_run import finished_run

from m2d_ray import pipeline
from m2d_ray.config import load_config
from m2d_ray.errors import M2DError
from m2d_ray.models import default_teacher, model_config
from m2d_ray.plan.devices import NodeType
from m2d_ray.plan.run_plan import Devices, plan_line, unit
from m2d_ray.report.page import render
from m2d_ray.shipped import EXPERIMENTS
from m2d_ray.stages.contract import Section, Stage

TINY = EXPERIMENTS / "tiny.yaml"


class Probe(Stage):
    """A stage of the tests only: it asks for a resource of its own and leaves a file."""

    name = "probe"
    keys = "the probe's keys"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def check_config(self, cfg) -> None:
        self.calls.append("check_config")
        if cfg.name == "no-probe":
            raise M2DError("probe: this config has no probe")

    def check(self, cfg, teacher: str) -> None:
        self.calls.append(f"check {teacher}")

    def check_resume(self, rd, cfg) -> None:
        self.calls.append("check_resume")

    def request(self, cfg) -> dict:
        return {"CPU": 1.0, "probe_device": 1.0}

    def needs(self, p):
        return [
            unit(
                self.name,
                "probe",
                {"probe buffer": 3 << 20},
                0,
                1,
                self.request(p.cfg),
                p.devices,
                "a smaller probe",
                self.keys,
            )
        ]

    def storage(self, p):
        return {"probe files": 5 << 20}, {}

    def cost(self, c):
        return [c.stage(self.name, [2e9], c.place(self.name, 0, 1, 1, None), "actor")]

    def run(self, ctx):
        (ctx.rd.path / "probe.txt").write_text("probed")
        return {"probed": True}

    def sections(self, data):
        return [Section("The probe", render([f"<p>probe of {len(data.stage1)} configs</p>"]))]


@pytest.fixture
def probe():
    return Probe()


def test_the_plan_adds_a_registered_stage_s_rows_storage_and_bill(probe):
    cfg = load_config(TINY, ["plan.cpu_flops=1e9"])
    stages = pipeline.STAGES.with_stage(probe, after="stage2")
    assert stages.names() == ["calibrate", "stage1", "targets", "stage2", "probe", "stage3", "analysis", "report"]
    plan = pipeline.plan(
        cfg, model_config(default_teacher()), Devices(host_memory=8 << 30, cpu_load=0.0), stages=stages
    )
    names = [s.name for s in plan.stages]
    last_stage2 = max(i for i, n in enumerate(names) if n.split(":")[0] == "stage2")  # a row per teacher
    assert names.index("probe") == last_stage2 + 1 and plan.storage["probe files"] == 5 << 20
    assert [c.name for c in plan.cost.stages][:4] == ["calibrate", "stage1", "stage2", "probe"]
    line = json.loads(plan_line(plan))
    assert line["stages"]["probe"]["per_gpu_bytes"] == 3 << 20 and line["stages"]["probe"]["flops"] == 2e9
    assert "probe" not in [
        s.name for s in pipeline.plan(cfg, model_config(default_teacher()), Devices(host_memory=8 << 30)).stages
    ]
    # its request is checked against the node types like every stage's, and named with its own keys
    cpu_only = (NodeType("cpu_8x", {"CPU": 8.0}),)
    problems = pipeline.plan(cfg, model_config(default_teacher()), Devices(nodes=cpu_only), stages=stages).problems()
    assert any(
        p.startswith("probe: no node type can ever hold one probe") and "the probe's keys" in p for p in problems
    ), problems


def test_the_checks_ask_a_registered_stage(probe, monkeypatch):
    stages = pipeline.STAGES.with_stage(probe, after="stage1")
    monkeypatch.setattr(pipeline, "STAGES", stages)  # config checks are every stage's, whichever a command runs
    cfg = load_config(TINY)
    pipeline.check(cfg, stages)
    assert probe.calls == ["check_config", f"check {default_teacher()}"]
    with pytest.raises(M2DError, match="probe: this config has no probe"):
        pipeline.check_config(load_config(TINY, ["name=no-probe"]))


def test_a_registered_stage_runs_in_order_is_timed_and_reports(probe, tmp_path):
    """On a finished run's directory (the stored small run, no Ray needed): the probe and the report run on one
    context; run.json times the probe, the report shows its section after the stages before it."""
    from m2d_ray.run_dir import RunDir
    from m2d_ray.runtime.context import RunContext

    run_dir, _ = finished_run(tmp_path / "run")
    rd = RunDir(run_dir)
    stages = pipeline.STAGES.with_stage(probe, after="stage3")
    ctx = RunContext(load_config(rd.config), rd, None, tuple(stages))
    results = pipeline.run(ctx, stages.only("probe", "report"))
    assert list(results) == ["probe", "report"] and results["probe"] == {"probed": True}
    assert (run_dir / "probe.txt").read_text() == "probed"
    assert json.loads(rd.timings.read_text())["stages"]["probe"]["runs"] == 1
    page = (run_dir / "report" / "index.html").read_text()
    assert "<h2>The probe</h2><p>probe of" in page
    assert (
        page.index("Stage 1: pre-distillation") < page.index("Matched parameters") < page.index("The probe")
    )  # after stage 3's
    pipeline.check_resume(rd, ctx.cfg, stages)
    assert "check_resume" in probe.calls


def test_the_plan_imports_no_ray():
    """`m2d plan` reads every stage without Ray: the stages import it inside `run` only."""
    import subprocess

    code = (
        "import sys; from m2d_ray import pipeline; from m2d_ray.commands import plan; "
        "print(sorted(m for m in ('ray', 'ray.tune', 'ray.train', 'lm_eval') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_unknown_stage_name_gets_the_closest():
    with pytest.raises(M2DError, match="did you mean 'stage2'"):
        pipeline.STAGES["stage 2"]


# ---- one run context, baselines as descriptors, a student's settings as one object --------------------
STAGES_DIR = ROOT / "m2d_ray" / "stages"


def test_no_stage_builds_what_the_run_context_owns():
    """The run's storage, MLflow's tracker and Ray are built once, by the run context (runtime/context.py): no stage
    module makes its own (each used to open the run directory, the tracker, Ray and the storage by hand)."""
    owned = ("RunStorage(", "run_tracker(", "Tracker(", "ensure_ray(")
    makers = {"context.py", "run_storage.py", "ray_env.py"}  # the context, and what it calls
    found = [
        f"{p.relative_to(ROOT)}: {o}"
        for p in STAGES_DIR.rglob("*.py")
        if p.name not in makers
        for o in owned
        if o in p.read_text()
    ]
    assert found == []


def test_only_its_own_module_names_the_d2d_baseline():
    """d2d declares what it brings (its teacher, its search, its targets pass, its bill, its table) where it is defined;
    elsewhere the code asks the baselines' registry (stages/baselines/__init__.py lists it, once)."""
    import ast

    here = []
    for p in (ROOT / "m2d_ray").rglob("*.py"):
        if p.parent.name == "baselines":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Constant) and node.value == "d2d") or (
                isinstance(node, ast.Name) and node.id == "D2D"
            ):
                here.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert here == []


def test_a_student_s_settings_reach_distill_as_one_job(tmp_path):
    """Stage 2 builds each student's DistillJob on the driver (what it trains on, with what, where it goes); its Tune
    trial only fits it. A baseline with its own teacher gets that teacher, its token shards and its settings."""
    from types import SimpleNamespace

    from m2d_ray.distill.loop import DistillJob
    from m2d_ray.plan.targets import TeacherTargets
    from m2d_ray.runtime.run_storage import RunStorage
    from m2d_ray.stages import stage2
    from m2d_ray.stages.baselines import BASELINES
    from m2d_ray.stages.students import Reads, Student

    cfg = load_config(TINY, ["distill.teacher_topk=4", "ray.max_failures=2", "stage2.targets=auto"])
    dense = BASELINES["d2d"].teacher(cfg)
    # each teacher's targets as the plan chose them: the MoE teacher's cached, the dense one online and sharded
    chosen = {"teacher": TeacherTargets("hidden"), "teacher-d2d": TeacherTargets("online", shard=True)}
    ctx = SimpleNamespace(cfg=cfg, store=RunStorage(str(tmp_path)), choice=chosen.__getitem__)
    data = Reads(
        "moe-url",
        "valid-url",
        cfg.distill,
        {dense: "dense-url"},
        {"moe-url": "tok-moe", "dense-url": "tok-dense"},
        {"moe-url": "tg-moe"},
    )
    stop, prepared = object(), object()
    d2d = stage2._job(ctx, data, {}, {"d2d": prepared}, Student("baseline-d2d", "d2d", None, "d2d"), stop)
    assert isinstance(d2d, DistillJob) and (d2d.teacher, d2d.tokens, d2d.targets, d2d.target_spec) == (
        "dense-url",
        "tok-dense",
        None,
        None,
    )
    assert d2d.shard_teacher
    assert d2d.cfg.teacher_topk is None and d2d.build is prepared and d2d.stop is stop and d2d.max_failures == 2
    assert (d2d.checkpoints, d2d.run_name) == ctx.store.checkpoints("baseline-d2d") and d2d.out == ctx.store.student(
        "baseline-d2d"
    )
    ffn = stage2._job(ctx, data, {}, {}, Student("baseline-random-ffn", "random-ffn", None, "random-ffn"), stop)
    assert (ffn.teacher, ffn.cfg.teacher_topk, ffn.tokens, ffn.eval_data) == ("moe-url", 4, "tok-moe", "valid-url")
    assert (ffn.targets, str(ffn.target_spec), ffn.shard_teacher) == ("tg-moe", "hidden", False)
    assert ffn.build.baseline == "random-ffn" and ffn.build.teacher == "moe-url"
