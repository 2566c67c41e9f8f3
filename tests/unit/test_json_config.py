"""`m2d plan` of a config whose counts are arithmetic reads its config.json as plain JSON (arch/json_config.py) and
imports no torch: the plan equals the one read through transformers' config class, field defaults included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from m2d_ray import pipeline, shipped
from m2d_ray.arch import get_adapter, json_config
from m2d_ray.assets import TINY_TEACHER_DIR
from m2d_ray.config import load_config
from m2d_ray.models import model_config
from m2d_ray.plan.run_plan import Devices, plan_line
from m2d_ray.plan.shapes import models_of

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "m2d_ray" / "experiments" / "configs" / "Qwen--Qwen3-30B-A3B"
#: what the plan must not load: torch, Dynamo, transformers' modelling code and its config classes (which load torch)
NOT_LOADED = ("torch", "torch._dynamo", "transformers.modeling_utils", "transformers.configuration_utils")


def _plan_in_a_fresh_interpreter(*args: str) -> tuple[str, list[str]]:
    """`m2d plan ARGS` in a new interpreter: its stdout, and which of NOT_LOADED it held after."""
    probe = (
        "import sys\nfrom m2d_ray.cli import main\n"
        f"main(['plan', *{list(args)!r}])\n"
        f"print('LOADED', *[m for m in {NOT_LOADED!r} if m in sys.modules])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, check=True, env=env, cwd=ROOT
    ).stdout
    last = out.strip().splitlines()[-1]
    assert last.startswith("LOADED"), out[-2000:]
    return out, last.split()[1:]


def test_the_plan_of_the_30b_config_imports_no_torch_and_equals_the_config_class_plan(monkeypatch):
    """The CLI's plan of qwen3_30b_a3b, in a fresh interpreter, loads none of torch, Dynamo, transformers' modelling
    code or config classes; its JSON line and its table equal the plan of the same config read through transformers'
    config class (as every plan was read before), here in-process."""
    out, loaded = _plan_in_a_fresh_interpreter("qwen3_30b_a3b", "--json")
    assert loaded == []
    got = json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith("{")))

    cfg = load_config(shipped.named("qwen3_30b_a3b"))
    monkeypatch.setattr(json_config, "read", lambda directory: None)  # the config class's path
    assert type(pipeline._shape(cfg.model)).__name__ == "Qwen3MoeConfig"
    plan = pipeline.plan_run(cfg, Devices())
    assert got == json.loads(plan_line(plan))
    table = [ln.strip() for ln in out.splitlines()]
    assert all(ln.strip() in table for ln in plan.table().splitlines() if ln.strip())


@pytest.mark.parametrize("model_type", sorted(json_config.DEFAULTS))
def test_each_default_is_the_config_class_own(model_type):
    """A field config.json leaves out reads as the family's config class defaults it (head_dim, which Qwen3-MoE's
    class does not define, as hidden // heads: what its attention uses)."""
    cls = AutoConfig.for_model(model_type)
    plain = json_config.plain({"model_type": model_type})
    for field, value in json_config.DEFAULTS[model_type].items():
        assert getattr(cls, field) == value, field
    assert plain.head_dim == (getattr(cls, "head_dim", None) or cls.hidden_size // cls.num_attention_heads)


@pytest.mark.parametrize("left_out", [(), ("head_dim", "num_key_value_heads", "mlp_only_layers", "norm_topk_prob")])
def test_the_plain_config_plans_as_the_config_class(tmp_path, left_out):
    """The paper's teacher and the tiny one (and the paper's with fields left to their defaults): teacher and student
    shapes, E, k and the plan's notes equal those read through transformers' config class and the family's adapter."""
    for source in (PAPER, TINY_TEACHER_DIR):
        fields = json.loads((source / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in fields.items() if k not in left_out}))
        plain, real = json_config.read(tmp_path), model_config(str(tmp_path))
        assert isinstance(plain, json_config.PlainConfig)
        a, b = models_of(plain), models_of(real)
        assert (a.teacher, a.student, a.notes) == (b.teacher, b.student, b.notes), source
        adapter, plain_adapter = get_adapter(real), json_config.adapter_of(plain)
        assert plain_adapter.num_experts(plain) == adapter.num_experts(real)
        assert plain_adapter.top_k(plain) == adapter.top_k(real)
        assert plain_adapter.student_width_multiple(plain) == adapter.student_width_multiple(real)
        assert plain_adapter.approximation == adapter.approximation


def test_a_family_the_arithmetic_does_not_cover_is_read_by_its_config_class(tmp_path):
    """A family without plain defaults, a vision-language config or no config.json: None (the plan reads it with
    transformers)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_size": 64}))
    assert json_config.read(tmp_path) is None
    assert json_config.plain({"model_type": "qwen3_moe", "text_config": {}}) is None
    assert json_config.read(tmp_path / "absent") is None
    assert json_config.read(PAPER) is not None
