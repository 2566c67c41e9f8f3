"""FLOPs per token of every stage's work, from shapes read on the meta device (matrix products, 2 per multiply-add,
as distill/flops.py counts them): a forward at the top-k (or every expert), a calibration token's E x E output Gram,
the output head; a student's step is its forward and backward (4 forwards under full checkpointing: the recomputation
is time) plus its teacher's side (the forward online, the head from cached hidden states), with its validations; and
how many tokens each stage reads.
"""

from __future__ import annotations

import math

from m2d_ray.catalog.targets import HIDDEN, ONLINE
from m2d_ray.config import EvalConfig, SweepConfig, default, k_values
from m2d_ray.distill.flops import causal_attention_flops
from m2d_ray.plan.shapes import Models, Shape
from m2d_ray.plan.suite import CHARS_PER_TOKEN

#: stage-1 students that outlive the probe round: P2 measured 81 full evaluations of 204 distinct students
SURVIVORS = 81 / 204


def forward_flops(s: Shape, seq: int, all_experts: bool = False) -> float:
    """One token's forward: its matmuls (every expert, or the top-k) and causal attention over `seq`."""
    return 2.0 * (s.matmul_params - (0 if all_experts else s.inactive_expert_params)) + causal_attention_flops(
        s.q_width, s.layers, seq
    )


def calibration_flops(t: Shape, seq: int) -> float:
    """One calibration token: the teacher with every expert, and each MoE layer's E x E output Gram."""
    return forward_flops(t, seq, all_experts=True) + 2.0 * t.moe_layers * t.experts**2 * t.hidden


def head_flops(t: Shape) -> float:
    return 2.0 * t.vocab * t.hidden


def distinct_students(cfg: SweepConfig, t: Shape) -> tuple[int, int]:
    """(configs of the grid, the distinct students dedupe leaves: at K = k every grouping builds the same one)."""
    g = cfg.grid
    Ks = k_values(g.K, t.top_k, t.experts)
    configs = len(g.scoring) * len(g.grouping) * len(g.scaling) * len(Ks)
    same = (len(g.grouping) - 1) * len(g.scoring) * len(g.scaling) if (cfg.search.dedupe and t.top_k in Ks) else 0
    return configs, configs - same


def stage1_chunks(cfg: SweepConfig, distinct: int) -> tuple[int, float]:
    """(trials, perplexity chunks scored) as the search runs: a probe chunk each, then the survivors' rest."""
    c = cfg.eval.chunks
    if not cfg.search.early_stop:
        return distinct, float(distinct * c)
    survivors = math.ceil(SURVIVORS * distinct)
    if cfg.search.probe:
        return distinct + survivors, distinct + survivors * (c - 1.0)
    return distinct, survivors * c + (distinct - survivors) * min(c, cfg.search.grace_chunks + 1)


def eval_tokens(cfg: SweepConfig) -> float:
    """The perplexity tokens of stage 1 (the first eval.max_chars characters)."""
    chars = cfg.eval.max_chars or default(EvalConfig, "max_chars")  # all of an unknown length: priced at the default
    return chars / CHARS_PER_TOKEN


def student_tokens(cfg: SweepConfig) -> int:
    x = cfg.distill
    return x.steps * x.batch_size * x.grad_accum * x.workers * x.seq_len


def stage2_flops(
    cfg: SweepConfig, m: Models, targets: str, teacher: Shape | None = None, reports: float | None = None
) -> float:
    """One student's distillation: its training tokens and validations (the first, then one per report);
    `reports`: stopped by ASHA after that many (None: the whole budget)."""
    x = cfg.distill
    teacher = teacher or m.teacher
    student = forward_flops(m.student, x.seq_len)
    if targets == ONLINE:
        side = forward_flops(teacher, x.seq_len)
    elif targets == HIDDEN:
        side = head_flops(teacher)
    else:
        side = 0.0
    full = student_reports(cfg)
    reports = full if reports is None else reports
    train = trained(cfg, reports) * student_tokens(cfg) * (RECOMPUTE[x.checkpointing] * student + side)
    return train + (1 + reports) * (x.eval_max_tokens or 0) * (student + side)


#: the student's forward and backward in forwards, by distill.checkpointing: full runs every layer's forward again;
#: selective recomputes elementwise ops only (no matmul twice: FLOPs as none's); auto is decided before any bill
RECOMPUTE = {"none": 3.0, "selective": 3.0, "full": 4.0, "auto": 3.0}


def trained(cfg: SweepConfig, reports: float) -> float:
    """The share of its budget a student stopped after `reports` trains (it sees the stop at its next poll)."""
    x = cfg.distill
    return min(1.0, (reports * x.eval_every + (x.stop_poll if reports < student_reports(cfg) else 0)) / x.steps)


def student_reports(cfg: SweepConfig) -> int:
    """A student's reports (validations after the first): every eval_every steps and at the end (ASHA's max_t)."""
    return math.ceil(cfg.distill.steps / cfg.distill.eval_every)
