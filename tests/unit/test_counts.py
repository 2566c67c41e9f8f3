"""The plan's parameter arithmetic (arch/counts.py) against the model itself on the meta device: every supported
family, its dense student, and the published configs the experiments plan with, held in total, per decoder layer,
in elementwise parameters, in which layers are MoE, whether the head is tied, and the widths a student is made of."""

from __future__ import annotations

import pytest
from families import FAMILIES

from m2d_ray.arch import ADAPTERS
from m2d_ray.arch.counts import counts
from m2d_ray.arch.meta import meta_counts
from m2d_ray.models import model_config
from m2d_ray.shipped import EXPERIMENTS

CONFIGS = EXPERIMENTS / "configs"
PUBLISHED = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").exists())


def _arith(config):
    c = counts(config)
    assert c is not None, config.model_type
    return c


@pytest.mark.parametrize("spec", FAMILIES, ids=str)
def test_each_family_and_its_student_counted_as_the_model_itself(spec):
    config = spec.make_config()
    assert _arith(config) == meta_counts(config)
    student = ADAPTERS[config.model_type].student_config(config, 40)
    assert _arith(student) == meta_counts(student)


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_counted_as_the_model_itself(name):
    config = model_config(str(CONFIGS / name))
    assert _arith(config) == meta_counts(config)


def _configs():
    from m2d_ray.assets import TINY_DENSE_TEACHER_DIR, TINY_TEACHER_DIR

    out = [(s.id, s.make_config) for s in FAMILIES]
    out += [(n, lambda n=n: model_config(str(CONFIGS / n))) for n in PUBLISHED]
    return out + [(p.name, lambda p=p: model_config(str(p))) for p in (TINY_TEACHER_DIR, TINY_DENSE_TEACHER_DIR)]


@pytest.mark.parametrize("make", [m for _, m in _configs()], ids=[i for i, _ in _configs()])
def test_the_plans_shapes_by_arithmetic_are_the_meta_models(make, monkeypatch):
    """plan.shapes on the arithmetic path gives the Shape and the student it gave from the meta model."""
    from m2d_ray.arch import supported_types
    from m2d_ray.plan import shapes

    config = make()
    fast = shapes.shape_of(config), shapes.models_of(config).student if config.model_type in supported_types() else 0
    monkeypatch.setattr(shapes, "param_counts", meta_counts)
    slow = shapes.shape_of(config), shapes.models_of(config).student if config.model_type in supported_types() else 0
    assert fast == slow
