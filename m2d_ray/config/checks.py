"""The checks of a config that its types cannot say (ranges, settings that cannot run together, names a registry or
the grid must know), each failing with one line; the loader runs them once, after the closed sets (config/loading.py).
"""

from __future__ import annotations

import difflib

from m2d_ray import measured
from m2d_ray.accelerators import check_accelerator
from m2d_ray.catalog.distill import AUTO, CUDA_ONLY_KERNELS
from m2d_ray.catalog.evaluate import check_stage3, parse_judge, parse_tasks
from m2d_ray.catalog.methods import GROUPINGS, SCALINGS, SCORINGS
from m2d_ray.catalog.targets import check_targets_loss, parse_targets
from m2d_ray.config.grid import parse_recipe
from m2d_ray.config.schema import SweepConfig
from m2d_ray.config.sections import PlanConfig
from m2d_ray.config.stages import AnalysisConfig, DistillConfig, Stage2Config
from m2d_ray.errors import M2DError
from m2d_ray.sizes import parse_size


def check_config(cfg: SweepConfig) -> None:
    """Every setting that can be checked from the config alone, each failing with one line: method names,
    non-empty axes, a well-formed K list (K's range needs the model: check_k_range), each section's values."""

    for axis, registry in (("scoring", SCORINGS), ("grouping", GROUPINGS), ("scaling", SCALINGS)):
        names = getattr(cfg.grid, axis)
        if not names:
            raise M2DError(f"grid.{axis} is empty; list at least one of: {', '.join(registry.names())}")
        for n in names:
            if n not in registry:
                raise M2DError(f"grid.{axis}: {registry.unknown_message(n)}")
    K = cfg.grid.K
    if K != AUTO and not K:
        raise M2DError("grid.K is empty; give a list such as [8, 16] or auto (k, 2k, 4k ... E)")
    if cfg.eval.chunks < 1 or cfg.search.stop_factor <= 1.0:
        raise M2DError("eval.chunks must be >= 1 and search.stop_factor > 1")
    if cfg.calib.max_memory is not None:
        try:
            parse_size(cfg.calib.max_memory)
        except M2DError as exc:
            raise M2DError(f"calib.max_memory: {exc}") from None
    e = cfg.plan.efficiency
    for key, v in [("cpu_efficiency", cfg.plan.cpu_efficiency), *_fractions("efficiency", e)]:
        if not 0 < v <= 1:
            raise M2DError(f"plan.{key}={v} must be in (0, 1] (achieved / peak FLOP/s); give the fraction measured")
    if cfg.plan.max_dollars is not None and cfg.plan.max_dollars <= 0:
        raise M2DError(
            f"plan.max_dollars={cfg.plan.max_dollars} must be > 0 when set; give a budget in dollars, or null for none"
        )
    check_distill(cfg.distill)

    for key, value in (
        ("ray.data_accelerator", cfg.ray.data_accelerator),
        ("ray.trial_accelerator", cfg.ray.trial_accelerator),
        ("distill.accelerator", cfg.distill.accelerator),
        ("stage3.accelerator", cfg.stage3.accelerator),
    ):
        check_accelerator(value, key)
    check_stage2_targets(cfg)
    check_plan_storage(cfg.plan)
    check_recipes(cfg.stage2)
    grid_pairs = [f"{s}/{g}" for s in cfg.grid.scoring for g in cfg.grid.grouping]
    for p in cfg.stage2.pairs:
        if p not in grid_pairs:
            close = difflib.get_close_matches(p, grid_pairs, n=1, cutoff=0.5)
            raise M2DError(
                f"stage2.pairs: {p!r} is not a scoring/grouping pair of the grid"
                + (f"; did you mean {close[0]}?" if close else "")
            )

    parse_tasks(cfg.stage3.tasks, cfg.stage3.num_fewshot)  # a text:PATH file is checked when stage 3 starts

    check_stage3(cfg.stage3)
    check_analysis(cfg.stage3.analysis)


def check_distill(d: DistillConfig) -> None:
    """One-line errors for a distillation config that cannot run."""
    positive = {
        k: getattr(d, k)
        for k in (
            "steps",
            "batch_size",
            "grad_accum",
            "seq_len",
            "eval_every",
            "eval_batch_size",
            "loss_chunk",
            "workers",
            "threads_per_worker",
            "epochs",
        )
    }
    bad = [f"distill.{k}={v}" for k, v in positive.items() if v < 1]
    if bad:
        raise M2DError(f"{', '.join(bad)}: must be >= 1")
    if not (d.lr > 0 and 0 <= d.min_lr <= d.lr and d.temperature > 0 and len(d.betas) == 2):
        raise M2DError("distill: need lr > 0, 0 <= min_lr <= lr, temperature > 0 and betas = [beta1, beta2]")
    if d.precision == "bf16-pure" and d.uses_deepspeed:
        raise M2DError(
            "distill.precision=bf16-pure: DeepSpeed keeps float32 master weights in bf16; set distill.deepspeed=false "
            "for pure bfloat16 training, or use bf16-mixed"
        )
    if d.kl_kernel in CUDA_ONLY_KERNELS and d.gpus_per_worker <= 0:
        raise M2DError(
            f"distill.kl_kernel={d.kl_kernel} runs on CUDA devices only and distill.gpus_per_worker is 0; use chunked "
            "or auto"
        )


def check_analysis(a: AnalysisConfig) -> None:
    """One-line errors for stage3.analysis settings that cannot run, from the config alone."""
    for key in ("per_subject", "max_new_tokens", "batch_size", "judge_retries", "judge_max_tokens"):
        if getattr(a, key) < (0 if key == "judge_retries" else 1):
            raise M2DError(f"stage3.analysis.{key}={getattr(a, key)}: give a positive number")
    if not 0 <= a.max_unjudged <= 1:
        raise M2DError(f"stage3.analysis.max_unjudged={a.max_unjudged}: give a share in [0, 1]")
    if not a.judge_deadline > 0:
        raise M2DError(f"stage3.analysis.judge_deadline={a.judge_deadline}: give a positive number of seconds")
    if a.temperature < 0 or a.judge_rate <= 0:
        raise M2DError("stage3.analysis.temperature must be >= 0 (0: greedy) and judge_rate > 0; give such values")
    parse_judge(a.judge)
    t = a.thresholds
    for key in ("filler_ratio", "unique_ratio", "digit_ratio", "overlap"):
        if not 0 <= getattr(t, key) <= 1:
            raise M2DError(f"stage3.analysis.thresholds.{key}={getattr(t, key)}: give a share in [0, 1]")
    if t.ngram < 1 or t.repeats < 2:
        raise M2DError("stage3.analysis.thresholds: give ngram >= 1 and repeats >= 2")


def check_stage2_targets(cfg: SweepConfig) -> None:
    """stage2.targets (a mode or auto) against the loss, and stage2.shard_teacher where it would change nothing."""
    s2, x = cfg.stage2, cfg.distill
    if s2.shard_teacher and x.workers < 2:
        raise M2DError(
            "stage2.shard_teacher=true changes nothing with distill.workers=1: a teacher is sharded over the ranks of "
            "its student; set distill.workers to 2 or more (e.g. one per GPU of a node), or drop it"
        )
    if s2.targets == AUTO:  # the plan chooses among the exact modes the loss can train from
        return
    spec = parse_targets(s2.targets, x.temperature)
    check_targets_loss(x.loss, spec)
    if s2.shard_teacher and spec is not None:
        raise M2DError(
            f"stage2.shard_teacher=true changes nothing with stage2.targets={s2.targets}: the students load no teacher "
            "weights; drop it, or use stage2.targets=online (or auto)"
        )


STORAGE_KINDS = ("local", "shared", "object")


def check_plan_storage(plan: PlanConfig) -> None:
    """plan.max_storage a size; plan.read_bandwidth / tb_month keyed by storage kind, positive / non-negative."""
    if plan.max_storage is not None:
        try:
            parse_size(plan.max_storage)
        except M2DError as exc:
            raise M2DError(f"plan.max_storage: {exc}") from None
    for key, low in (("read_bandwidth", 0.0), ("tb_month", -1.0)):
        for kind, v in getattr(plan, key).items():
            if kind not in STORAGE_KINDS:
                close = difflib.get_close_matches(kind, STORAGE_KINDS, n=1)
                raise M2DError(
                    f"plan.{key}.{kind}: unknown storage kind"
                    + (f"; did you mean {close[0]}?" if close else "")
                    + f" (kinds: {', '.join(STORAGE_KINDS)})"
                )
            if not v > low:
                raise M2DError(f"plan.{key}.{kind}={v} must be {'> 0' if low == 0 else '>= 0'}")
    for key in ("nvlink_bandwidth", "network_bandwidth"):
        if not getattr(plan, key) > 0:
            raise M2DError(f"plan.{key}={getattr(plan, key)} must be > 0 (bytes/s)")
    given = {
        "efficiency": plan.efficiency if isinstance(plan.efficiency, dict) else {},
        "gpu_start_s": plan.gpu_start_s,
    }
    known = {"efficiency": measured.gpu().efficiency, "gpu_start_s": measured.gpu().start_s}
    for key, values in given.items():
        for name, v in values.items():
            if name not in known[key]:
                close = difflib.get_close_matches(name, known[key], n=1)
                raise M2DError(
                    f"plan.{key}.{name}: unknown" + (f"; did you mean {close[0]}?" if close else "") + f" (keys: "
                    f"{', '.join(known[key])})"
                )
            if not v > 0:
                raise M2DError(f"plan.{key}.{name}={v} must be > 0")


def _fractions(key: str, value: float | dict) -> list[tuple[str, float]]:
    """(key, value) of a number or of each entry of a mapping (plan.efficiency)."""
    return [(f"{key}.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(key, value)]


def check_recipes(s2: Stage2Config) -> None:
    """Recipes well formed, one per scoring/grouping pair, and not beside stage2.pairs (which filters a search)."""
    recipes = [parse_recipe(r) for r in s2.recipes]
    pairs = [r.pair for r in recipes]
    twice = sorted({p for p in pairs if pairs.count(p) > 1})
    if twice:
        raise M2DError(
            f"stage2.recipes names {', '.join(twice)} more than once; stage 2 distils one student per scoring/grouping "
            "pair: keep one recipe of each"
        )
    if recipes and s2.pairs:
        raise M2DError(
            "stage2.pairs picks among stage 1's promotions, and stage2.recipes skips stage 1: give one of them"
        )
