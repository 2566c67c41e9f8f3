"""The memory plan (m2d_ray/plan/): shapes against real models, the paper's figures, the arithmetic's
dependence on workers / checkpointing / targets, and every m2d_ray/experiments/*.yaml against cluster.yaml."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from m2d_ray.config import load_config
from m2d_ray.errors import M2DError
from m2d_ray.models import default_teacher, model_config
from m2d_ray.pipeline import plan as make_plan
from m2d_ray.plan import memory
from m2d_ray.plan.devices import NodeType, from_cluster_yaml
from m2d_ray.plan.run_plan import Devices, plan_line
from m2d_ray.plan.shapes import models_of
from m2d_ray.shipped import EXPERIMENTS

GiB = 1 << 30
CONFIGS = EXPERIMENTS / "configs"
#: the hub models of the paper configs -> their published config.json here (no hub in tests)
OFFLINE = {
    "Qwen/Qwen3-30B-A3B": "Qwen--Qwen3-30B-A3B",
    "Qwen/Qwen3-32B": "Qwen--Qwen3-32B",
    "deepseek-ai/DeepSeek-V2-Lite": "deepseek-ai--DeepSeek-V2-Lite",
    "openai/gpt-oss-20b": "openai--gpt-oss-20b",
    "Qwen/Qwen3-235B-A22B": "Qwen--Qwen3-235B-A22B",
    "deepseek-ai/DeepSeek-V3": "deepseek-ai--DeepSeek-V3",
    "Qwen/Qwen3-Coder-480B-A35B-Instruct": "Qwen--Qwen3-Coder-480B-A35B-Instruct",
    "zai-org/GLM-4.5": "zai-org--GLM-4.5",
}


@pytest.fixture(scope="module")
def qwen30b():
    return model_config(str(CONFIGS / "Qwen--Qwen3-30B-A3B"))


def test_shapes_count_what_the_built_models_hold():
    """Brute force: the teacher and a student convert/ builds, counted parameter by parameter."""
    from m2d_ray.calibrate.collect import collect_stats
    from m2d_ray.convert.build import convert
    from m2d_ray.models import load_teacher

    t = load_teacher(default_teacher())
    m = models_of(t.model.config)
    assert m.teacher.params == sum(p.numel() for p in t.model.parameters())
    ids = torch.randint(0, t.model.config.vocab_size, (4, 32))
    stats = collect_stats(t.model, t.adapter, ids, torch.ones_like(ids), batch_size=4, progress=False)
    k, E = t.adapter.top_k(t.model.config), t.adapter.num_experts(t.model.config)
    for K in (k, E):  # K chooses which experts merge, not the student's size
        student, _ = convert(t, stats, "sf", "rr", "uniform", K)
        assert m.student.params == sum(p.numel() for p in student.parameters())
    assert m.student.ffn == k * m.teacher.expert_width and m.teacher.dtype_bytes == 4


def test_the_30b_teacher_and_its_student(qwen30b):
    m = models_of(qwen30b)
    assert m.teacher.params == pytest.approx(30.53e9, rel=0.005) and m.teacher.weights / GiB == pytest.approx(
        56.9, abs=0.1
    )
    assert m.student.params == pytest.approx(3.34e9, rel=0.01) and m.student.ffn == 8 * 768


def test_online_stage2_at_8_gpus_is_the_issue_s_70_gib_before_activations(qwen30b):
    """A rank holds the 56.9 GiB teacher and a 3.34B student's ZeRO-2 share: ~70 GiB before activations,
    so it does not fit an 80 GB GPU; cached targets bring it to ~23 GiB."""
    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", ["stage2.targets=online", "distill.zero_stage=2"])
    plan = make_plan(cfg, qwen30b, Devices(gpu_memory=80 * 10**9))
    s2 = plan.by_stage()["stage2"].parts
    assert 68 < (s2["teacher"] + s2["student"] + s2["grads"] + s2["optimizer"]) / GiB < 73
    problems = plan.problems()
    assert (
        len(problems) == 1
        and problems[0].startswith("stage2: one rank needs 8")
        and "stage2.targets=hidden" in problems[0]
    )
    full = replace(
        cfg, stage2=replace(cfg.stage2, targets="sampled:64"), distill=replace(cfg.distill, checkpointing="full")
    )
    cached = make_plan(full, qwen30b, Devices(gpu_memory=80 * 10**9))
    assert not cached.problems() and 20 * GiB < cached.by_stage()["stage2"].per_device < 26 * GiB
    assert cached.by_stage()["targets"].fits and "teacher" not in cached.by_stage()["stage2"].parts
    # under checkpointing auto the plan spends what is left on keeping activations: selective fits, none does not
    auto = make_plan(replace(full, distill=cfg.distill), qwen30b, Devices(gpu_memory=80 * 10**9))
    assert auto.decided["distill.checkpointing"] == "selective" and not auto.problems()  # ZeRO-2 as asked
    assert 26 * GiB < auto.by_stage()["stage2"].per_device <= auto.by_stage()["stage2"].capacity


def test_zero3_shards_the_weights_and_auto_takes_it_only_where_zero2_does_not_fit(qwen30b):
    """ZeRO-3's rank holds 1/W of the weights, one float32 gradient partition and ZeRO-2's optimizer share, plus the
    layers in flight and the head; auto keeps the paper's ZeRO-2 for the 30B study and shards the 22B student of
    Qwen3-235B-A22B, said in one line."""
    s = models_of(qwen30b).student
    two, three = (memory.training(s, 16384, 2, 8, True, z, "full", 1024) for z in (2, 3))
    assert three["student"] == s.params * 2 // 8 and three["optimizer"] == two["optimizer"]
    assert two["grads"] - three["grads"] == s.params * 2 // 8
    assert three["gathered"] == (max(2 * s.layer_params, s.vocab * s.hidden) + s.vocab * s.hidden) * 2
    paper = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml")
    assert paper.distill.zero_stage == "auto"
    small = make_plan(paper, qwen30b, Devices(gpu_memory=80 * 10**9))
    assert small.decided["distill.zero_stage"] == "2" and not small.problems()
    h100 = Devices(gpu_memory=80 * GiB)
    big = make_plan(paper, model_config(str(CONFIGS / "Qwen--Qwen3-235B-A22B")), h100)
    (line,) = [n for n in big.decision_lines() if n.startswith("distill.zero_stage")]
    assert re.fullmatch(r"distill\.zero_stage=auto: 3 \(2: 1\d\d\.\d GiB a rank; 3: .*\)", line), line
    assert big.decided["distill.zero_stage"] == "3" and big.by_stage()["stage2"].fits
    pinned = replace(paper, distill=replace(paper.distill, zero_stage=2))
    refused = make_plan(pinned, model_config(str(CONFIGS / "Qwen--Qwen3-235B-A22B")), h100)
    assert refused.by_stage()["stage2"].fits is False  # as asked, ZeRO-2 cannot hold the 22B student a rank


def test_zero2_shards_the_optimizer_and_checkpointing_keeps_one_layer(qwen30b):
    s = models_of(qwen30b).student
    one, eight = (memory.training(s, 16384, 2, w, True, 2, "full", 1024) for w in (1, 8))
    assert one["optimizer"] == 8 * eight["optimizer"] == 12 * s.params
    assert one["grads"] - eight["grads"] == pytest.approx((2 + 4) * s.params * 7 / 8, rel=1e-6)
    full = memory.training(s, 16384, 2, 8, True, 2, "none", 1024)
    assert full["activations"] == s.layers * 16384 * memory.layer_activation(s, 2)  # bytes a token
    assert eight["activations"] == s.layers * 16384 * s.hidden * 2 + 16384 * memory.layer_activation(s, 2)
    plain = memory.training(s, 16384, 4, 1, False, 2, "none", 1024)  # CPU: fp32, AdamW's two moments, no master copy
    assert plain["optimizer"] == 2 * 4 * s.params and plain["grads"] == 4 * s.params


@pytest.mark.parametrize("workers", [2, 8])
def test_the_30b_config_distils_from_hidden_states_on_80gb_gpus(qwen30b, workers):
    """The paper configs cache the teacher's final hidden states: a rank holds the student, the teacher's head
    (151,936 x 2,048 in bf16) and the online KL's buffers, and fits an 80 GB GPU at 2 and 8 workers."""
    cfg = load_config(
        EXPERIMENTS / "qwen3_30b_a3b.yaml",
        [f"distill.workers={workers}", "distill.checkpointing=full", "distill.zero_stage=2"],
    )
    assert cfg.stage2.targets == "auto"  # the plan's choice: hidden states here
    plan = make_plan(cfg, qwen30b, Devices(gpu_memory=80 * 10**9))
    assert plan.problems() == [] and plan.targets["teacher"].mode == "hidden"
    s2, online = (
        plan.by_stage()["stage2"],
        make_plan(
            replace(cfg, stage2=replace(cfg.stage2, targets="online")), qwen30b, Devices(gpu_memory=80 * 10**9)
        ).by_stage()["stage2"],
    )
    assert s2.fits and "teacher" not in s2.parts and s2.parts["teacher head"] == 151_936 * 2048 * 2
    assert s2.parts["kl"] == online.parts["kl"]  # the same loss: the teacher's logits are formed chunk by chunk
    assert online.per_device - s2.per_device >= online.parts["teacher"] - s2.parts["teacher head"] - s2.parts["targets"]
    assert "log-softmax" not in plan.by_stage()["targets"].parts  # the pass stores states; no logits are formed


def test_storage_counts_checkpoints_students_tokens_and_targets(qwen30b):
    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml")
    plan = make_plan(cfg, qwen30b, Devices(gpu_memory=80 * 10**9))
    st, d, P = plan.storage, cfg.distill, models_of(qwen30b).student.params
    n = 7 * 5 + 2  # promoted pairs + baselines
    # an ended student's training state is removed: the checkpoints are held only while students train (all of them at
    # once here: no node types to bound it); stage2.keep_training_state keeps them
    assert "checkpoints" not in st and plan.storage_peak["checkpoints"] / n == d.keep_checkpoints * 14 * P
    assert 90e9 < plan.storage_peak["checkpoints"] / n < 97e9  # the issue's ~94 GB per student
    kept = make_plan(
        replace(cfg, stage2=replace(cfg.stage2, keep_training_state=True)), qwen30b, Devices(gpu_memory=80 * 10**9)
    )
    assert kept.storage["checkpoints"] == plan.storage_peak["checkpoints"] and not kept.storage_peak
    tokens = d.steps * d.batch_size * d.grad_accum * d.workers * d.seq_len
    assert (
        st["targets"] == tokens * 2048 * 2 and 1.2e12 < st["targets"] < 1.4e12
    )  # hidden: d x bf16 = 4 KiB/token, ~1.3 TB
    assert st["token shards"] == tokens * 4 + d.eval_max_tokens * 4
    j = json.loads(plan_line(plan))
    assert set(j) == {
        "gpu_memory",
        "stages",
        "storage_bytes",
        "storage_peak_bytes",
        "teacher_checkpoint_bytes",
        "targets",
        "seconds",
        "gpu_hours",
        "dollars",
        "bound",
    }  # bound: ASHA on
    assert j["targets"] == {"teacher": {"targets": "hidden", "shard_teacher": False}}
    assert j["storage_bytes"] == sum(st.values())
    assert j["storage_peak_bytes"] == sum(st.values()) + plan.storage_peak["checkpoints"]
    assert j["teacher_checkpoint_bytes"] == 2 * plan.models["teacher_params"]  # bf16 as published
    assert set(j["stages"]) == {"calibrate", "stage1", "targets", "stage2", "stage3", "analysis"}
    assert all(
        set(v) == {"per_gpu_bytes", "gpus", "fits", "flops", "seconds", "gpu_hours", "dollars"}
        for v in j["stages"].values()
    )
    # against cluster.yaml's node types: two 8 x H100 nodes hold two 8-rank students at once
    nodes = make_plan(cfg, qwen30b, Devices(nodes=tuple(from_cluster_yaml(ROOT / "cluster.yaml"))))
    assert nodes.storage_peak["checkpoints"] == 2 * d.keep_checkpoints * 14 * P


def test_unknown_gpu_memory_is_fits_null_in_the_json_and_the_plan_file(qwen30b):
    """No GPU and no --gpu-memory: the table's "?" is null in the JSON line and memory_plan.json, not true."""
    from m2d_ray.plan.run_plan import as_record

    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml")
    plan = make_plan(cfg, qwen30b, Devices())
    line, record = json.loads(plan_line(plan)), json.loads(json.dumps(as_record(plan)))
    assert line["stages"]["stage2"]["fits"] is None and record["stages"]["stage2"]["fits"] is None
    assert all(r["fits"] is None for r in record["rows"] if r["share"])
    known = json.loads(plan_line(make_plan(cfg, qwen30b, Devices(gpu_memory=80 * 10**9))))
    assert known["stages"]["stage2"]["fits"] is True
    cpu_only = (NodeType("head", {"CPU": 0}), NodeType("cpu_4x", {"CPU": 4}))
    assert (
        json.loads(plan_line(make_plan(cfg, qwen30b, Devices(nodes=cpu_only))))["stages"]["stage2"]["fits"] is False
    )  # no node type


@pytest.mark.parametrize(
    "path",
    sorted(p for p in (EXPERIMENTS).glob("*.yaml") if not p.name.startswith("_")),
    ids=lambda p: p.name,
)
def test_every_experiment_fits_the_node_types_of_cluster_yaml(path):
    """Each config's every stage has a node type of cluster.yaml that holds its request, and fits its GPU."""
    cfg = load_config(path)
    if cfg.model is not None and cfg.model not in OFFLINE and not (ROOT / cfg.model).exists():
        pytest.skip(f"{cfg.model} is absent (../shared, or a teacher a tutorial builds)")
    model = (
        str(CONFIGS / OFFLINE[cfg.model])
        if cfg.model in OFFLINE
        else (str(ROOT / cfg.model) if cfg.model else default_teacher())
    )
    nodes = tuple(from_cluster_yaml(ROOT / "cluster.yaml"))
    dense = OFFLINE.get(cfg.stage2.d2d_teacher)  # the d2d baseline's own teacher at its published shape
    own = {"teacher-d2d": model_config(str(CONFIGS / dense))} if dense else {}
    plan = make_plan(cfg, model_config(model), Devices(nodes=nodes), own)
    assert plan.problems() == []
    for s in plan.stages:
        assert s.holders, s.name
        if s.share:  # a GPU stage was checked against a known GPU
            assert s.fits is True, s.name


def test_a_request_no_node_type_holds_and_an_unknown_gpu_type_are_one_line():
    cfg = load_config(EXPERIMENTS / "tiny.yaml", ["distill.gpus_per_worker=1"])
    cpu_only = (NodeType("head", {"CPU": 0}), NodeType("cpu_4x", {"CPU": 4}))
    problems = make_plan(cfg, model_config(default_teacher()), Devices(nodes=cpu_only)).problems()
    assert problems and problems[0].startswith(
        "stage2: no node type can ever hold one rank (CPU 1, GPU 1; node types: head"
    )
    assert "distill.gpus_per_worker" in problems[0]
    pinned = load_config(EXPERIMENTS / "tiny.yaml", ["distill.gpus_per_worker=1", "distill.accelerator=H100"])
    a10g = (NodeType("g5", {"CPU": 8, "GPU": 1, "accelerator_type:A10G": 1}),)
    assert any(
        p.startswith("stage2: no node type")
        for p in make_plan(pinned, model_config(default_teacher()), Devices(nodes=a10g)).problems()
    )
    assert not [
        p
        for p in make_plan(cfg, model_config(default_teacher()), Devices(nodes=a10g)).problems()
        if p.startswith("stage2")
    ]
    with pytest.raises(M2DError, match=r"distill.accelerator='H10' is not a GPU type .* did you mean H100\?"):
        load_config(EXPERIMENTS / "tiny.yaml", ["distill.accelerator=H10"])


def test_an_unpinned_stage_is_placed_on_the_cheapest_gpu_type_that_holds_it_and_pinned_there(qwen30b):
    """distill.accelerator unset: the 8 ranks go to a node type that holds all 8 (never the 1-GPU A10G types) whose GPU
    a rank fits, the cheapest of those (H100 before H200); the choice is recorded for the run's config and its Ray
    request pins it. Pinned to a GPU a rank does not fit, the plan keeps the pin and refuses it in one line."""
    nodes = tuple(from_cluster_yaml(ROOT / "cluster.yaml"))
    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", ["distill.accelerator=null", "stage3.accelerator=H100"])
    placed = make_plan(cfg, qwen30b, Devices(nodes=nodes))
    rank = placed.by_stage()["stage2"]
    assert placed.decided["distill.accelerator"] == "H100" and "distill.accelerator=H100" in placed.overrides()
    assert rank.holders == ("gpu_h100_8x",) and rank.fits is True and rank.request["accelerator_type:H100"] > 0
    (line,) = [n for n in placed.decision_lines() if n.startswith("distill.accelerator=")]
    assert line.startswith("distill.accelerator=H100: placed by the plan on gpu_h100_8x") and "A10G" not in line
    assert "H100: fits, $" in line and "H200: fits, $" in line
    applied = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", placed.overrides())  # what `m2d run` records
    from m2d_ray.stages.stage2 import STAGE

    assert STAGE.request(applied)["accelerator_type:H100"] > 0
    data = make_plan(replace(cfg, ray=replace(cfg.ray, data_accelerator=None)), qwen30b, Devices(nodes=nodes))
    (line,) = [n for n in data.decision_lines() if n.startswith("ray.data_accelerator=")]
    prices = {k: float(v.replace(",", "")) for k, v in re.findall(r"(\w+): fits, \$([\d,.]+)", line)}
    assert set(prices) == {"A10G", "H100", "H200"} and data.decided["ray.data_accelerator"] == min(
        prices, key=prices.get
    )
    bill = data.cost.by_name()  # the calibration and the targets pass, as the line priced the choice
    assert bill["calibrate"].dollars + bill["targets"].dollars == pytest.approx(min(prices.values()), abs=0.5)
    alone = make_plan(cfg, qwen30b, Devices(gpu_memory=80 * 10**9)).cost.by_name()["stage2"]  # no node types
    assert alone.device == "8 x H100" and alone.seconds > 0  # priced at the GPU type of that memory
    small = make_plan(load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", ["distill.accelerator=A10G"]), qwen30b,
                      Devices(nodes=nodes))  # fmt: skip
    assert "distill.accelerator" not in small.decided
    refused = small.problems()[0]
    assert refused.startswith("stage2: one rank needs") and "but 1 GPU of 22.5 GiB gives it" in refused


def test_cluster_yaml_of_the_wrong_shape_is_one_line(tmp_path):
    with pytest.raises(M2DError, match="not found"):
        from_cluster_yaml(tmp_path / "nope.yaml")
    (tmp_path / "c.yaml").write_text("cluster_name: x\n")
    with pytest.raises(M2DError, match="no available_node_types"):
        from_cluster_yaml(tmp_path / "c.yaml")


def test_peaks_measure_the_work_after_a_reset():
    from m2d_ray.peaks import peaks, reset_peaks

    reset_peaks()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    p = peaks()
    del block
    assert p["peak_rss_bytes"] >= p["peak_work_bytes"] >= 60 * 2**20
    reset_peaks()
    assert peaks()["peak_work_bytes"] < 60 * 2**20  # the earlier peak is not the next work's


def test_the_report_sets_planned_beside_measured():
    from m2d_ray.report.analysis import RunData, memory_rows

    plan = {
        "rows": [
            {"name": "stage2", "unit": "rank", "per_device": 100, "fits": True},
            {"name": "stage3:student", "unit": "student", "per_device": 50, "fits": True},
            {"name": "stage3:teacher", "unit": "teacher", "per_device": 80, "fits": False},
        ]
    }
    stage2 = {
        "a": {"peak_work_bytes": 90, "peak_rss_bytes": 900, "student_path": "s/a"},
        "b": {"peak_cuda_bytes": 120, "student_path": "s/b"},
        "c": {"peak_work_bytes": 999, "duplicate_of": "a"},
    }
    stage3 = {"a": {"peak_work_bytes": 40}, "b": {"peak_work_bytes": 45}, "teacher": {"peak_rss_bytes": 70}}
    data = RunData(Path("."), None, [], {}, {}, stage2=stage2, stage3=stage3, memory_plan=plan)
    rows = {r["stage"]: r for r in memory_rows(data)}
    assert (
        rows["stage2"]["measured"] == 120 and rows["stage2"]["ratio"] == 1.2
    )  # the largest student; a duplicate is not one
    assert (
        rows["stage3:student"]["measured"] == 45
        and rows["stage3:teacher"]["measured"] == 70
        and rows["stage3:teacher"]["fits"] is False
    )
    assert memory_rows(RunData(Path("."), None, [], {}, {})) == []


def test_a_paper_config_on_a_cluster_of_one_gpu_kind_is_told_which_key_to_change(qwen30b):
    """_paper.yaml pins stage-1 trials to cluster.yaml's A10G; on H100s alone the plan names that key and the GPU the
    cluster has, and with it set the whole paper run plans there."""
    h100s = (
        NodeType("head", {"CPU": 8, "GPU": 0}),
        NodeType("h100", {"CPU": 192, "GPU": 8, "accelerator_type:H100": 1}),
    )
    paper = EXPERIMENTS / "qwen3_30b_a3b.yaml"
    problems = make_plan(load_config(paper), qwen30b, Devices(nodes=h100s)).problems()
    assert len(problems) == 1 and problems[0].startswith("stage1: no node type can ever hold one trial"), problems
    assert "ray.trial_accelerator=A10G (no node type has an A10G: set ray.trial_accelerator=H100" in problems[0]
    for fix in ("ray.trial_accelerator=H100", "ray.trial_accelerator=null"):
        assert make_plan(load_config(paper, [fix]), qwen30b, Devices(nodes=h100s)).problems() == [], fix


def test_spot_trials_ask_for_the_spot_node_type_and_are_priced_there(qwen30b):
    """ray.spot_trials: stage-1 trials ask for the `spot` resource, so only cluster.yaml's spot type holds them, at
    its spot price; a cluster without one is told so."""
    nodes = tuple(from_cluster_yaml(ROOT / "cluster.yaml"))
    paper = EXPERIMENTS / "qwen3_30b_a3b.yaml"
    plans = {
        on: make_plan(load_config(paper, [f"ray.spot_trials={on}"]), qwen30b, Devices(nodes=nodes))
        for on in (False, True)
    }
    stage1 = {on: next(s for s in p.stages if s.name == "stage1") for on, p in plans.items()}
    assert stage1[True].request["spot"] > 0 and "spot" not in stage1[False].request
    assert stage1[True].holders == ("gpu_a10g_1x_spot",) and "gpu_a10g_1x" in stage1[False].holders
    bills = {on: p.cost.by_name()["stage1"].dollars for on, p in plans.items()}
    assert 0 < bills[True] < bills[False]
    without = tuple(n for n in nodes if not n.spot)
    problems = make_plan(load_config(paper, ["ray.spot_trials=true"]), qwen30b, Devices(nodes=without)).problems()
    assert problems[0].startswith("stage1: no node type") and "ray.spot_trials" in problems[0]


def test_no_shipped_config_sets_ray_address():
    """One rule (config.RayConfig.address): a config leaves ray.address unset; `ray job submit` and a RayJob give the
    driver RAY_ADDRESS, and elsewhere m2d starts a local Ray."""
    for path in sorted((EXPERIMENTS).glob("*.yaml")):
        assert load_config(path).ray.address is None, path.name


def test_checkpointing_auto_is_the_least_recompute_that_fits_and_never_enlarges_a_refusal(qwen30b):
    """The paper student at one rank from cached states: none where it fits, then selective, then full; on a GPU too
    small for any, full (the rank refused at its smallest), said in one note with what each policy tried needs."""
    one_rank = ["distill.workers=1", "distill.deepspeed=false", "stage2.targets=hidden", "distill.accelerator=null"]
    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", one_rank)

    def at(gb: int):
        return make_plan(cfg, qwen30b, Devices(gpu_memory=gb * 10**9))

    assert [at(gb).decided["distill.checkpointing"] for gb in (200, 141, 80)] == ["none", "selective", "full"]
    (line,) = [n for n in at(141).decision_lines() if n.startswith("distill.checkpointing")]
    assert re.fullmatch(r"distill\.checkpointing=auto: selective \(none: [\d.]+ GiB a rank; selective: fits\)", line)
    small = at(40)
    assert small.decided["distill.checkpointing"] == "full" and small.decided["distill.zero_stage"] == "2"  # 1 rank
    (line,) = [n for n in small.decision_lines() if n.startswith("distill.checkpointing")]
    assert line.startswith("distill.checkpointing=auto: full (none: ") and "; full: " in line
    rank = small.by_stage()["stage2"]
    assert not rank.fits and rank.parts["activations"] == at(80).by_stage()["stage2"].parts["activations"]
    assert any(p.startswith("stage2: one rank needs") for p in small.problems())


def test_the_235b_study_plans_fitting_on_cluster_yaml_with_its_decisions_said(capsys):
    """Qwen3-235B-A22B by its shipped hub name: stage 1's 22B students move from half an A10G to a whole H100, stage
    2 shards them with ZeRO-3 over one 8 x H100 node; every stage fits, the bill is printed, exit 0; the 30B study
    keeps half an A10G and ZeRO-2."""
    from m2d_ray.cli import main

    args = ["plan", "qwen3_30b_a3b", "--cluster", str(ROOT / "cluster.yaml"), "--model"]
    assert main([*args, "Qwen/Qwen3-235B-A22B"]) == 0
    out = capsys.readouterr().out
    assert "ray.gpus_per_trial=auto: 1 of an H100 (a trial needs 46.3 GiB; 0.5 of an H100 gives" in out
    assert "distill.zero_stage=auto: 3 (2: 113.8 GiB a rank; 3: fits)" in out
    assert " NO " not in out and "the bill" in out and '"stages"' not in out
    assert main([*args, "Qwen/Qwen3-30B-A3B"]) == 0
    out = capsys.readouterr().out
    assert "ray.gpus_per_trial=auto: 0.5 of an A10G" in out and "distill.zero_stage=auto: 2 (2: fits)" in out


def _deepseek_v3_stage3(tmp_path, *overrides):
    from m2d_ray.pipeline import STAGES

    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", list(overrides))
    nodes = Devices(nodes=tuple(from_cluster_yaml(ROOT / "cluster.yaml")))
    teacher = model_config(str(CONFIGS / "deepseek-ai--DeepSeek-V3"))
    return make_plan(cfg, teacher, nodes, stages=STAGES.only("stage3", "analysis"))


def test_a_teacher_no_node_holds_is_refused_naming_its_scores_file_or_read_from_it(tmp_path):
    """DeepSeek-V3 in bf16 (164 GiB a GPU over 8) fits no 8-GPU node of cluster.yaml: stage 3 refuses it in one line
    naming what would do instead, and the analysis plans its judge (which only scores) a decoder layer at a time; with
    stage3.teacher_scores it is read, said in a note, never silently left out; a file without scores is refused in one
    line."""
    from m2d_ray.stages.stage3 import teacher_scores

    refused = _deepseek_v3_stage3(tmp_path)
    lines = {line.split(":")[0] + ":" + line.split(":")[1]: line for line in refused.problems()}
    assert "stage3.teacher_scores=FILE" in lines["stage3:teacher"] and list(lines) == ["stage3:teacher"], lines
    (judge,) = [u for u in refused.stages if u.name == "analysis:teacher"]
    assert judge.unit == "teacher, streamed a decoder layer at a time" and judge.fits, judge
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"tasks": {"mmlu": {"score": 0.88}, "arc_challenge": {"score": 0.66}}}))
    read = _deepseek_v3_stage3(tmp_path, f"stage3.teacher_scores={scores}")
    assert read.problems() == [] and "stage3:teacher" not in [r.name for r in read.stages]
    assert any(n.startswith(f"stage3:teacher: its scores read from {scores}") for n in read.notes)
    assert teacher_scores(str(scores))["mean"] == pytest.approx(0.77)
    scores.write_text('{"mmlu": "high"}')
    with pytest.raises(M2DError, match="holds no scores"):
        teacher_scores(str(scores))


def test_deepseek_v3_s_stages_are_each_placed_on_the_node_type_that_holds_them(capsys, tmp_path):
    """DeepSeek-V3 by its shipped hub name, nothing pinned but the paper's data passes: the 37B students' ZeRO-3 ranks
    on the 8 x H200 node (114 GiB a rank: an H100 gives 75.7), stage 3 and the analysis where their models fit, each
    choice in one line, the Ray requests pinned to it; with the teacher's scores from a file every stage fits and the
    bill is printed (exit 0): the teacher as judge (the default), which no node holds (164 GiB a GPU over 8 in bf16),
    scores a decoder layer at a time; a user's pin to the H100 is kept and refused in one line."""
    from m2d_ray.cli import main
    from m2d_ray.pipeline import STAGES, plan_run

    scores = tmp_path / "scores.json"
    scores.write_text('{"mmlu": 0.88}')
    args = ["plan", "qwen3_30b_a3b", "--cluster", str(ROOT / "cluster.yaml"), "--model", "deepseek-ai/DeepSeek-V3"]
    assert main([*args, f"stage3.teacher_scores={scores}", "--json"]) == 0
    out = capsys.readouterr().out
    assert "distill.accelerator=H200: placed by the plan on gpu_h200_8x" in out
    assert "(H100: stage2 needs 114.3 GiB a rank, 75.7 GiB there; H200: fits, $" in out
    assert re.search(r"stage3.accelerator=H[12]00: placed by the plan on gpu_h[12]00_8x", out), out
    assert "ray.gpus_per_trial=auto: 1 of an H200" in out and "distill.zero_stage=auto: 3" in out
    assert " NO " not in out and "the bill" in out
    assert json.loads(out.strip().splitlines()[-1])["stages"]["stage2"]["fits"] is True
    cluster = Devices(nodes=tuple(from_cluster_yaml(ROOT / "cluster.yaml")))

    def problems(stages, *overrides):
        cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", [f"stage3.teacher_scores={scores}", *overrides])
        return plan_run(cfg, cluster, "deepseek-ai/DeepSeek-V3", STAGES.only(*stages)).problems()

    given = [f"stage3.teacher_scores={scores}"]
    placed = plan_run(load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", given), cluster, "deepseek-ai/DeepSeek-V3")
    assert placed.decided["distill.accelerator"] == "H200" and placed.problems() == []
    recorded = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", [*given, *placed.overrides()])  # the run's config
    resumed = plan_run(recorded, cluster, "deepseek-ai/DeepSeek-V3")  # a resume plans it as recorded
    assert resumed.decided == {} and resumed.problems() == []
    assert resumed.by_stage()["stage2"].request["accelerator_type:H200"] > 0
    assert problems(["stage3", "analysis"]) == []
    assert "teacher, streamed a decoder layer at a time" in out
    pinned = problems(["stage2"], "distill.accelerator=H100")[0]  # (and stage2.targets=auto: no exact mode fits)
    assert pinned.startswith("stage2: one rank needs 114.3 GiB") and "gives it 75.7 GiB" in pinned
    assert pinned.endswith("or leave distill.accelerator unset (null: the plan places it on the cheapest GPU type that "
                           "holds it)")  # fmt: skip


@pytest.mark.parametrize(
    ("hub", "params", "active", "judge_gpus"),
    [("Qwen/Qwen3-Coder-480B-A35B-Instruct", 480.2e9, 35.5e9, 8), ("zai-org/GLM-4.5", 352.8e9, 33.6e9, 6)],
)
def test_the_other_flagships_plan_fitting_on_cluster_yaml_by_their_shipped_hub_names(capsys, hub, params, active,
                                                                                      judge_gpus):  # fmt: skip
    """Qwen3-Coder-480B-A35B-Instruct and GLM-4.5 (published in bf16; GLM-4.5's count leaves out its MTP layer) by
    their shipped config.json: every stage fits cluster.yaml with nothing set, the teacher's lm-eval and its judging
    placed on the 8 x H200 node (an H100 node cannot hold the bf16 teacher), the ZeRO-3 ranks there too, the trials
    on a whole H100; exit 0 with the bill."""
    from m2d_ray import shipped
    from m2d_ray.cli import main

    m = models_of(model_config(str(shipped.shape(hub))))
    assert m.teacher.params == pytest.approx(params, rel=1e-3) and m.teacher.dtype_bytes == 2
    assert m.teacher.params - m.teacher.inactive_expert_params == pytest.approx(active, rel=1e-3)
    assert main(["plan", "qwen3_30b_a3b", "--cluster", str(ROOT / "cluster.yaml"), "--model", hub]) == 0
    out = capsys.readouterr().out
    assert " NO " not in out and "the bill" in out and "ray.gpus_per_trial=auto: 1 of an H100" in out
    assert "distill.zero_stage=auto: 3" in out and "distill.accelerator=H200: placed by the plan on gpu_h200_8x" in out
    line = next(x for x in out.splitlines() if "stage3.accelerator=" in x)
    assert "stage3.accelerator=H200: placed by the plan" in line and "H100: stage3:teacher needs" in line, line
    assert f"analysis:teacher  teacher, sharded over {judge_gpus}" in out


def test_a_trial_no_gpu_holds_whole_is_spread_over_whole_gpus_of_one_node():
    """DeepSeek-V3's 37B student (78.6 GiB a trial) on a cluster without the H200 nodes: no GPU holds it whole, so
    ray.gpus_per_trial=auto gives it 2 H100s of one node and its layers are spread over them in order; the plan counts
    a GPU's part (the larger half of the weights, evaluate/split.py) and says it in one line; the request asks for
    both."""
    from m2d_ray.evaluate.split import decoder_sizes, largest
    from m2d_ray.pipeline import STAGES

    nodes = tuple(n for n in from_cluster_yaml(ROOT / "cluster.yaml") if n.accelerator != "H200")
    teacher = model_config(str(CONFIGS / "deepseek-ai--DeepSeek-V3"))
    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml")
    out = make_plan(cfg, teacher, Devices(nodes=nodes), stages=STAGES.only("stage1"))
    (row,) = out.stages
    s = models_of(teacher).student
    half = largest(decoder_sizes(s.params, s.layers, s.layer_params, s.vocab, s.hidden, s.tied, s.dtype_bytes), 2)
    assert row.unit == "trial, spread over 2" and row.fits and row.parts["student"] == half < 0.55 * s.weights
    assert row.request["GPU"] == 2 and row.request["accelerator_type:H100"] > 0 and row.holders == ("gpu_h100_8x",)
    assert out.decided["ray.gpus_per_trial"] == "2.0" and out.decided["ray.trial_accelerator"] == "H100"
    (line,) = [n for n in out.decision_lines() if n.startswith("ray.gpus_per_trial")]
    assert line.startswith("ray.gpus_per_trial=auto: 2 H100s, the student spread over 2 GPUs (its layers in order)")
    assert "(a trial needs 78.6 GiB whole, " in line and "1 of an H100 gives 75.7 GiB" in line


def test_the_zero3_rank_of_the_22b_student_is_within_15_percent_of_a_meta_count():
    """benchmarks/perf/zero3_rank.py: the 22B student's partitions over 8 ranks, DeepSpeed's reduce bucket, the
    layers and head gathered whole, and a micro-batch's activations and KL counted on `meta` under full checkpointing
    (each gradient freed as ZeRO-3 frees it): the plan's rank within 15% of that count, part by part for the arithmetic
    ones."""
    cmd = [sys.executable, "-m", "benchmarks.perf.zero3_rank", "--world", "8", "--checkpointing", "full"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["student_params"] == pytest.approx(22.14e9, rel=0.01)
    for part in ("student", "grads", "optimizer"):
        assert r["planned_gib"][part] == pytest.approx(r["counted_gib"][part], rel=0.01), part
    assert 0.85 <= r["ratio"] <= 1.15, r
