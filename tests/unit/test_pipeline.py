"""The pipeline's ordered registry of stages drives the plan, the checks, the run and the report: a stage defined and
registered only here (one class, one line) shows in each of them, with nothing else in the platform naming it."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ROOT
from m2d_ray import pipeline
from m2d_ray.config import load_config
from m2d_ray.errors import M2DError
from m2d_ray.models import default_teacher
from m2d_ray.models import load_config as model_config
from m2d_ray.plan.devices import NodeType
from m2d_ray.plan.run_plan import Devices, plan_line, unit
from m2d_ray.report.page import render
from m2d_ray.stages.contract import Section, Stage
from small_run import finished_run

TINY = ROOT / "experiments" / "tiny.yaml"


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
        return [unit(self.name, "probe", {"probe buffer": 3 << 20}, 0, 1, self.request(p.cfg), p.devices, "a smaller probe", self.keys)]

    def storage(self, p):
        return {"probe files": 5 << 20}, {}

    def cost(self, c):
        return [c.stage(self.name, [2e9], c.place(self.name, 0, 1, 1, None), 1.0)]

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
    assert stages.names() == ["calibrate", "stage1", "targets", "stage2", "probe", "stage3", "report"]
    plan = pipeline.plan(cfg, model_config(default_teacher()), Devices(host_memory=8 << 30, cpu_load=0.0), stages=stages)
    names = [s.name for s in plan.stages]
    assert names.index("probe") == names.index("stage2") + 1 and plan.storage["probe files"] == 5 << 20
    assert [c.name for c in plan.cost.stages][:4] == ["calibrate", "stage1", "stage2", "probe"]
    line = json.loads(plan_line(plan))
    assert line["stages"]["probe"]["per_gpu_bytes"] == 3 << 20 and line["stages"]["probe"]["flops"] == 2e9
    assert "probe" not in [s.name for s in pipeline.plan(cfg, model_config(default_teacher()), Devices(host_memory=8 << 30)).stages]
    # its request is checked against the node types like every stage's, and named with its own keys
    cpu_only = (NodeType("cpu_8x", {"CPU": 8.0}),)
    problems = pipeline.plan(cfg, model_config(default_teacher()), Devices(nodes=cpu_only), stages=stages).problems()
    assert any(p.startswith("probe: no node type can ever hold one probe") and "the probe's keys" in p for p in problems), problems


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
    from m2d_ray.stages.context import RunContext
    from m2d_ray.run_dir import RunDir

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
    assert page.index("Stage 1: pre-distillation") < page.index("Matched parameters") < page.index("The probe")  # after stage 3's
    pipeline.check_resume(rd, ctx.cfg, stages)
    assert "check_resume" in probe.calls


def test_the_plan_imports_no_ray():
    """`m2d plan` reads every stage without Ray: the stages import it inside `run` only."""
    import subprocess

    code = ("import sys; from m2d_ray import pipeline; from m2d_ray.commands import plan; "
            "print(sorted(m for m in ('ray', 'ray.tune', 'ray.train', 'lm_eval') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_unknown_stage_name_gets_the_closest():
    with pytest.raises(M2DError, match="did you mean 'stage2'"):
        pipeline.STAGES["stage 2"]
