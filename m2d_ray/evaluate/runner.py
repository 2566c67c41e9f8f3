"""One model through lm-eval, placed by its memory (placement.py): what `m2d eval` and stage 3 call.

plan(model, ...)          the EvalPlacement of a model from its config alone (no weights read)
gpu_facts()               this process' GPU memory and count (None, 0 without CUDA)
evaluate_model(...)       load (whole, or sharded over the visible GPUs by HFLM) and run the suite
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

from m2d_ray.accelerators import GPUS_PER_NODE, host_available
from m2d_ray.catalog.evaluate import check_stage3, parse_batch, setting_bytes  # noqa: F401  (check_stage3 re-exported)
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.harness import PAPER_NAMES, evaluate
from m2d_ray.evaluate.paper_data import pack
from m2d_ray.evaluate.placement import (
    DEFAULT_SEQ,
    EvalPlacement,
    hflm_kwargs,
    model_size,
    plan_eval,
    plan_generation,
    plan_streamed,
)

# Imported inside functions: what may be missing (optional packages, Ray's internal API), where its absence is handled;
# Ray, torch, transformers' configs and the model loader (`m2d plan` and the checks read this module without them).


def max_length(config, cap: int = DEFAULT_SEQ) -> int:
    """The sequence length to plan for: the model's own limit, at most `cap`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return min(cap, getattr(text, "max_position_embeddings", None) or cap)


def gpu_facts() -> tuple[int | None, int]:
    """(one GPU's total memory in bytes, GPUs visible) here; (None, 0) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None, 0
    return torch.cuda.get_device_properties(0).total_memory, torch.cuda.device_count()


@functools.lru_cache(maxsize=64)
def _size(config_json: str):
    """model_size of a config given as JSON (students of one K share it: counted once per process)."""
    from transformers import AutoConfig

    d = json.loads(config_json)
    return model_size(AutoConfig.for_model(d.pop("model_type"), **d))


def plan(
    model: str,
    gpu_bytes: int | None,
    gpus_per_node: int,
    batch_size: int | str = 16,
    batch_memory: int | None = None,
    gpu_fraction: float | None = None,
    seq_cap: int = DEFAULT_SEQ,
    what: str | None = None,
) -> EvalPlacement:
    """The placement of `model` (a directory, storage URL or hub name) from its config."""
    from m2d_ray.models import model_config

    config = model_config(model)
    return plan_eval(
        _size(config.to_json_string()),
        gpu_bytes,
        gpus_per_node,
        batch_size,
        batch_memory,
        gpu_fraction,
        max_length(config, seq_cap),
        host_available() if gpu_bytes is None else None,
        what or f"model {model!r}",
    )


def evaluate_model(
    model: str, suite, placement: EvalPlacement, device: str, limit: int | None = None, text=None
) -> dict:
    """Run `suite` on `model`: sharded placements are loaded by HFLM itself with an accelerate device map over
    the visible GPUs; others by our loader (checked weights, eager experts on CPU) onto `device`."""
    from m2d_ray.models import _source, load_model

    kwargs = hflm_kwargs(placement)
    if placement.shard:
        return evaluate(
            _source(model),
            None,
            suite,
            batch_size=placement.batch_size,
            device="cuda",
            limit=limit,
            text=text,
            lm_kwargs={**kwargs, "dtype": "auto"},
        )

    lm, tok = load_model(model, device=device)
    return evaluate(
        lm, tok, suite, batch_size=placement.batch_size, device=device, limit=limit, text=text, lm_kwargs=kwargs
    )


# ---- stage 3 (a Ray task per model) --------------------------------------------------------------
def probe_gpus(get=None) -> tuple[int, int]:
    """(one GPU's memory, the most GPUs on one node) of the Ray cluster: a 1-GPU task measures the memory (`get`:
    how to wait for it, the stage's resource waiter; default ray.get)."""
    import ray
    import torch

    @ray.remote(num_gpus=1, num_cpus=0)
    def _memory() -> int:

        return torch.cuda.get_device_properties(0).total_memory

    mem = (get or ray.get)(_memory.remote())
    per_node = max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=1)
    return mem, max(1, per_node)


def stage3_placements(models: dict[str, str], c, gpus: float, get=None) -> dict[str, EvalPlacement]:
    """{key: placement} of every model stage 3 will evaluate, from configs alone, before any task starts; a
    model that fits on no number of a node's GPUs fails here with one line. `gpus`: the configured share
    (0 = CPU); a model that needs more whole GPUs gets them, sharded. `get`: how to wait for the GPU probe."""
    batch, budget = (
        parse_batch(c.batch_size),
        setting_bytes(c.batch_memory, "stage3.batch_memory") if c.batch_memory else None,
    )
    if gpus <= 0:
        return {
            k: plan(m, None, 0, batch, budget, seq_cap=c.max_length, what=f"stage-3 model {k}")
            for k, m in models.items()
        }
    mem, per_node = gpu_of(c, get)
    out = {}
    for k, m in models.items():
        p = plan(
            m, mem, per_node, batch, budget, gpus if gpus < 1 else None, c.max_length, what=f"stage-3 model {k} ({m})"
        )
        if gpus >= 1 and p.gpus < gpus:  # more GPUs were asked for than needed: keep the configured count
            p = replace(p, gpus=gpus)
        out[k] = p
    return out


def gpu_of(c, get=None) -> tuple[int, int]:
    """(one GPU's memory, the most GPUs of a node): as stage3.gpu_memory / gpus_per_node say, else probed."""
    mem = setting_bytes(c.gpu_memory, "stage3.gpu_memory") if c.gpu_memory else None
    per_node = c.gpus_per_node
    if mem is None or per_node is None:
        probed_mem, probed_n = probe_gpus(get)
        mem, per_node = mem or probed_mem, per_node or probed_n
    return mem, per_node


def generation_placements(
    models: dict[str, str], c, gpus: float, batch: int, prompt: int, length: int, get=None, streamable=()
) -> dict[str, EvalPlacement]:
    """{key: placement} of every model the analysis generates with (placement.plan_generation), from configs alone,
    before any task starts: stage 3's GPUs (`gpus`: its share, 0 = CPU), the whole batch beside the weights. A model
    of `streamable` (one that only scores: the teacher judge) that no node holds is read a layer at a time instead."""
    mem, per_node = gpu_of(c, get) if gpus > 0 else (None, 0)
    out = {}
    for k, m in models.items():
        fraction = gpus if 0 < gpus < 1 else None
        what = f"the analysis' model {k} ({m})"
        try:
            p = generation_placement(m, mem, per_node, batch, prompt, length, fraction, what)
        except M2DError:
            if k not in streamable:
                raise
            p = streamed_placement(m, mem, batch, length, what)
        out[k] = replace(p, gpus=gpus) if gpus >= 1 and p.gpus < gpus else p
    return out


def streamed_placement(model: str, gpu_bytes: int | None, batch: int, length: int, what: str) -> EvalPlacement:
    """placement.plan_streamed of `model` from its config (no weights read)."""
    from m2d_ray.models import model_config

    config = model_config(model)
    return plan_streamed(_size(config.to_json_string()), gpu_bytes, batch, max_length(config, length), what)


def generation_placement(
    model: str,
    gpu_bytes: int | None,
    gpus_per_node: int,
    batch: int,
    prompt: int,
    length: int,
    gpu_fraction: float | None = None,
    what: str | None = None,
) -> EvalPlacement:
    """placement.plan_generation of `model` from its config (no weights read); `m2d analyze` gives this machine's
    GPUs (gpu_facts), the analysis stage the cluster's."""
    from m2d_ray.models import model_config

    config = model_config(model)
    return plan_generation(
        _size(config.to_json_string()),
        gpu_bytes,
        gpus_per_node,
        batch,
        prompt,
        max_length(config, length),
        gpu_fraction,
        what or f"model {model!r}",
    )


def data_ref(suite_tasks) -> list | None:
    """The paper suite's verified data as one Ray object (in a list, so a task fetches it only when its
    node lacks the data), or None when the suite has no paper task."""

    if not any(t in PAPER_NAMES for t, _ in suite_tasks):
        return None
    import ray

    return [ray.put(pack())]


def local_placement(model: str, device: str, batch_size: int | str = 16) -> EvalPlacement:
    """`m2d eval`: the placement on this machine (its visible GPUs, or the host's memory on CPU)."""
    gpu_bytes, n = gpu_facts() if device.startswith("cuda") else (None, 0)
    return plan(model, gpu_bytes, n, parse_batch(batch_size))


def check_teacher_fits(cfg, model: str) -> None:
    """Before a run starts: with stage3.gpu_memory given, the teacher must fit a node (else one line)."""
    c = cfg.stage3
    if c.teacher and c.gpu_memory:
        plan(
            model,
            setting_bytes(c.gpu_memory, "stage3.gpu_memory"),
            c.gpus_per_node or GPUS_PER_NODE,
            parse_batch(c.batch_size),
            setting_bytes(c.batch_memory, "stage3.batch_memory") if c.batch_memory else None,
            seq_cap=c.max_length,
            what=f"teacher {model}",
        )
