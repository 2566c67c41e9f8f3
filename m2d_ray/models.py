"""Loading teachers (hub name or local directory) and fingerprinting them for artifact reuse."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from m2d_ray.arch import get_adapter
from m2d_ray.arch.base import MoEAdapter
from m2d_ray.errors import M2DError


def default_teacher() -> str:
    from m2d_ray.assets import TINY_TEACHER_DIR

    return str(TINY_TEACHER_DIR)


@dataclass
class Teacher:
    name: str
    model: PreTrainedModel
    tokenizer: object
    adapter: MoEAdapter

    @property
    def config(self):
        return self.model.config

    def fingerprint(self) -> dict:
        return model_fingerprint(self.name, self.model.config)


def load_config(name: str):
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or "/" not in name):
        raise M2DError(f"model {name!r} not found: give a model directory or a hub name like Qwen/Qwen3-30B-A3B")
    try:
        return AutoConfig.from_pretrained(str(path) if path.exists() else name)
    except Exception as exc:
        raise M2DError(f"cannot read a model config from {name!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None


def load_teacher(name: str | None = None, dtype: torch.dtype | None = None, device: str = "cpu") -> Teacher:
    """Load a MoE teacher and its tokenizer; a non-MoE or unsupported model fails with one line."""
    name = name or default_teacher()
    adapter = get_adapter(load_config(name))  # fails fast, before any weights are read
    model, tokenizer = load_model(name, device=device, dtype=dtype)
    return Teacher(name=name, model=model, tokenizer=tokenizer, adapter=adapter)


def model_fingerprint(name: str, config) -> dict:
    """Identity of a teacher for artifact reuse: name, config digest and the weight files' sizes."""
    cfg = json.dumps(config.to_dict(), sort_keys=True, default=str)
    files = {}
    path = Path(name).expanduser()
    if path.is_dir():
        files = {p.name: p.stat().st_size for p in sorted(path.glob("*.safetensors"))}
    return {
        "name": name,
        "model_type": config.model_type,
        "config_sha256": hashlib.sha256(cfg.encode()).hexdigest(),
        "weight_files": files,
    }


def load_model(name: str, device: str = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer) of any causal LM directory or hub name: a dense student or an MoE teacher."""
    from m2d_ray.arch import supported_types

    config = load_config(name)
    src = str(Path(name).expanduser()) if Path(name).expanduser().exists() else name
    kwargs = {"dtype": dtype if dtype is not None else "auto"}
    if device == "cpu" and config.model_type in supported_types():
        kwargs["experts_implementation"] = "eager"  # grouped_mm rejects odd tiny shapes on CPU
    model = AutoModelForCausalLM.from_pretrained(src, **kwargs).to(device).eval()
    return model, AutoTokenizer.from_pretrained(src)
