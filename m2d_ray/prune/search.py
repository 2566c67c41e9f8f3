"""Architecture search of the dense-to-dense baseline at a parameter budget (the paper's D2D table).

Candidates are shapes of the teacher's class with (almost exactly) `target` parameters: a mix of hidden
size, heads and layers is fixed and the FFN width solved for the budget (parameters are affine in it).
The mixes, relative to the teacher (d, H, L): width only — FFN alone; hidden x 3/4; heads x 1/2 — and
width + depth — layers x 3/4; layers x 1/2; hidden x 3/4 with layers x 3/4. Mixes that collapse onto
another or cannot reach the budget are dropped; at least `MIN_CANDIDATES` must remain. Each candidate is
pruned from the same one-shot importance and scored by its perplexity before distillation (as stage 1
scores conversions); the lowest is promoted.

Parameters are counted as `sum(p.numel() for p in model.parameters())` of the model built on the meta
device: tied input/output embeddings count once, untied ones (both embedded teachers) twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from m2d_ray import console
from m2d_ray.arch.dense import DenseAdapter, DenseSizes, get_dense_adapter
from m2d_ray.catalog.methods import PRUNING_MIXES
from m2d_ray.config import EvalConfig
from m2d_ray.convert.baselines import dense_width
from m2d_ray.convert.student import student_width
from m2d_ray.data.text import TokenSet
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.perplexity import perplexity
from m2d_ray.models import Teacher, check_teacher, load_model, model_config
from m2d_ray.prune.importance import Importance, collect_importance
from m2d_ray.prune.prune import PrunedSpec, prune

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MIN_CANDIDATES = 4
#: (kind, hidden factor, heads factor, layers factor); the FFN width is solved for the budget
MIXES = PRUNING_MIXES


def count_params(config) -> int:
    """Parameters of a model of `config` (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def sizes_params(config, adapter: DenseAdapter, sizes: DenseSizes) -> int:
    return count_params(adapter.pruned_config(config, sizes, list(range(sizes.layers))))


def moe_student_params(moe_teacher: str) -> int:
    """Parameters of the dense student that `m2d convert` builds from an MoE teacher at K = k (the matched
    budget of the dense-to-dense baseline), from the config alone: the teacher is built on the meta device."""
    adapter, config = check_teacher(moe_teacher), model_config(moe_teacher)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    teacher = Teacher(name=moe_teacher, model=model, tokenizer=None, adapter=adapter)
    width = student_width(model, adapter, dense_width(teacher))
    return count_params(adapter.student_config(config, width))


def solve_ffn(config, adapter: DenseAdapter, hidden: int, heads: int, layers: int, target: int) -> DenseSizes | None:
    """The shape with this hidden size, heads and layers whose FFN width brings it closest to `target`
    parameters; None when no width in [1, the teacher's] gets within one FFN neuron's worth of it."""

    def at(f):
        return sizes_params(config, adapter, DenseSizes(hidden, f, heads, layers))

    p1, slope = at(1), at(2) - at(1)
    ffn = 1 + round((target - p1) / slope)
    if not 1 <= ffn <= int(config.intermediate_size):
        return None
    return DenseSizes(hidden, ffn, heads, layers)


def candidates(config, target: int) -> list[tuple[str, DenseSizes]]:
    """(kind, sizes) of every mix in `MIXES` that reaches `target` parameters (see the module docstring)."""
    adapter = get_dense_adapter(config)
    full, g = adapter.sizes(config), adapter.group_size(config)
    teacher_params = count_params(config)
    if target >= teacher_params:
        raise M2DError(
            f"a budget of {target:,} parameters is not below the teacher's {teacher_params:,}; give a smaller budget"
        )
    out, seen = [], set()
    for kind, fd, fh, fl in MIXES:
        hidden = min(full.hidden, max(8, 8 * round(full.hidden * fd / 8)))
        heads = max(g, g * math.floor(full.heads * fh / g))
        layers = max(1, min(full.layers - 1, round(full.layers * fl))) if fl < 1 else full.layers
        shape = (hidden, heads, layers)
        # a mix counts only if every size it shrinks really shrank (and it is not another mix again)
        if (hidden < full.hidden, heads < full.heads, layers < full.layers) != (
            fd < 1,
            fh < 1,
            fl < 1,
        ) or shape in seen:
            continue
        seen.add(shape)
        sizes = solve_ffn(config, adapter, hidden, heads, layers, target)
        if sizes is not None:
            out.append((kind, sizes))
    if len(out) < MIN_CANDIDATES:
        raise M2DError(
            f"only {len(out)} candidate shape(s) of this teacher reach {target:,} parameters (need {MIN_CANDIDATES}); "
            f"give a --target-params between the embeddings' share and the teacher's {teacher_params:,}, or explicit "
            "sizes"
        )
    return out


@dataclass
class SearchResult:
    rows: list[dict]  # one per candidate, in search order (the D2D candidate table)
    best: PrunedSpec  # the promoted candidate, described
    model: PreTrainedModel  # ... and built
    importance: Importance


def score(model, eval_ids: Tensor, seq_len: int, batch_size: int) -> dict:
    p = perplexity(model, eval_ids, seq_len=seq_len, batch_size=batch_size)
    return {"ppl": None if p.diverged else p.ppl, "diverged": p.diverged}


def search(
    teacher: str,
    calib: TokenSet,
    target: int,
    eval_ids: Tensor,
    *,
    model: PreTrainedModel | None = None,
    shapes: list[tuple[str, DenseSizes]] | None = None,
    seq_len: int = EvalConfig.seq_len,
    batch_size: int = EvalConfig.batch_size,
    device: str = "cpu",
    progress: bool = False,
) -> SearchResult:
    """Prune the dense teacher `teacher` (loaded unless `model` is given) to every candidate shape at `target`
    parameters, score each by perplexity on `eval_ids` before any distillation and promote the lowest."""

    if model is None:
        model, _ = load_model(teacher, device=device, what="teacher")
    adapter = get_dense_adapter(model.config)
    shapes = shapes if shapes is not None else candidates(model.config, target)
    imp = collect_importance(model, adapter, calib, batch_size=batch_size, progress=progress)
    rows, best, best_model = [], None, None
    for kind, sizes in shapes:
        student = prune(model, sizes, imp)
        params = sum(p.numel() for p in student.parameters())
        row = {
            "candidate": sizes.label(),
            "kind": kind,
            **sizes.to_json(),
            "kv_heads": sizes.heads // adapter.group_size(model.config),
            "params": params,
            "params_vs_target": params / target - 1,
            **score(student, eval_ids, seq_len, batch_size),
        }
        rows.append(row)
        console.say(
            f"candidate {row['candidate']} ({kind}): {params:,} parameters, perplexity "
            + ("diverged" if row["diverged"] else f"{row['ppl']:.3f}")
        )
        if not row["diverged"] and (best is None or row["ppl"] < best["ppl"]):
            best, best_model = row, student
        del student
    if best is None:
        raise M2DError(
            "every candidate diverged before distillation (NaN/inf perplexity); check the teacher and the evaluation "
            "data"
        )
    for row in rows:
        row["best"] = row is best
    spec = PrunedSpec(
        teacher=teacher,
        sizes=DenseSizes(*(best[k] for k in ("hidden", "ffn", "heads", "layers"))),
        importance=imp,
        name=best["candidate"],
    )
    return SearchResult(rows=rows, best=spec, model=best_model, importance=imp)
