"""Loading teachers (hub name or local directory) and fingerprinting them for artifact reuse.

`load_teacher` loads the whole model: what calibration's whole-model pass, perplexity and distillation
need. Building students only needs some tensors: `m2d_ray.weights.open_teacher` reads them lazily.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from m2d_ray.arch import get_adapter
from m2d_ray.arch.base import DenseFFN, ExpertWeights, MoEAdapter, SharedExpert, dense_from_mlp
from m2d_ray.errors import M2DError


def default_teacher() -> str:
    from m2d_ray.assets import TINY_TEACHER_DIR

    return str(TINY_TEACHER_DIR)


@dataclass
class Teacher:
    """A loaded teacher. Conversion reads it through the same methods as `weights.LazyTeacher`."""

    name: str
    model: PreTrainedModel
    tokenizer: object
    adapter: MoEAdapter

    @property
    def config(self):
        return self.model.config

    @property
    def skeleton(self) -> PreTrainedModel:
        """The module tree conversion inspects (here the model itself)."""
        return self.model

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def fingerprint(self) -> dict:
        return model_fingerprint(self.name, self.model.config)

    def moe_layers(self) -> list[int]:
        return sorted(self.adapter.moe_blocks(self.model))

    def experts(self, layer: int, ids: Sequence[int] | None = None) -> ExpertWeights:
        w = self.adapter.experts(self.adapter.moe_blocks(self.model)[layer])
        return w if ids is None else w.select(list(ids))

    def router_weight(self, layer: int) -> Tensor:
        return self.adapter.router_weight(self.adapter.moe_blocks(self.model)[layer])

    def shared(self, layer: int) -> SharedExpert | None:
        return self.adapter.shared(self.adapter.moe_blocks(self.model)[layer])

    def dense_ffn(self, layer: int) -> DenseFFN:
        return dense_from_mlp(self.adapter.layers(self.model)[layer].mlp)

    def state(self, names: Sequence[str]) -> dict[str, Tensor]:
        sd = self.model.state_dict()
        return {n: sd[n] for n in names}


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
