"""stage2.targets=auto and the sharded teacher in the plan (plan/targets.py, pipeline.choose_targets): a sharded rank's
memory, the gathers and the reads in a student's time, storage priced and limited, and the choice per teacher (the 30B
grid at its budget, the paper's extended experiment), from configs alone."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import ROOT

from m2d_ray.config import load_config
from m2d_ray.models import model_config
from m2d_ray.pipeline import plan as make_plan
from m2d_ray.plan.devices import cluster_settings, from_cluster_yaml
from m2d_ray.plan.flops import stage2_flops, student_tokens
from m2d_ray.plan.run_plan import Devices, plan_line
from m2d_ray.plan.shapes import models_of, shape_of
from m2d_ray.plan.targets import TB_MONTH, gather_seconds
from m2d_ray.shipped import EXPERIMENTS

CONFIGS = EXPERIMENTS / "configs"
GiB = 1 << 30
GPU80 = Devices(gpu_memory=80 * 10**9)


@pytest.fixture(scope="module")
def qwen30b():
    return model_config(str(CONFIGS / "Qwen--Qwen3-30B-A3B"))


@pytest.fixture(scope="module")
def cluster():
    head, idle = cluster_settings(ROOT / "cluster.yaml")
    return Devices(None, None, tuple(from_cluster_yaml(ROOT / "cluster.yaml")), None, head, idle)


def _cfg(name: str = "qwen3_30b_a3b.yaml", *more: str):
    """An experiment's config at full checkpointing: the targets' arithmetic compared at one setting of it (under
    checkpointing auto each candidate would keep what its own memory leaves; tests/unit/test_plan.py holds that)."""
    return load_config(EXPERIMENTS / name, ["distill.checkpointing=full", *more])


def _one_student(*more: str):
    """The 30B grid's budget with one student (one pair, no baselines, no ASHA): its time is one unit's."""
    return _cfg("qwen3_30b_a3b.yaml", "stage2.pairs=[do-acp/rr]", "stage2.baselines=[]", "stage2.asha=false", *more)


def test_a_sharded_rank_holds_its_share_of_the_teacher_and_one_gathered_layer(qwen30b):
    t = models_of(qwen30b).teacher
    ranks = {}
    for w in (4, 8):
        plan = make_plan(_cfg("qwen3_30b_a3b.yaml", "stage2.targets=online", "stage2.shard_teacher=true",
                              f"distill.workers={w}"), qwen30b, GPU80)  # fmt: skip
        parts = plan.by_stage()["stage2"].parts
        head, layer = t.vocab * t.hidden * 2, t.layer_params * 2
        assert parts["teacher shard"] == (t.params * 2 - head) // w and parts["teacher head"] == head
        assert parts["gathered layer"] == layer and parts["gather buffers"] == layer + layer // w
        assert "teacher" not in parts and plan.problems() == []
        ranks[w] = plan.by_stage()["stage2"].per_device
    at_zero2 = _cfg("qwen3_30b_a3b.yaml", "stage2.targets=online", "distill.zero_stage=2")  # as the sharded ranks
    whole = make_plan(at_zero2, qwen30b, GPU80).by_stage()["stage2"]
    assert whole.fits is False and whole.per_device - ranks[8] > 0.8 * t.params * 2  # 56.9 GiB -> 7.0 GiB + a layer
    assert ranks[4] > ranks[8]


def test_a_sharded_student_takes_its_gathers_on_top_of_the_online_compute(qwen30b, cluster):
    """Same FLOPs as online; the time adds (N - 1)/N of the teacher per micro-batch at NVLink (the 8 ranks share a
    node of cluster.yaml) or at the network bandwidth (no node types known)."""
    t = models_of(qwen30b).teacher
    online = make_plan(_one_student("stage2.targets=online"), qwen30b, cluster).cost.by_name()["stage2"]
    for devices, one_node in ((cluster, True), (GPU80, False)):
        cfg = _one_student("stage2.targets=online", "stage2.shard_teacher=true")
        sharded = make_plan(cfg, qwen30b, devices).cost.by_name()["stage2"]
        assert sharded.flops == online.flops
        gathers = gather_seconds(cfg, t, cfg.distill.steps, one_node)
        per_forward = t.params * 2 * 7 / 8
        assert gathers == pytest.approx(cfg.distill.steps * 12 * per_forward / (3e11 if one_node else 2.5e10))
        if one_node:
            assert sharded.seconds - online.seconds == pytest.approx(gathers)


def test_reading_cached_states_bounds_a_student_s_time(qwen30b, cluster):
    """hidden: a student reads tokens x 2d bytes; from a slow store its time is the reads' (I/O-bound, said)."""
    cfg = _one_student("storage=s3://bucket/run", "plan.read_bandwidth.object=1e6", "stage2.targets=hidden")
    plan = make_plan(cfg, qwen30b, cluster)
    s2 = plan.cost.by_name()["stage2"]
    reads = student_tokens(cfg) * 2048 * 2 / 1e6
    assert s2.io_bound == 1 and s2.seconds == pytest.approx(
        reads + cfg.plan.start_s("student", gpu=True) + cfg.plan.stage_s
    )
    assert "stage2 is I/O-bound: 1 of 1 units" in plan.cost.table()
    fast = make_plan(_one_student("stage2.targets=hidden"), qwen30b, cluster).cost.by_name()["stage2"]
    assert fast.io_bound == 0 and fast.seconds < s2.seconds  # local NVMe keeps up


def test_the_run_s_storage_is_priced_for_its_length_by_kind(qwen30b, cluster):
    local = make_plan(_cfg(), qwen30b, cluster)
    s3 = make_plan(_cfg("qwen3_30b_a3b.yaml", "storage=s3://bucket/run"), qwen30b, cluster)
    assert local.cost.storage_dollars == 0.0  # the node's own disk
    kept = s3.storage_peak_bytes / 1e12 * TB_MONTH["object"] * s3.cost.seconds / 3600 / 730
    assert s3.cost.storage_dollars == pytest.approx(kept) and kept > 0
    assert s3.cost.dollars == pytest.approx(sum(s.dollars for s in s3.cost.stages) + s3.cost.head_dollars + kept)


def test_auto_chooses_hidden_on_the_30b_grid_at_its_budget_and_never_an_approximate_mode(qwen30b, cluster):
    plan = make_plan(_cfg(), qwen30b, cluster)
    t = plan.targets["teacher"]
    assert (t.mode, t.shard) == ("hidden", False) and plan.problems() == []
    assert (
        "online needs 83.8 GiB a rank" in t.why
        and "online, sharded: the run $" in t.why
        and "hidden: the run $" in t.why
    )
    line = json.loads(plan_line(plan))
    assert line["targets"] == {"teacher": {"targets": "hidden", "shard_teacher": False}}
    for more in ((), ("distill.steps=2600",), ("plan.max_storage=1TB",)):
        chosen = make_plan(_cfg("qwen3_30b_a3b.yaml", *more), qwen30b, cluster).targets["teacher"]
        assert chosen.mode in ("hidden", "online"), more  # exact modes only


def test_a_storage_limit_moves_auto_online_and_refuses_a_cached_mode(qwen30b, cluster):
    auto = make_plan(_cfg("qwen3_30b_a3b.yaml", "plan.max_storage=1TB"), qwen30b, cluster)
    assert (auto.targets["teacher"].mode, auto.targets["teacher"].shard) == ("online", True)
    assert auto.problems() == [] and "hidden stores 1835.8 GiB, over plan.max_storage" in auto.targets["teacher"].why
    hidden = make_plan(_cfg("qwen3_30b_a3b.yaml", "plan.max_storage=1TB", "stage2.targets=hidden"), qwen30b, cluster)
    (line,) = hidden.problems()
    assert line.startswith(
        "the run would store 1835.8 GiB (most: targets 1200.0 GiB) but plan.max_storage is 931.3 GiB"
    )
    assert "stage2.targets=online with stage2.shard_teacher=true" in line


def test_no_exact_mode_that_fits_is_one_line_naming_both_limits(qwen30b, cluster):
    """One worker (nothing to shard over) and no room to store the states: both limits named, exit 2 (the CLI)."""
    cfg = _cfg("qwen3_30b_a3b.yaml", "plan.max_storage=1TB", "distill.workers=1", "distill.deepspeed=false")
    problems = make_plan(cfg, qwen30b, cluster).problems()
    line = next(p for p in problems if p.startswith("stage2.targets=auto"))
    assert "no exact mode fits teacher" in line and "over plan.max_storage 931.3 GiB" in line
    assert "online needs" in line and "a rank, over the" in line and "raise plan.max_storage" in line


def test_the_extended_experiment_fits_80gb_and_stores_no_dense_teacher_states(qwen30b, cluster):
    cfg = _cfg("qwen3_30b_a3b_extended.yaml")
    assert cfg.stage2.recipes and cfg.distill.steps == 2600 and cfg.stage2.targets == "auto"
    dense = model_config(str(CONFIGS / "Qwen--Qwen3-32B"))
    plan = make_plan(cfg, qwen30b, cluster, {"teacher-d2d": dense})
    assert plan.problems() == []
    d2d, moe = plan.targets["teacher-d2d"], plan.targets["teacher"]
    assert (d2d.mode, d2d.shard) == ("online", True) and d2d.why.startswith("it serves one student")
    for candidate in ("hidden: the run $", "online needs", "online, sharded: the run $"):  # what each would cost
        assert candidate in moe.why
    tokens = student_tokens(cfg)
    assert tokens == pytest.approx(4.09e9, rel=0.01)
    stored = plan.storage.get("targets", 0)
    assert stored == (tokens * 2048 * 2 if moe.mode == "hidden" else 0)  # the MoE teacher's states at most
    rank = plan.by_stage()["stage2"]
    assert rank.fits and all(r.fits for r in plan.stages if r.name.startswith("stage2"))
    d2d_rank = next(r for r in plan.stages if r.name == "stage2:teacher-d2d")
    assert d2d_rank.parts["teacher shard"] == pytest.approx((shape_of(dense).params - 151936 * 5120) * 2 / 8, abs=1)
    s2 = plan.cost.by_name()["stage2"]
    m = models_of(qwen30b)
    assert s2.units == 4 and s2.flops > 3 * stage2_flops(cfg, m, moe.kind)  # 3 students of the MoE teacher + d2d's
    assert json.loads(plan_line(plan))["targets"]["teacher-d2d"] == {"targets": "online", "shard_teacher": True}


def test_an_explicit_mode_is_every_teacher_s(qwen30b):
    cfg = _cfg("qwen3_30b_a3b_extended.yaml", "stage2.targets=hidden")
    plan = make_plan(cfg, qwen30b, GPU80)
    assert {k: t.mode for k, t in plan.targets.items()} == {"teacher": "hidden", "teacher-d2d": "hidden"}
    assert not any(t.why for t in plan.targets.values())
    again = make_plan(replace(cfg, stage2=replace(cfg.stage2, targets="auto")), qwen30b, GPU80, choices=plan.targets)
    assert again.targets == plan.targets  # a resumed run keeps what it was planned with


def test_the_run_uses_the_plan_s_choice_recorded_in_memory_plan_json(tmp_path):
    """m2d run hands the plan's choice to the run's context and records it; a context without one (a resume, the
    report) reads it from memory_plan.json; an explicit mode is every teacher's; auto with no plan is one line."""
    from m2d_ray.commands.plan import kept_choices, record_plan
    from m2d_ray.errors import M2DError
    from m2d_ray.models import default_teacher
    from m2d_ray.run_dir import RunDir
    from m2d_ray.runtime.context import RunContext

    tiny = EXPERIMENTS / "tiny.yaml"
    cfg = load_config(tiny, ["stage2.targets=auto", "plan.cpu_flops=1e9"])
    plan = make_plan(cfg, model_config(default_teacher()), Devices(host_memory=8 << 30))
    assert {k: t.label for k, t in plan.targets.items()} == {"teacher": "hidden", "teacher-d2d": "online"}
    rd = RunDir(tmp_path / "run")
    record_plan(rd, plan)
    assert json.loads(rd.memory_plan.read_text())["targets"]["teacher-d2d"]["targets"] == "online"
    ctx = RunContext(cfg, rd)
    assert all(ctx.choice(k) == t for k, t in plan.targets.items())
    with pytest.raises(M2DError, match="no plan of .* chose the targets of teacher; m2d run plans it"):
        RunContext(cfg, RunDir(tmp_path / "other")).choice("teacher")
    explicit = RunContext(load_config(tiny, ["stage2.targets=sampled:8"]), RunDir(tmp_path / "other"))
    assert explicit.choice("teacher-d2d").mode == "sampled:8"
    # a resume keeps the choice once stage 2 has started (its students trained on it); before, the plan decides again
    assert kept_choices(rd, cfg) is None
    rd.stage2_config.parent.mkdir(parents=True, exist_ok=True)
    rd.stage2_config.write_text("stage: 2\n")
    assert kept_choices(rd, cfg) == plan.targets and kept_choices(rd, explicit.cfg) is None


def test_only_a_teacher_that_stores_its_states_has_a_targets_pass(qwen30b):
    from m2d_ray.plan.targets import TeacherTargets

    cfg = _cfg("qwen3_30b_a3b_extended.yaml")
    rows = {}
    for moe in ("hidden", "online"):
        chosen = {"teacher": TeacherTargets(moe), "teacher-d2d": TeacherTargets("online", shard=True)}
        plan = make_plan(cfg, qwen30b, GPU80, choices=chosen)
        rows[moe] = [r.name for r in plan.stages if r.name.startswith("targets")]
        assert ("targets" in plan.storage) == (moe == "hidden") and ("targets" in plan.cost.by_name()) == (
            moe == "hidden"
        )
    assert rows == {"hidden": ["targets"], "online": []}
