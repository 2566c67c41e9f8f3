"""The plan's parameter arithmetic (arch/counts.py) against the model itself on the meta device: every supported
family, its dense student, and the published configs the experiments plan with, held in total, per decoder layer,
in elementwise parameters, in which layers are MoE, whether the head is tied, and the widths a student is made of."""

from __future__ import annotations

from pathlib import Path

import pytest
from families import FAMILIES

from m2d_ray.arch import ADAPTERS
from m2d_ray.arch.base import dense_from_mlp
from m2d_ray.arch.counts import counts
from m2d_ray.models import load_config
from m2d_ray.weights import meta_model

CONFIGS = Path(__file__).resolve().parents[2] / "experiments" / "configs"
PUBLISHED = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").exists())


def _meta_counts(config) -> dict:
    model = meta_model(config)
    layers = model.base_model.layers
    adapter = ADAPTERS[config.model_type] if config.model_type in ADAPTERS else None
    blocks = adapter.moe_blocks(model) if adapter else {}
    block = next(iter(blocks.values()), None)
    shared = adapter.shared(block) if block is not None else None
    dense = [dense_from_mlp(layer.mlp).width for i, layer in enumerate(layers) if i not in blocks]
    return {
        "expert_width": adapter.experts(block).width if block is not None else 0,
        "shared_width": shared.weights.width if shared else 0,
        "dense_width": max(dense, default=0),
        "params": sum(p.numel() for p in model.parameters()),
        "layers": tuple(sum(p.numel() for p in layer.parameters()) for layer in layers),
        "vector_params": sum(p.numel() for p in model.parameters() if p.ndim < 2),
        "moe_layers": tuple(adapter.moe_blocks(model)) if adapter else (),
        "tied": model.get_input_embeddings().weight is model.get_output_embeddings().weight,
    }


def _arith(config) -> dict:
    c = counts(config)
    assert c is not None, config.model_type
    keys = ("params", "layers", "vector_params", "moe_layers", "tied", "expert_width", "shared_width", "dense_width")
    return {k: getattr(c, k) for k in keys}


@pytest.mark.parametrize("spec", FAMILIES, ids=str)
def test_each_family_and_its_student_counted_as_the_model_itself(spec):
    config = spec.make_config()
    assert _arith(config) == _meta_counts(config)
    student = ADAPTERS[config.model_type].student_config(config, 40)
    assert _arith(student) == _meta_counts(student)


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_counted_as_the_model_itself(name):
    config = load_config(str(CONFIGS / name))
    assert _arith(config) == _meta_counts(config)


def _configs():
    from m2d_ray.assets import TINY_DENSE_TEACHER_DIR, TINY_TEACHER_DIR

    out = [(s.id, s.make_config) for s in FAMILIES]
    out += [(n, lambda n=n: load_config(str(CONFIGS / n))) for n in PUBLISHED]
    return out + [(p.name, lambda p=p: load_config(str(p))) for p in (TINY_TEACHER_DIR, TINY_DENSE_TEACHER_DIR)]


@pytest.mark.parametrize("make", [m for _, m in _configs()], ids=[i for i, _ in _configs()])
def test_the_plans_shapes_by_arithmetic_are_the_meta_models(make, monkeypatch):
    """plan.shapes on the arithmetic path gives the Shape and the student it gave from the meta model."""
    from m2d_ray.arch import supported_types
    from m2d_ray.plan import shapes

    config = make()
    fast = shapes.shape_of(config), shapes.models_of(config).student if config.model_type in supported_types() else 0
    monkeypatch.setattr(shapes, "counts", lambda c: None)
    slow = shapes.shape_of(config), shapes.models_of(config).student if config.model_type in supported_types() else 0
    assert fast == slow
