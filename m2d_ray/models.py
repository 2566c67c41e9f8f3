"""Loading teachers (hub name or local directory) and fingerprinting them for artifact reuse.

`load_teacher` loads the whole model: what calibration's whole-model pass, perplexity and distillation
need. Building students only needs some tensors: `m2d_ray.weights.open_teacher` reads them lazily.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import snapshot_download
from torch import Tensor
from transformers import AutoConfig, AutoTokenizer

from m2d_ray import storage
from m2d_ray.arch import auto_class, family_of, get_adapter, supported_types
from m2d_ray.arch.base import (
    DenseFFN,
    ExpertWeights,
    MoEAdapter,
    SharedExpert,
)
from m2d_ray.arch.dense import dense_types
from m2d_ray.arch.refused import missing_release
from m2d_ray.assets import (  # noqa: F401  (absolute and the defaults re-exported: their callers' names for them)
    TINY_DENSE_TEACHER_DIR,
    TINY_TEACHER_DIR,
    absolute,
    default_dense_teacher,
    default_teacher,
)
from m2d_ray.checkpoint import WEIGHT_SUFFIXES, Checkpoint, check_files, check_model_finite
from m2d_ray.errors import M2DError
from m2d_ray.quant import scheme_of
from m2d_ray.quant.reader import Dequantised, Reader
from m2d_ray.storage import local_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Imported inside functions: transformers' model classes (seconds of modelling code; `m2d plan` reads this module
# without building a model).


def device_default() -> str:
    """cuda when this process sees a GPU, else cpu (the one-off commands' --device default)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def is_embedded(name: str | None) -> bool:
    """`name` is one of the teachers installed with the package (every node has them)."""
    if name is None:
        return True
    path = Path(name).expanduser()
    return path.exists() and path.resolve() in {
        Path(default_teacher()).resolve(),
        Path(default_dense_teacher()).resolve(),
    }


@dataclass
class Teacher:
    """A loaded teacher. Conversion reads it through the same methods as `weights.LazyTeacher`."""

    name: str
    model: PreTrainedModel
    tokenizer: object
    adapter: MoEAdapter | None  # None: a dense teacher (the dense-to-dense baseline distils from one)

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
        return self.adapter.dense_ffn(self.adapter.ffn(self.adapter.layers(self.model)[layer]))

    def state(self, names: Sequence[str]) -> dict[str, Tensor]:
        """Copies of the named tensors, tied names sharing one copy: a student built from them owns its weights, so
        training it in this process leaves the teacher as it was (a view would train the frozen teacher too)."""
        sd, copies, out = self.model.state_dict(), {}, {}
        for n in names:
            key = (sd[n].data_ptr(), sd[n].shape)
            if key not in copies:
                copies[key] = sd[n].clone()
            out[n] = copies[key]
        return out


def model_config(name: str):
    """The transformers config of a directory, hub name or storage URL (only its config.json is fetched)."""
    if storage.is_remote(name):
        try:
            return AutoConfig.from_pretrained(str(storage.fetch_file(storage.join(name, "config.json")).parent))
        except Exception as exc:
            raise M2DError(
                f"cannot read {storage.join(name, 'config.json')} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160]}); give a model saved there"
            ) from None
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or "/" not in name):
        raise M2DError(f"model {name!r} not found: give a model directory or a hub name like Qwen/Qwen3-30B-A3B")
    if path.exists() and not path.is_dir():
        raise M2DError(f"model {name!r} is a file; give the model directory (config.json + weights)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise M2DError(f"model directory {name!r} has no config.json; give a saved model directory (save_pretrained)")
    try:
        return AutoConfig.from_pretrained(str(path) if path.exists() else name)
    except Exception as exc:
        newer = _newer_family(path)
        if newer:
            raise M2DError(newer) from None
        raise M2DError(
            f"cannot read a model config from {name!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        ) from None


def check_teacher(name: str | None) -> MoEAdapter:
    """Everything about a teacher that can be checked without reading its weights: config, family, files."""

    name = name or default_teacher()
    config = model_config(name)
    adapter = get_adapter(config)
    scheme_of(config)  # a quantisation m2d cannot read: one line, before any work
    check_files(name, "teacher")
    return adapter


def load_teacher(name: str | None = None, dtype: torch.dtype | None = None, device: str = "cpu") -> Teacher:
    """Load a MoE teacher and its tokenizer; a non-MoE or unsupported model fails with one line."""
    name = name or default_teacher()
    adapter = check_teacher(name)  # fails fast, before any weights are read
    model, tokenizer = load_model(name, device=device, dtype=dtype, what="teacher")
    return Teacher(name=name, model=model, tokenizer=tokenizer, adapter=adapter)


def load_distill_teacher(name: str, dtype: torch.dtype | None = None, device: str = "cpu") -> Teacher:
    """A distillation teacher: an MoE one (with its adapter), or a dense one (the D2D baseline's, no adapter)."""

    if model_config(name).model_type not in dense_types():
        return load_teacher(name, dtype=dtype, device=device)
    model, tokenizer = load_model(name, device=device, dtype=dtype, what="teacher")
    return Teacher(name=name, model=model, tokenizer=tokenizer, adapter=None)


#: config keys that count a checkpoint's multi-token-prediction layers (DeepSeek-V3, GLM-4.5; Qwen3-Next, Qwen3.5-MoE)
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


def checkpoint_dir(name: str) -> Path:
    """The local directory of a model: itself, a storage URL's copy in this node's cache (`storage.fetch_dir`),
    or the hub snapshot (downloaded once into the hub cache)."""

    if storage.is_remote(name):
        return storage.fetch_dir(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return path

    try:
        return Path(
            snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"])
        )
    except Exception as exc:
        raise M2DError(
            f"cannot fetch the weights of {name!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        ) from None


def _source(name: str) -> str:
    """What from_pretrained opens: a storage URL fetched into this node's cache, a local path, a hub name."""

    name = local_model(name)
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def _newer_family(path: Path) -> str | None:
    """The one line for a local model whose family a later transformers release has (arch/refused.SINCE)."""
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    return missing_release(model_type, known=model_type in supported_types()) if model_type else None


def load_tokenizer(name: str):
    """A model's tokenizer; from a storage URL only the files beside the weights are fetched."""
    src = str(storage.fetch_dir(name, without=WEIGHT_SUFFIXES)) if storage.is_remote(name) else _source(name)
    try:
        return AutoTokenizer.from_pretrained(src)
    except Exception as exc:
        raise M2DError(
            f"cannot load a tokenizer from {name!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        ) from None


def load_model(name: str, device: str = "cpu", dtype: torch.dtype | None = None, what: str = "model"):
    """(model, tokenizer) of any causal LM directory or hub name: a dense student or an MoE teacher.

    Damaged checkpoints (a truncated file, NaN/inf weights) fail with one line naming the file or tensor.
    """
    config = model_config(name)
    src = _source(name)
    check_files(src, what)
    kwargs = {"dtype": dtype if dtype is not None else "auto"}
    if device == "cpu" and family_of(config) is not None:
        kwargs["experts_implementation"] = "eager"  # grouped_mm rejects odd tiny shapes on CPU
    scheme = scheme_of(config, what)
    try:
        model = (
            auto_class(config).from_pretrained(src, **kwargs)
            if scheme is None
            else _load_quantised(src, config, scheme, kwargs)
        )
    except M2DError:
        raise
    except Exception as exc:  # unreadable weights: name the model, not transformers' internals
        raise M2DError(
            f"cannot load the weights of {what} {name!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
            "re-download or re-export it"
        ) from None
    check_model_finite(model, what)
    return model.to(device).eval(), load_tokenizer(src)


def _load_quantised(src: str, config, scheme, kwargs: dict):
    """A checkpoint published quantised, loaded as from_pretrained loads an unquantised one (its names converted the
    same way), from its tensors dequantised on read (`quant.reader`): the values the lazy teacher reads."""
    reader = Reader(Checkpoint(checkpoint_dir(src)), scheme)
    plain = copy.deepcopy(config)
    del plain.quantization_config
    state = {k: Dequantised(reader, k) for k in reader.names()}
    model_class = auto_class(plain)._model_mapping[type(plain)]  # the auto class wants a name or a directory
    return model_class.from_pretrained(None, config=plain, state_dict=state, **kwargs)


def check_teacher_topk(model: str, k_prime: int | None) -> None:
    """From the config alone: expanded teacher routing needs k <= k' <= E."""
    if k_prime is not None:
        config = model_config(model)
        get_adapter(config).check_top_k(config, k_prime)
