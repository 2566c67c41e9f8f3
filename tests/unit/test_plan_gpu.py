"""The bill on a GPU from measurements (m2d_ray/measured_gpu.json): stage 2 priced at its targets mode's efficiency,
each unit's start-up on a GPU fit on a whole run's walls, and the tiny run's bill within 2x of the walls it was
measured at; the acceptance call writes the file in the form the code reads."""

from __future__ import annotations

import dataclasses
import json

import pytest

from m2d_ray import measured
from m2d_ray.config import PlanConfig, load_config
from m2d_ray.plan.cost import Place, stage_cost
from m2d_ray.plan.fit import fit_starts
from m2d_ray.shipped import EXPERIMENTS
from workshop import measured_write as acc


def test_the_tiny_runs_bill_on_its_gpu_is_within_2x_of_its_measured_walls():
    """Each stage of the whole tiny run, planned on the machine it ran on (its CPUs, its one GPU), against the wall
    that machine measured (benchmarks/gpu/acceptance.py's run part)."""
    m = measured.gpu()
    bill = acc.run_walls(m)
    walls = m.run["walls_s"]
    unbilled = {s: w for s, w in walls.items() if s not in bill}  # the report: no stage of the bill, ~1 s
    assert sum(unbilled.values()) <= 0.01 * sum(walls.values()), unbilled
    assert set(bill) <= set(walls), set(bill) - set(walls)
    ratios = {s: bill[s] / wall for s, wall in walls.items() if s in bill}
    assert all(0.5 <= r <= 2.0 for r in ratios.values()), ratios


def test_the_start_ups_are_the_fit_of_the_measured_walls_not_hand_set():
    m = measured.gpu()
    assert acc.fitted_starts(m) == pytest.approx(m.start_s, rel=0.01)
    assert PlanConfig().gpu_start_s == m.start_s and PlanConfig().efficiency == m.efficiency


def test_fit_starts_recovers_the_start_ups_of_a_linear_bill():
    """Three stages, two unit kinds: walls = base + waves x start; the fit gives back the starts exactly, and a kind
    two stages share takes the geometric mean of what each says."""
    waves = {"a": ("actor", 2), "b": ("actor", 1), "c": ("student", 3)}
    base = {"a": 10.0, "b": 10.0, "c": 5.0}

    def walls(starts):
        return {s: base[s] + n * starts[u] for s, (u, n) in waves.items()}

    true = {"actor": 7.0, "student": 20.0}
    assert fit_starts(walls, walls(true), ["actor", "student", "model"]) == {"actor": 7.0, "student": 20.0}
    skewed = {**walls(true), "b": 10.0 + 28.0}  # b alone says 28 s, a says 7: the mean in log space, 14
    assert fit_starts(walls, skewed, ["actor", "student"])["actor"] == pytest.approx(14.0)


def test_a_stage2_student_computes_at_its_targets_modes_efficiency():
    cfg = load_config(EXPERIMENTS / "tiny.yaml", ["plan.efficiency={online: 0.2, hidden: 0.4}"])
    where = Place(gpus=1.0, threads=1, lanes=1, accelerator="H200", node=None)
    flops = 989e12 * 100  # 100 s at the full peak

    def seconds(work):
        return stage_cost(cfg, "s", [flops], where, 0.0, None, {}, 0.0, rounds=0, work=[work]).seconds

    assert seconds("online") == pytest.approx(500.0) and seconds("hidden") == pytest.approx(250.0)
    assert seconds("forward") == pytest.approx(100 / measured.gpu().efficiency["forward"])  # a key left out: measured


def test_the_acceptance_call_writes_the_measured_file_in_the_form_the_code_reads():
    """What P7 and the run measured replaces the packaged figures (the start-ups refit on the new walls); what no part
    measured is carried over; the next call's priors read each part's seconds by its variant."""
    m = measured.gpu()
    walls = {s: w * 1.5 for s, w in m.run["walls_s"].items()}
    at = {"device": "NVIDIA H200", "loss": "fkl", "temperature": 1.0, "path": "plain", "tokens": 4096}  # P7's
    results = {
        "env": "torch 2.11, NVIDIA H200 x 1",
        "parts": {
            "P7": {
                "variant": "v0",
                "seconds": 201.0,
                "status": "ok",
                "efficiency": {"modes": {"online": {"efficiency": 0.25}, "sampled:64": {"efficiency": 0.31}}},
                "kl_kernel": {"online": {"kernel": "compiled", **at}, "hidden": {"kernel": "chunked", **at}},
            },
            "P7-head": {  # the real head's choice is the one auto uses
                "variant": "v0",
                "seconds": 120.0,
                "status": "ok",
                "kl_kernel": {"online": {"kernel": "liger", **at}, "hidden": {"kernel": "chunked", **at}},
            },
            "run": {
                "variant": "v0",
                "seconds": 350.0,
                "status": "ok",
                "walls": walls,
                "overrides": m.run["overrides"],
                "machine": {"cpus": m.run["cpus"], "gpus": m.run["gpus"]},
            },
            "tokens": {"status": "skipped", "why": "..."},
            "memory": {"variant": "v0", "seconds": 3.0, "status": "FAILED: plan_measured failed"},
            "P5": {"variant": "v0", "seconds": 400.0, "status": "TIMED OUT: killed after 400 s"},
        },
    }
    out = acc.measured_file(results, "NVIDIA H200", "2026-12-01")
    new = measured.GpuMeasured.from_dict(json.loads(json.dumps(out)))
    assert new.efficiency == {**m.efficiency, "online": 0.25, "sampled": 0.31}
    assert new.kl_kernel == {"online": {"kernel": "liger", **at}, "hidden": {"kernel": "chunked", **at}}
    assert new.run["walls_s"] == pytest.approx(walls, abs=0.06)
    assert all(new.start_s[u] > m.start_s[u] for u in ("trial", "student", "model"))  # slower walls, later starts
    assert new.parts_s["P7"] == {"variant": "v0", "seconds": 201.0}
    assert new.parts_s.get("tokens") == m.parts_s.get("tokens")  # what no part measured is carried over
    assert new.parts_s["P7-head"] == {"variant": "v0", "seconds": 120.0}
    # a part's planned time comes from its last successful run only: a failure's or a timeout's seconds are not kept
    assert new.parts_s.get("memory") == m.parts_s.get("memory") and new.parts_s.get("P5") == m.parts_s.get("P5")
    with pytest.raises(ValueError, match="missing"):
        measured.GpuMeasured.from_dict({k: v for k, v in out.items() if k != "run"})


def test_a_targets_mode_the_file_lacks_is_added_and_an_unknown_one_refused(monkeypatch):
    """The writer takes what was measured of a mode the packaged file does not hold yet (a new targets mode can be
    added), by its kind, and refuses what the plan would never read."""
    m = measured.gpu()
    monkeypatch.setattr(acc, "gpu", lambda: dataclasses.replace(m, efficiency={"online": 0.26}))

    def written(modes: dict) -> dict:
        p7 = {"efficiency": {"modes": {k: {"efficiency": x} for k, x in modes.items()}}}
        return acc.measured_file({"env": "e", "parts": {"P7": p7}}, "NVIDIA H200", "today")["efficiency"]

    assert written({"topk:32": 0.28}) == {"online": 0.26, "topk": 0.28}
    with pytest.raises(ValueError, match="known modes"):
        written({"logits": 0.3})
    with pytest.raises(ValueError, match="fraction"):
        written({"hidden": 3.0})


def test_the_next_calls_priors_are_what_the_last_one_measured(monkeypatch):
    m = measured.gpu()
    monkeypatch.setattr(acc, "gpu", lambda: dataclasses.replace(m, parts_s={"run": {"variant": "x", "seconds": 99.0}}))
    assert (
        acc.prior("run", "x", 200.0) == 99.0 and acc.prior("run", "y", 320.0) == 320.0 and acc.prior("P7", "x", 5) == 5
    )
