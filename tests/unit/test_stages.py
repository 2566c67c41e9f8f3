"""Stage-1 pieces without Ray: grid, plan-signature dedupe, the stopping rule, trials, promotion, tables."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from m2d_ray.calibrate import calibrate
from m2d_ray.config import EvalConfig, GridConfig
from m2d_ray.convert.build import build_from_plan
from m2d_ray.data.synthetic import corpus_text
from m2d_ray.data.text import calibration_set, tokenize
from m2d_ray.evaluate.perplexity import perplexity
from m2d_ray.report.stage1 import heatmap, write_tables
from m2d_ray.runtime.scheduler import hopeless
from m2d_ray.stages.grid import dedupe, expand, plan_all, plan_of
from m2d_ray.stages.promote import promote, unpromoted
from m2d_ray.stages.trial import chunk_ends, run_trial

GRID = GridConfig(
    scoring=("sf", "cp", "do-acp"), grouping=("rr", "ab", "oc"), scaling=("uniform", "proportional"), K="auto"
)


@pytest.fixture(scope="module")
def stats(tiny_teacher):
    tokens = calibration_set(
        tiny_teacher.tokenizer, corpus_text("valid", max_chars=20_000), seq_len=64, max_tokens=2048
    )
    return calibrate(tiny_teacher, tokens, "synthetic:valid", out=None, progress=False)[0].layers


@pytest.fixture(scope="module")
def grid_plans(tiny_teacher, stats):
    specs = expand(GRID, k=2, E=8)
    return specs, plan_all(tiny_teacher, stats, specs)


def test_expand_is_the_full_product_in_table_order():
    specs = expand(GRID, k=2, E=8)
    assert len(specs) == 3 * 3 * 2 * 3 and len({s.key for s in specs}) == len(specs)
    assert [s.K for s in specs[:3]] == [2, 4, 8] and specs[0].key == "sf_rr_uniform_K2"


def test_dedupe_members_build_bitwise_identical_students(tiny_teacher, grid_plans):
    specs, plans = grid_plans
    uniques = dedupe(specs, plans)
    assert sum(len(u.members) for u in uniques) == len(specs)
    # at K = k every grouping is singletons: one student per (scoring, scaling)
    at_k = [u for u in uniques if u.canonical.K == 2]
    assert len(at_k) <= 3 * 2 and all({m.grouping for m in u.members} == {"rr", "ab", "oc"} for u in at_k)

    def state(key):
        return build_from_plan(tiny_teacher, plan_of(plans, key)).state_dict()

    for u in uniques:
        ref = state(u.canonical.key)
        for m in u.members[1:]:
            assert all(torch.equal(ref[n], t) for n, t in state(m.key).items()), (u.canonical.key, m.key)
    # and distinct signatures really are distinct students (their FFN weights differ somewhere)
    ffns = {}
    for u in uniques:
        w = torch.cat([t.flatten() for n, t in state(u.canonical.key).items() if ".mlp." in n])
        assert all(not torch.equal(w, o) for o in ffns.values()), u.canonical.key
        ffns[u.canonical.key] = w


def test_dedupe_ignores_names_and_can_be_off(grid_plans):
    specs, plans = grid_plans
    # two different scorings that happen to give the same plan are merged (names are not in the signature)
    fake = {**plans, specs[1].key: {**plans[specs[1].key], "signature": plans[specs[0].key]["signature"]}}
    assert dedupe(specs[:2], fake)[0].members == (specs[0], specs[1])
    assert len(dedupe(specs, plans, enabled=False)) == len(specs)


@pytest.mark.parametrize(
    "ppl, chunk, best, expected",
    [
        (100.0, 1, {"a/x": {1: 50.0}}, True),  # 2x worse than the pair's best
        (70.0, 1, {"a/x": {1: 50.0}}, False),  # within the factor
        (100.0, 2, {"a/x": {1: 50.0}}, False),  # nothing to compare at chunk 2
        (100.0, 0, {"a/x": {0: 50.0}}, False),  # grace
        (math.inf, 0, {}, True),  # diverged
        (100.0, 1, {"b/y": {1: 10.0}}, False),  # another pair's best does not count
    ],
)
def test_hopeless_rule(ppl, chunk, best, expected):
    assert hopeless(ppl, chunk, ["a/x"], best, factor=1.5, grace=1) is expected


def test_hopeless_needs_every_pair_of_a_shared_student():
    best = {"a/x": {1: 10.0}, "a/y": {1: 90.0}}
    assert not hopeless(100.0, 1, ["a/x", "a/y"], best, 1.5, 1)
    assert hopeless(100.0, 1, ["a/x"], best, 1.5, 1)


def test_chunk_ends():
    assert chunk_ends(10, 3) == {4, 7, 10}
    assert chunk_ends(2, 6) == {1, 2}
    assert chunk_ends(5, 1) == {5}


def test_run_trial_reports_chunks_then_the_full_perplexity(tiny_teacher, grid_plans):
    specs, plans = grid_plans
    plan = plan_of(plans, "do-acp_oc_proportional_K4")
    ids = tokenize(tiny_teacher.tokenizer, corpus_text("test", max_chars=20_000))
    cfg = EvalConfig(data="-", seq_len=64, batch_size=4, chunks=3)
    out = list(run_trial(tiny_teacher, plan, ids, cfg))
    assert [r["chunk"] for r in out] == [1, 2, 3] and [r["final"] for r in out] == [False, False, True]
    assert out[0]["tokens"] < out[1]["tokens"] < out[2]["tokens"]
    ref = perplexity(build_from_plan(tiny_teacher, plan), ids, seq_len=64, batch_size=4)
    assert out[-1]["ppl"] == pytest.approx(ref.ppl, rel=1e-12) and out[-1]["tokens"] == ref.tokens
    poisoned = list(run_trial(tiny_teacher, plan, ids, cfg, poison=True))
    assert len(poisoned) == 1 and poisoned[0]["diverged"] and poisoned[0]["final"]
    spread = list(run_trial(tiny_teacher, plan, ids, cfg, devices=3))  # the several-GPU branch, on three `cpu`s
    assert [r["nll"] for r in spread] == [r["nll"] for r in out]


def _rec(s, g, c, K, status, ppl):
    return {
        "scoring": s,
        "grouping": g,
        "scaling": c,
        "K": K,
        "status": status,
        "ppl": ppl,
        "key": f"{s}_{g}_{c}_K{K}",
        "signature": "x",
    }


RECORDS = [
    _rec("sf", "rr", "uniform", 2, "ok", 30.0),
    _rec("sf", "rr", "uniform", 4, "ok", 20.0),
    _rec("sf", "rr", "proportional", 2, "ok", 20.0),  # tie with K=4: the smaller K wins
    _rec("sf", "rr", "proportional", 4, "pruned", None),
    _rec("cp", "oc", "uniform", 2, "diverged", None),
    _rec("cp", "oc", "uniform", 4, "failed", None),
]


def test_promotion_picks_the_best_finished_config():
    p = promote(RECORDS, ["uniform", "proportional"])
    assert list(p) == ["sf/rr"] and (p["sf/rr"]["K"], p["sf/rr"]["scaling"]) == (2, "proportional")
    assert unpromoted(RECORDS) == ["cp/oc"]


def test_tables_in_the_paper_layout(tmp_path):
    order = {"scoring": ["sf", "cp"], "grouping": ["rr", "oc"], "scaling": ["uniform", "proportional"]}
    write_tables(RECORDS, order, tmp_path)
    rows = list(csv.reader((tmp_path / "stage1.csv").open()))
    assert rows[0] == ["scoring", "grouping", "scaling", "K=2", "K=4"]
    assert rows[1] == ["sf", "rr", "uniform", "30", "20"] and rows[2] == ["sf", "rr", "proportional", "20", "pruned"]
    assert rows[3] == ["cp", "oc", "uniform", "diverged", "failed"]
    md = (tmp_path / "stage1.md").read_text()
    assert "| CP | OC | uniform | -- | failed |" in md
    assert heatmap(RECORDS, order, tmp_path / "h.png").stat().st_size > 1000


def test_gpu_use_is_decided_by_the_config_not_by_the_gpus_up_now(monkeypatch):
    """A cluster that scales GPU nodes from zero has no GPU when a stage starts: asking is what starts them."""
    import ray

    from m2d_ray.config import load_config

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 0.0})
    gpu = load_config(None, ["distill.gpus_per_worker=1"])
    assert gpu.stage3_gpus() == 1.0 and gpu.students_at_once() is None  # Ray queues the students
    assert load_config(None, ["ray.gpus_per_trial=0.25"]).stage3_gpus() == 1.0
    cpu = load_config(None)
    assert cpu.stage3_gpus() == 0.0 and cpu.students_at_once() == cpu.ray.max_concurrent_trials
    assert load_config(None, ["stage3.gpus_per_task=0.5"]).stage3_gpus() == 0.5
    assert load_config(None, ["distill.gpus_per_worker=1", "stage2.max_concurrent_trials=3"]).students_at_once() == 3


def test_a_promoted_plan_repeated_by_another_pair_is_distilled_once():
    """Stage 2 distils the better-ranked of two promotions with one plan signature; the other gets its record."""
    from m2d_ray.stages.students import Student, duplicates

    todo = [
        Student("a", "sf/rr", 1.0),
        Student("b", "sf/oc", 1.0),
        Student("c", "cp/rr", 2.0),
        Student("baseline-random-ffn", "random-ffn", None, "random-ffn"),
    ]
    plans = {"a": {"signature": "s1"}, "b": {"signature": "s1"}, "c": {"signature": "s2"}}
    assert duplicates(todo, plans) == {"b": "a"}
    assert duplicates(todo[2:], plans) == {}


def test_a_local_ray_is_checked_against_its_live_node_though_its_monitor_reports_a_status(ray_address):
    """A local Ray's monitor publishes an autoscaler status too, but no node will ever join: a run on it is planned
    against the live node (a GPU request is refused before calibration), not waved through as 'node types unknown'."""
    import time

    from m2d_ray.runtime.ray_env import _autoscaler_running, node_types

    deadline = time.time() + 60
    while not _autoscaler_running() and time.time() < deadline:
        time.sleep(0.5)
    assert _autoscaler_running()
    nodes, where = node_types()
    assert where == "the live nodes" and len(nodes) == 1 and nodes[0].gpus == 0
