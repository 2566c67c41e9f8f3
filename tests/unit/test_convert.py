"""Per-family conversion: exact at K = k, native export/reload, every recipe runs at K > k."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from families import FAMILIES, tiny_model
from transformers import AutoModelForCausalLM

from m2d_ray.arch import get_adapter
from m2d_ray.calibrate.collect import collect_stats
from m2d_ray.catalog.methods import GROUPINGS, RANDOM_BASELINES, SCALINGS, SCORINGS
from m2d_ray.convert.build import build_from_plan
from m2d_ray.convert.export import PLAN_FILE, export_student, verify_student
from m2d_ray.convert.plan import make_plan
from m2d_ray.models import Teacher


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda s: s.id)
def family(request):
    model = tiny_model(request.param, seed=0)
    teacher = Teacher(name=request.param.id, model=model, tokenizer=None, adapter=get_adapter(model.config))
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 24))
    stats = collect_stats(model, teacher.adapter, ids, torch.ones_like(ids), progress=False)
    return request.param, teacher, stats


def finite_logits(model) -> bool:
    ids = torch.arange(12).view(1, 12) % model.config.vocab_size
    with torch.no_grad():
        return bool(torch.isfinite(model(ids).logits).all())


@pytest.mark.parametrize("scaling", SCALINGS.names())
def test_conversion_at_K_equals_k_is_exact_and_reloads_natively(family, scaling, tmp_path):
    spec, teacher, stats = family
    k = teacher.adapter.top_k(teacher.config)
    plan = make_plan(teacher, stats, "do-acp", "oc", scaling, k)
    assert all(len(g) == 1 for p in plan.layers.values() for g in p.groups)
    student = build_from_plan(teacher, plan)
    assert type(student).__name__ == spec.student_class
    # export reloads and verifies sum_g alpha_g f_g(h) in float64 before the directory appears
    record = export_student(student, None, tmp_path / "s", teacher=teacher, plan=plan)
    assert record["max_rel_error"] < 1e-10
    assert (tmp_path / "s" / PLAN_FILE).exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "s")
    assert type(reloaded).__name__ == spec.student_class
    assert finite_logits(reloaded)


def test_export_check_catches_a_wrong_student(family, tmp_path):
    spec, teacher, stats = family
    k = teacher.adapter.top_k(teacher.config)
    plan = make_plan(teacher, stats, "sf", "rr", "uniform", k)
    student = build_from_plan(teacher, plan)
    layer = next(iter(plan.layers))
    mlp = teacher.adapter.layers(student)[layer].mlp
    with torch.no_grad():
        next(p for n, p in mlp.named_parameters() if "down" in n).mul_(1.001)
    assert max(verify_student(student, teacher, plan).values()) > 1e-6
    with pytest.raises(RuntimeError, match="not exact"):
        export_student(student, None, tmp_path / "bad", teacher=teacher, plan=plan)
    assert not (tmp_path / "bad").exists()  # nothing half-written


def test_every_recipe_runs_at_K_greater_than_k(family):
    spec, teacher, stats = family
    k = teacher.adapter.top_k(teacher.config)
    K = 2 * k
    signatures = set()
    for scoring, grouping, scaling in itertools.product(SCORINGS.names(), GROUPINGS.names(), SCALINGS.names()):
        plan = make_plan(teacher, stats, scoring, grouping, scaling, K)
        for p in plan.layers.values():
            assert len(p.groups) == k and all(p.groups) and sorted(sum(p.groups, [])) == sorted(p.selected)
            assert len(p.selected) == K and all(math.isfinite(a) for a in p.alphas)
        signatures.add(plan.signature())
    assert len(signatures) > 1
    # build (and verify exactness of the merged blocks) for one recipe per grouping
    for grouping in GROUPINGS.names():
        plan = make_plan(teacher, stats, "acp", grouping, "proportional", K)
        student = build_from_plan(teacher, plan)
        assert max(verify_student(student, teacher, plan).values()) < 1e-10
        assert finite_logits(student)


@pytest.mark.parametrize("name", RANDOM_BASELINES.names())
def test_baselines_have_the_student_shape(family, name):
    spec, teacher, stats = family
    k = teacher.adapter.top_k(teacher.config)
    converted = build_from_plan(teacher, make_plan(teacher, stats, "sf", "rr", "uniform", k))
    base = RANDOM_BASELINES[name](teacher)
    assert type(base).__name__ == spec.student_class
    shapes = {n: p.shape for n, p in converted.named_parameters()}
    assert {n: p.shape for n, p in base.named_parameters()} == shapes
    attn = next(n for n in shapes if "self_attn" in n and n.endswith("weight"))
    same_attn = torch.equal(dict(base.named_parameters())[attn], dict(converted.named_parameters())[attn])
    assert same_attn == (name == "random-ffn")
    assert finite_logits(base)
