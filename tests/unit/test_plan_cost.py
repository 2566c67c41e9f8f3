"""The bill of a run (plan/cost.py): FLOPs from shapes equal the counts on built models, time follows the run's
concurrency, dollars the node-hours with the idle tail, and plan.max_dollars refuses before any work."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from m2d_ray.accelerators import GPU_PEAK_BF16
from m2d_ray.config import load_config
from m2d_ray.errors import M2DError
from m2d_ray.models import default_teacher, model_config
from m2d_ray.pipeline import plan as make_plan
from m2d_ray.plan import asha, cost, flops
from m2d_ray.plan.devices import cluster_settings, from_cluster_yaml
from m2d_ray.plan.prices import hourly
from m2d_ray.plan.run_plan import Devices, plan_line
from m2d_ray.plan.shapes import models_of
from m2d_ray.prune.search import MIXES
from m2d_ray.shipped import EXPERIMENTS

QWEN30B = EXPERIMENTS / "configs" / "Qwen--Qwen3-30B-A3B"
CLUSTER = ROOT / "cluster.yaml"


@pytest.fixture(scope="module")
def paper():
    """The paper's grid on cluster.yaml's node types (dollars from its price table and idle tail)."""
    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml")
    head, idle = cluster_settings(CLUSTER)
    return cfg, make_plan(
        cfg, model_config(str(QWEN30B)), Devices(None, None, tuple(from_cluster_yaml(CLUSTER)), None, head, idle)
    )


def test_flops_from_shapes_equal_the_counts_on_the_built_models():
    from transformers import AutoModelForCausalLM

    from m2d_ray.arch import get_adapter
    from m2d_ray.distill.flops import flops_per_token, matmul_params

    config = model_config(default_teacher())
    m = models_of(config)
    teacher = AutoModelForCausalLM.from_pretrained(default_teacher(), dtype=torch.float32)
    student = AutoModelForCausalLM.from_config(m.student_config)
    adapter = get_adapter(config)
    want = flops_per_token(teacher, adapter, student, 128)
    assert flops.forward_flops(m.teacher, 128) + 3 * flops.forward_flops(m.student, 128) == pytest.approx(
        want, rel=1e-12
    )
    # calibration runs every expert: the whole matmul weight count, plus the E x E Gram of each MoE layer
    every = flops.forward_flops(m.teacher, 128, all_experts=True)
    assert every - flops.forward_flops(m.teacher, 128) == 2 * (
        matmul_params(teacher) - (matmul_params(teacher) - m.teacher.inactive_expert_params)
    )
    assert flops.calibration_flops(m.teacher, 128) - every == 2 * 4 * 16**2 * 64


def test_stage2_counts_the_student_step_and_the_teacher_side_by_mode():
    cfg = load_config(EXPERIMENTS / "tiny.yaml", ["distill.eval_max_tokens=0"])
    m = models_of(model_config(default_teacher()))
    x, seq = cfg.distill, cfg.distill.seq_len
    tokens = x.steps * x.batch_size * x.grad_accum * x.workers * seq
    student = flops.forward_flops(m.student, seq)
    assert flops.stage2_flops(cfg, m, "online") == tokens * (3 * student + flops.forward_flops(m.teacher, seq))
    assert flops.stage2_flops(cfg, m, "hidden") == tokens * (3 * student + 2 * m.teacher.vocab * m.teacher.hidden)
    assert flops.stage2_flops(cfg, m, "topk:64") == tokens * 3 * student
    ckpt = replace(cfg, distill=replace(x, checkpointing="full"))
    assert flops.stage2_flops(ckpt, m, "topk:64") == tokens * 4 * student  # the recomputation is time
    sac = replace(cfg, distill=replace(x, checkpointing="selective"))
    assert flops.stage2_flops(sac, m, "topk:64") == tokens * 3 * student  # no matmul twice: elementwise work only


def test_the_d2d_search_runs_before_the_students_in_stage_2_s_row():
    """The d2d baseline's search (its dense teacher over the calibration tokens, each candidate over the
    perplexity tokens) is stage 2's first task: its FLOPs and seconds add to stage 2's, and nothing else moves."""
    from m2d_ray.models import default_dense_teacher
    from m2d_ray.plan.shapes import shape_of

    over = ["plan.cpu_flops=1e9", "stage2.baselines=[random-ffn,random-init]"]
    dense = model_config(default_dense_teacher())

    def bill(*more):
        cfg = load_config(EXPERIMENTS / "tiny.yaml", [*over[:1], *more])
        return cfg, make_plan(
            cfg, model_config(default_teacher()), Devices(host_memory=8 << 30), {"teacher-d2d": dense}
        ).cost.by_name()

    cfg, with_d2d = bill()  # tiny.yaml has d2d
    _, without = bill(over[1])
    m = models_of(model_config(default_teacher()))
    search = cfg.calib.max_tokens * flops.forward_flops(shape_of(dense), cfg.calib.seq_len) + 6 * flops.eval_tokens(
        cfg
    ) * flops.forward_flops(m.student, cfg.eval.seq_len)
    one_student = flops.stage2_flops(
        cfg, m, "online", shape_of(dense)
    )  # the d2d student, distilled from the dense twin
    assert len(MIXES) == 6
    assert with_d2d["stage2"].flops == pytest.approx(without["stage2"].flops + one_student + search)
    # its time is on stage 2's wall: twice the calibration tokens, only the search's importance pass grows
    _, more = bill(f"calib.max_tokens={2 * cfg.calib.max_tokens}")
    grown = cfg.calib.max_tokens * flops.forward_flops(shape_of(dense), cfg.calib.seq_len)
    lone = cost.Host(1e9, os.cpu_count() or 1).share(1, 1)  # the search runs alone, on one thread
    assert more["stage2"].flops == pytest.approx(with_d2d["stage2"].flops + grown)
    assert more["stage2"].seconds == pytest.approx(
        with_d2d["stage2"].seconds + grown / (lone * 1e9 * cfg.plan.cpu_efficiency)
    )
    assert with_d2d["calibrate"] == without["calibrate"] and with_d2d["stage1"] == without["stage1"]


def test_with_cached_targets_the_d2d_teacher_has_its_pass_and_its_student_reads_them():
    """stage2.targets=hidden with d2d: the dense teacher's targets pass follows the MoE teacher's in the targets
    row (one actor each here: one shard), its states are stored beside the teacher's, and the d2d student pays
    the dense head, not the dense forward."""
    from m2d_ray.distill.targets import state_bytes
    from m2d_ray.models import default_dense_teacher
    from m2d_ray.plan.shapes import shape_of

    dense = model_config(default_dense_teacher())

    def plan(*more):
        cfg = load_config(EXPERIMENTS / "tiny.yaml", ["plan.cpu_flops=1e9", "stage2.targets=hidden", *more])
        return cfg, make_plan(
            cfg, model_config(default_teacher()), Devices(host_memory=8 << 30), {"teacher-d2d": dense}
        )

    cfg, both = plan()
    _, alone = plan("stage2.baselines=[random-ffn,random-init]")
    m, d = models_of(model_config(default_teacher())), shape_of(dense)
    tokens = flops.student_tokens(cfg)
    one_pass = tokens * (flops.forward_flops(d, cfg.distill.seq_len) - flops.head_flops(d))
    t2, t1 = both.cost.by_name()["targets"], alone.cost.by_name()["targets"]
    assert (
        t2.flops == pytest.approx(t1.flops + one_pass) and t1.units == t2.units == 1
    )  # 1 actor a pass: each has 1 shard
    # the second pass starts its own actor, in a Ray Data already started: no second plan.stage_s
    rate = cost.Host(1e9, os.cpu_count() or 1).share(1, 1) * 1e9 * cfg.plan.cpu_efficiency
    assert t2.seconds == pytest.approx(2 * t1.seconds - cfg.plan.stage_s + (one_pass - t1.flops) / rate)
    assert both.storage["targets"] == alone.storage["targets"] + tokens * state_bytes(d.hidden, False)
    s2_student = both.cost.by_name()["stage2"].flops - alone.cost.by_name()["stage2"].flops
    search = cfg.calib.max_tokens * flops.forward_flops(d, cfg.calib.seq_len) + 6 * flops.eval_tokens(
        cfg
    ) * flops.forward_flops(m.student, cfg.eval.seq_len)
    assert s2_student == pytest.approx(flops.stage2_flops(cfg, m, "hidden", d) + search)


def test_stage1_counts_the_distinct_students_and_the_probe_round():
    cfg = load_config(EXPERIMENTS / "tiny-grid.yaml")
    t = models_of(model_config(default_teacher())).teacher
    configs, distinct = flops.distinct_students(cfg, t)
    assert (configs, distinct) == (280, 224)  # P2 measured 204: a few scorings coincide beyond K = k
    trials, chunks = flops.stage1_chunks(cfg, distinct)
    survivors = math.ceil(224 * 81 / 204)
    assert trials == 224 + survivors and chunks == 224 + survivors * 5
    full = load_config(EXPERIMENTS / "tiny-grid.yaml", ["search.dedupe=false", "search.early_stop=false"])
    assert flops.distinct_students(full, t) == (280, 280) and flops.stage1_chunks(full, 280) == (280, 280 * 6)


def test_the_probe_round_is_a_tune_experiment_of_its_own():
    """Each Ray round (a Tune experiment, a Ray Data pass) pays plan.stage_s: stage 1 twice with its probe round."""

    def stage1(*more):
        cfg = load_config(EXPERIMENTS / "tiny.yaml", ["plan.cpu_flops=1e9", *more])
        return (
            make_plan(cfg, model_config(default_teacher()), Devices(host_memory=8 << 30, cpu_load=0.0))
            .cost.by_name()["stage1"]
            .seconds
        )

    assert stage1("plan.stage_s=11") - stage1("plan.stage_s=10") == pytest.approx(2.0)
    assert stage1("plan.stage_s=11", "search.probe=false") - stage1(
        "plan.stage_s=10", "search.probe=false"
    ) == pytest.approx(1.0)


def test_units_run_longest_first_on_the_lanes_they_have():
    assert cost.lanes_wall([3, 3, 3], 2) == 6
    assert cost.lanes_wall([5, 1, 1, 1, 1, 1], 2) == 5
    assert cost.lanes_wall([2] * 4, 8) == 2 and cost.lanes_wall([], 3) == 0


def test_the_paper_s_students_train_two_at_a_time_on_two_h100_nodes(paper):
    cfg, plan = paper
    bound = plan.cost.bound  # with no student stopped early (ASHA's stops: the next test)
    s2 = bound.by_name()["stage2"]
    assert (s2.units, s2.lanes, s2.node) == (37, 2, "gpu_h100_8x")  # max_workers: 2 of the 8 x H100 type
    m = models_of(model_config(str(QWEN30B)))
    per = flops.stage2_flops(cfg, m, "hidden") / (
        8 * GPU_PEAK_BF16["H100"] * cfg.plan.gpu_efficiency("hidden")
    ) + cfg.plan.start_s("student", gpu=True)
    assert s2.seconds == pytest.approx(19 * per + cfg.plan.stage_s)  # 37 students in 19 rounds of 2
    assert s2.gpu_hours == pytest.approx(37 * per * 8 / 3600)
    _, idle = cluster_settings(CLUSTER)
    assert s2.dollars == pytest.approx(
        2 * (s2.seconds + idle * 60) / 3600 * 55.04
    )  # two nodes, their idle tail included
    for c in (plan.cost, bound):
        assert c.dollars == pytest.approx(sum(s.dollars for s in c.stages) + c.head_dollars)
        assert c.head_dollars == pytest.approx(0.384 * c.seconds / 3600)


def test_asha_s_stops_shorten_stage_2_and_leave_stage_3_only_the_finishers(paper):
    """The paper's 37 students, 8 reports each, ASHA's rungs at 2 and 6 reports (grace 2, reduction factor 3):
    a stopped student trains to its rung and the poll after it, is not evaluated, and the bound is the run
    with ASHA off, which plan.max_dollars is held to."""
    cfg, plan = paper
    m = models_of(model_config(str(QWEN30B)))
    ends = plan.cost.asha
    assert asha.asha_rungs(8, 2, 3) == [2, 6] and [r for r, _ in ends] == [2, 6, 8] and sum(k for _, k in ends) == 37
    assert ends == tuple(asha.asha_ends(cfg, 37, 2))
    x = cfg.distill
    val = x.eval_max_tokens * (
        flops.forward_flops(m.student, x.seq_len) + flops.head_flops(m.teacher)
    )  # one validation
    train = (
        flops.stage2_flops(cfg, m, "hidden") - 9 * val
    )  # the whole budget: its steps, the first validation and 8 more
    stopped = (
        train * (2 * x.eval_every + x.stop_poll) / x.steps + 3 * val
    )  # to step 50, then 10 more to its poll; 3 validations
    assert flops.stage2_flops(cfg, m, "hidden", reports=2) == pytest.approx(stopped)
    s2 = plan.cost.by_name()["stage2"]
    assert s2.flops == pytest.approx(sum(k * flops.stage2_flops(cfg, m, "hidden", reports=r) for r, k in ends))
    assert s2.units == 37 and s2.flops < 0.6 * plan.cost.bound.by_name()["stage2"].flops
    finished, evaluated = ends[-1][1], plan.cost.by_name()["stage3"].units
    assert (
        evaluated == finished + 1 and plan.cost.bound.by_name()["stage3"].units == 37 + 1
    )  # the students that finish, the teacher
    placed = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", plan.overrides())  # the GPU types the plan placed it on
    off = replace(placed, stage2=replace(cfg.stage2, asha=False))
    head, idle = cluster_settings(CLUSTER)
    again = make_plan(
        off, model_config(str(QWEN30B)), Devices(None, None, tuple(from_cluster_yaml(CLUSTER)), None, head, idle)
    ).cost
    assert again.bound is None and again.dollars == pytest.approx(plan.cost.bound.dollars) and again.asha == ((8, 37),)
    between = (plan.cost.dollars + plan.cost.bound.dollars) / 2
    assert (
        f"up to ${plan.cost.bound.dollars:,.0f}" in plan.cost.over_budget(between)
        and plan.cost.over_budget(plan.cost.bound.dollars + 1) is None
    )
    line = json.loads(plan_line(plan))
    assert (
        line["bound"]["dollars"] == pytest.approx(plan.cost.bound.dollars)
        and line["dollars"] < line["bound"]["dollars"]
    )
    assert (
        f"of 37 students, {ends[0][1]} stopped after 2 reports, {ends[1][1]} after 6; {finished} finish all 8"
        in plan.table()
    )


def test_the_plan_s_asha_decides_as_ray_s_own_scheduler():
    """plan/cost.py's copy of ASHA's rule stops the same students at the same reports as Ray Tune's
    ASHAScheduler on the same simulated students (workshop/asha_ray.py), in each case benchmarks/perf/asha_bill.py
    measures."""
    import random

    from workshop import asha_ray

    for _, n, reports, grace, rf, lanes in asha_ray.CASES:
        rungs = asha.asha_rungs(reports, grace, rf)
        assert rungs and rungs[-1] < reports
        for seed in range(8):
            rng = random.Random(seed)
            quality = [
                rng.gauss(0, 1) for _ in range(n)
            ]  # simulate's students: at rho = 1 each keeps its quality as its loss
            ours = asha._asha_run(quality, reports, rungs, rf, lanes)
            assert ours == asha_ray.simulate(n, reports, grace, rf, lanes, 1.0, seed) and sum(ours.values()) == n
    # students whose order changes between reports are stopped no later: the plan's expectation is the dearest case
    n, reports, grace, rf, lanes = asha_ray.CASES[2][1:]
    plan = sum(r * k for r, k in asha_ray.plan_ends(n, reports, grace, rf, lanes))
    shuffled = (
        sum(
            sum(r * k for r, k in asha_ray.simulate(n, reports, grace, rf, lanes, 0.0, seed).items())
            for seed in range(20)
        )
        / 20
    )
    assert shuffled < 0.9 * plan


def test_the_json_line_and_the_table_carry_the_bill(paper):
    _, plan = paper
    line = json.loads(plan_line(plan))
    for name in ("calibrate", "stage1", "targets", "stage2", "stage3"):
        assert {"flops", "seconds", "gpu_hours", "dollars"} <= set(line["stages"][name]), name
        assert line["stages"][name]["flops"] > 0 and line["stages"][name]["dollars"] > 0
    assert line["dollars"] == pytest.approx(plan.cost.dollars) and line["gpu_hours"] == pytest.approx(
        sum(s.gpu_hours for s in plan.cost.stages)
    )
    assert "the bill" in plan.table() and any(row.startswith("total ") for row in plan.table().splitlines())


def test_prices_come_from_the_table_spot_and_overrides():
    types = {n.name: n for n in from_cluster_yaml(CLUSTER)}
    assert (
        hourly(types["gpu_a10g_1x"]) == 1.212 and hourly(types["gpu_a10g_1x_spot"]) == 0.48
    )  # the same instance, spot
    assert (
        hourly(types["gpu_h100_8x"], {"gpu_h100_8x": 40.0}) == 40.0
        and hourly(types["gpu_h100_8x"], {"p5.48xlarge": 41.0}) == 41.0
    )
    assert cluster_settings(CLUSTER) == ("head_cpu", 10.0)


def test_a_run_over_plan_max_dollars_is_refused_before_calibration():
    from m2d_ray.commands.plan import check_run

    over = ["distill.gpus_per_worker=1", "distill.accelerator=H100", "plan.max_dollars=0.01"]
    with pytest.raises(M2DError, match=r"would cost \$.* but plan.max_dollars is \$0.01; give a smaller") as e:
        check_run(load_config(EXPERIMENTS / "tiny.yaml", over), cluster=str(CLUSTER))
    assert "\n" not in str(e.value)
    # unpriceable (a GPU stage, no node types): refused too, saying what to give
    cfg = load_config(EXPERIMENTS / "tiny.yaml", over)
    plan = make_plan(cfg, model_config(default_teacher()), Devices(80 << 30))
    assert plan.cost.by_name()["stage2"].dollars is None and "cannot be priced" in plan.problems()[-1]
    ok = load_config(EXPERIMENTS / "tiny.yaml", [*over[:2], "plan.max_dollars=1000"])
    assert not make_plan(
        ok, model_config(default_teacher()), Devices(None, None, tuple(from_cluster_yaml(CLUSTER)))
    ).problems()


def test_a_cpu_run_is_timed_with_the_measured_thread_rate():
    cfg = load_config(EXPERIMENTS / "tiny.yaml", ["plan.cpu_flops=1e9"])
    plan = make_plan(cfg, model_config(default_teacher()), Devices(host_memory=8 << 30))
    c = plan.cost.by_name()["calibrate"]
    threads = min(1, max(1.0, os.cpu_count() / 2))  # 2 actors of 1 thread, at most the cores between them
    start = (
        cfg.plan.actor_s / threads + cfg.plan.stage_s
    )  # an actor's start-up (on its share of the cores), the stage's
    assert c.lanes == 2 and c.seconds == pytest.approx(c.flops / 2 / (threads * 1e9 * cfg.plan.cpu_efficiency) + start)
    # a CPU stage is timed at the CPU's efficiency; the GPU's does not touch it
    gpu = load_config(EXPERIMENTS / "tiny.yaml", ["plan.cpu_flops=1e9", "plan.efficiency=0.9"])
    assert (
        make_plan(gpu, model_config(default_teacher()), Devices(host_memory=8 << 30))
        .cost.by_name()["calibrate"]
        .seconds
        == c.seconds
    )
    slow = load_config(EXPERIMENTS / "tiny.yaml", ["plan.cpu_flops=1e9", "plan.cpu_efficiency=0.2"])
    assert make_plan(slow, model_config(default_teacher()), Devices(host_memory=8 << 30)).cost.by_name()[
        "calibrate"
    ].seconds == pytest.approx(c.flops / 2 / (threads * 1e9 * 0.2) + start)
    assert (
        plan.cost.dollars == 0.0 and cost.cpu_rate(load_config(None)) > 1e8
    )  # measured: a CPU thread does > 0.1 GFLOP/s


def test_the_suite_s_tokens_come_from_the_task_data(tmp_path):
    from m2d_ray.evaluate.local_tasks import text_rows
    from m2d_ray.plan.suite import CHARS_PER_TOKEN, PAPER, suite_tokens

    def lines(split):
        return [
            json.loads(x)
            for x in (ROOT / f"m2d_ray/evaluate/tasks/synthetic_continuation.{split}.jsonl").read_text().splitlines()
        ]

    def request(rows):  # a request: a row's context and one of its choices, in tokens
        return (
            sum(len(r["context"]) for r in rows) / len(rows)
            + sum(len(c) for r in rows for c in r["choices"]) / (4 * len(rows))
        ) / CHARS_PER_TOKEN

    def shot(rows):  # a shot: an example's context and its gold answer
        return sum(len(r["context"]) + len(r["choices"][r["label"]]) for r in rows) / len(rows) / CHARS_PER_TOKEN

    test, train = lines("test"), lines("train")
    tokens, _ = suite_tokens("local", None, None)  # 0-shot and 2-shot, 4 choices a row
    assert tokens == pytest.approx(200 * 4 * (2 * request(test) + 2 * shot(train)))
    # text:PATH: the rows stage 3 builds from that file (WikiText contexts are longer than the synthetic ones)
    wiki = "\n".join(
        f" = Title {i} = \n\n "
        + " ".join(f"Sentence {j} of paragraph {i} has several more words in it ." for j in range(6))
        for i in range(60)
    )
    path = tmp_path / "wiki.raw"
    path.write_text(wiki)
    rows = text_rows(path)
    assert suite_tokens(f"text:{path}", None, None)[0] == pytest.approx(len(rows["test"]) * 4 * request(rows["test"]))
    assert suite_tokens(f"text:{path}", 1, None)[0] == pytest.approx(
        len(rows["test"]) * 4 * (request(rows["test"]) + shot(rows["train"]))
    )
    limited, _ = suite_tokens("paper", None, 10)
    assert limited < suite_tokens("paper", None, None)[0] and PAPER["mmlu"][0] == 14042


def _fetched_paper_data():
    from m2d_ray.evaluate import paper_data

    try:
        return paper_data.verify()
    except Exception:  # not fetched (m2d fetch-data): nothing to hold the table to
        return None


@pytest.mark.slow
@pytest.mark.skipif(_fetched_paper_data() is None, reason="the paper suite's data is not fetched (m2d fetch-data)")
def test_the_paper_suite_s_figures_are_its_data_s():
    """plan/suite.py's PAPER table against lm-eval's requests over all the fetched data (perf/suite_tokens.py, ~4
    min: a task's first rows are not like the rest, HellaSwag's half as long); within the table's rounding."""
    from datasets import load_from_disk

    from m2d_ray.evaluate.harness import PAPER_SUITE, base_name
    from m2d_ray.evaluate.paper_tasks import MMLU_SUBJECTS, PREFIX, TASKS
    from m2d_ray.plan.suite import CHARS_PER_TOKEN, PAPER

    SHOTS = {base_name(t).removeprefix(PREFIX): k for t, k in PAPER_SUITE}

    root = _fetched_paper_data()
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.suite_tokens"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    measured = {r["task"]: r for r in json.loads(next(ln for ln in out.splitlines() if ln.startswith("[")))}
    for name, (_, split, _, _) in TASKS.items():
        r = measured[name]
        assert r["shots"] == SHOTS[name]
        rows, per_row, tok, shot = PAPER[name]
        parts = MMLU_SUBJECTS if name == "mmlu" else [""]
        assert (
            rows == r["rows"] == sum(len(load_from_disk(str(root / TASKS[name][0] / part / split))) for part in parts)
        )
        assert per_row == pytest.approx(r["per_row"], abs=0.005)
        assert tok * CHARS_PER_TOKEN == pytest.approx(
            r["chars_0shot"], abs=2
        ) and shot * CHARS_PER_TOKEN == pytest.approx(r["chars_per_shot"], abs=2)


def test_the_report_sets_the_estimate_beside_the_measured_wall():
    from m2d_ray.report.analysis import RunData, cost_rows

    plan = {
        "cost": {
            "stages": {
                "calibrate": {"flops": 1.0, "seconds": 4.0},
                "stage1": {"flops": 2.0, "seconds": 20.0},
                "stage2": {"flops": 3.0, "seconds": 100.0, "gpu_hours": 0.0, "dollars": 0.0},
                "stage3": {"flops": 4.0, "seconds": None},
            }
        },
        "rows": [{"name": n} for n in ("calibrate", "stage1", "targets", "stage2", "stage3:student", "stage3:teacher")],
    }  # the plan's order
    timings = {"stage1": {"wall_s": 35.0, "calibrate_s": 5.0}, "stage2": {"wall_s": 150.0}, "stage3": {"wall_s": 40.0}}
    rows = {r["stage"]: r for r in cost_rows(RunData(Path("."), None, [], {}, {}, timings=timings, memory_plan=plan))}
    assert (
        rows["calibrate"]["ratio"] == 1.25 and rows["stage1"]["measured_s"] == 30.0 and rows["stage2"]["ratio"] == 1.5
    )
    assert rows["stage3"]["ratio"] is None and cost_rows(RunData(Path("."), None, [], {}, {})) == []
    # cached targets: their pass is timed apart from the students it serves
    plan["cost"]["stages"]["targets"] = {"flops": 5.0, "seconds": 10.0}
    timings["stage2"]["targets_s"] = 30.0
    rows = {r["stage"]: r for r in cost_rows(RunData(Path("."), None, [], {}, {}, timings=timings, memory_plan=plan))}
    assert rows["targets"]["ratio"] == 3.0 and rows["stage2"]["measured_s"] == 120.0
    assert list(rows) == [
        "calibrate",
        "stage1",
        "targets",
        "stage2",
        "stage3",
    ]  # in the run's order, whatever the file's
    # this m2d times every stage of the pipeline apart, the targets pass too
    timings = {
        "calibrate": {"wall_s": 5.0},
        "stage1": {"wall_s": 30.0},
        "stage2": {"wall_s": 120.0},
        "stage3": {"wall_s": 40.0},
        "targets": {"wall_s": 30.0},
        "report": {"wall_s": 1.0},
    }
    again = {r["stage"]: r for r in cost_rows(RunData(Path("."), None, [], {}, {}, timings=timings, memory_plan=plan))}
    assert again == rows and list(again) == list(rows)


def test_on_a_shared_machine_a_cpu_stage_gets_its_fair_share_of_the_cores():
    host = cost.Host(1e9, 2, 0.0)
    assert host.share(1, 2) == 1 and host.share(1, 4) == 0.5 and cost.Host(1e9, 2, 6.0).share(1, 2) == 0.25
    cfg = load_config(EXPERIMENTS / "tiny.yaml", ["plan.cpu_flops=1e9"])
    idle, busy = (
        make_plan(cfg, model_config(default_teacher()), Devices(host_memory=8 << 30, cpu_load=load)).cost
        for load in (0.0, 6.0)
    )
    a, b = idle.by_name()["calibrate"], busy.by_name()["calibrate"]
    assert busy.cpu_load == 6.0 and busy.cpu_flops == 1e9
    n = os.cpu_count()
    compute = a.flops / 2 / (1e9 * cfg.plan.cpu_efficiency)  # an actor's FLOPs on a whole thread
    compute += cfg.plan.actor_s  # and its start-up, slowed as its compute is
    assert a.seconds == pytest.approx(compute / min(1.0, n / 2) + cfg.plan.stage_s)
    assert b.seconds == pytest.approx(
        compute / min(1.0, n / (6 + 2)) + cfg.plan.stage_s * max(1.0, 7 / n)
    )  # 2 actors beside 6 others
