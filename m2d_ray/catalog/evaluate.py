"""What a config may name for stage 3 and the analysis, checked without torch, transformers or lm-eval: the task
suites, judges, question sets and batch sizes. `harness.py`, `runner.py`, `judges.py` and `questions.py` use them.
"""

from __future__ import annotations

from m2d_ray.catalog.distill import AUTO
from m2d_ray.errors import M2DError
from m2d_ray.sizes import parse_size

PREFIX = "paper_"  # our task names (paper_hellaswag ...): never clash with lm-eval's own hub tasks
#: the offline task built from the embedded corpus, and the same task built from a local text file
CONTINUATION, TEXT_CONTINUATION = "synthetic_continuation", "text_continuation"
HUB_PAPER_SUITE = (("winogrande", 5), ("hellaswag", 10), ("arc_easy", 25), ("arc_challenge", 25), ("mmlu", 5))
PAPER_SUITE = tuple((PREFIX + name, shots) for name, shots in HUB_PAPER_SUITE)  # offline (paper_tasks.py)
LOCAL_SUITE = ((CONTINUATION, 0), (f"{CONTINUATION}_fewshot", 2))  # the tiny models see 256 tokens
TEXT_SUITE = ((TEXT_CONTINUATION, 0),)
SUITES = {"paper": PAPER_SUITE, "paper-hub": HUB_PAPER_SUITE, "local": LOCAL_SUITE}
PAPER_NAMES = tuple(name for name, _ in PAPER_SUITE)
#: the analysis' question sets (questions.py)
SETS = ("mmlu", "local")


def parse_tasks(spec: str, num_fewshot: int | None = None) -> list[tuple[str, int]]:
    """`paper`, `local`, `text:PATH`, or `task[:shots],…` (shots default to --num-fewshot, else 0)."""
    suite = TEXT_SUITE if spec.startswith("text:") else SUITES.get(spec)  # the file: text_source
    if suite:
        return [(t, num_fewshot if num_fewshot is not None else s) for t, s in suite]
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, shots = item.partition(":")
        try:
            out.append((name, int(shots) if shots else (num_fewshot or 0)))
        except ValueError:
            raise M2DError(
                f"task {item!r}: write name or name:shots (e.g. hellaswag:10), or a suite: {', '.join(SUITES)}"
            ) from None
    if not out:
        raise M2DError(f"no tasks in {spec!r}; give a suite ({', '.join(SUITES)}, text:PATH) or task[:shots],…")
    return out


def parse_batch(value) -> int | str:
    """A batch size as configured: a positive int or "auto"."""

    if value == AUTO:
        return AUTO
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or isinstance(value, bool):
        raise M2DError(
            f"batch size {value!r}: write a positive integer or auto (the largest that fits the device's memory)"
        )
    return n


def check_stage3(c) -> None:
    """One-line errors for stage3 settings that cannot run (config load, before anything is written)."""

    parse_batch(c.batch_size)
    if c.limit is not None and c.limit < 1:
        raise M2DError(f"stage3.limit={c.limit}: give a positive number of examples per task, or null for all")
    if c.max_length < 1:
        raise M2DError(f"stage3.max_length={c.max_length}: must be >= 1")
    for key in ("gpu_memory", "batch_memory"):
        if getattr(c, key) is not None:
            setting_bytes(getattr(c, key), f"stage3.{key}")


def setting_bytes(v: str, what: str) -> int:

    try:
        return parse_size(v)
    except M2DError as exc:
        raise M2DError(f"{what}: {exc}") from None


def parse_judge(spec: str) -> tuple[str, str | None]:
    """(kind, model) of a judge spec: teacher, none, or openai:MODEL."""
    kind, _, model = str(spec).partition(":")
    if kind in ("teacher", "none") and not model:
        return kind, None
    if kind == "openai" and model.strip():
        return kind, model.strip()
    raise M2DError(f"unknown judge {spec!r}; write teacher, none or openai:MODEL (e.g. openai:gpt-4o-mini)")
