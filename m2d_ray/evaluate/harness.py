"""lm-eval on a model in memory or on disk: one `simple_evaluate` over a group with per-task shots.

A suite is a list of (task, shots). `paper` is the paper's (Winogrande 5, HellaSwag 10, ARC-Easy 25,
ARC-Challenge 25, MMLU 5; hub datasets); `local` is the offline task built from the embedded corpus;
`text:PATH` the same task built from a local WikiText-style file (for teachers trained on real text).
The per-task shots go into a generated group YAML (`simple_evaluate` takes a single num_fewshot), and
the suite's score is the unweighted mean of the task scores (acc_norm where the paper reports it, else acc).
"""

from __future__ import annotations

import difflib
import functools
import tempfile
from pathlib import Path

import yaml

from m2d_ray.errors import M2DError
from m2d_ray.evaluate.local_tasks import CONTINUATION, TEXT_CONTINUATION, write_task_yamls

PAPER_SUITE = (("winogrande", 5), ("hellaswag", 10), ("arc_easy", 25), ("arc_challenge", 25), ("mmlu", 5))
LOCAL_SUITE = ((CONTINUATION, 0), (f"{CONTINUATION}_fewshot", 2))  # the tiny models see 256 tokens
TEXT_SUITE = ((TEXT_CONTINUATION, 0),)
SUITES = {"paper": PAPER_SUITE, "local": LOCAL_SUITE}
NORMED = ("hellaswag", "arc_easy", "arc_challenge")  # scored by length-normalised accuracy
GROUP = "m2d_suite"


def text_source(spec: str) -> str | None:
    """The absolute text file of a `text:PATH` suite (checked), else None."""
    if not spec.startswith("text:"):
        return None
    path = Path(spec.removeprefix("text:")).expanduser()
    if not path.is_file():
        raise M2DError(f"tasks {spec!r}: {path} is not a file; give text:PATH to a WikiText-style text file")
    return str(path.resolve())


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
            raise M2DError(f"task {item!r}: write name or name:shots (e.g. hellaswag:10), or a suite: {', '.join(SUITES)}") from None
    if not out:
        raise M2DError(f"no tasks in {spec!r}; give a suite ({', '.join(SUITES)}, text:PATH) or task[:shots],…")
    return out


LOCAL_TASKS = (CONTINUATION, f"{CONTINUATION}_fewshot")
TEXT_TASKS = (TEXT_CONTINUATION, f"{TEXT_CONTINUATION}_fewshot")


def check_tasks(spec: str, num_fewshot: int | None = None) -> tuple[list[tuple[str, int]], str | None]:
    """(suite, text file) of a task spec, checked before any model loads: every task is ours or in
    lm-eval's own index (an unknown one fails with a suggestion), a text:PATH file exists."""
    suite, text = parse_tasks(spec, num_fewshot), text_source(spec)
    ours = LOCAL_TASKS + (TEXT_TASKS if text else ())
    for name, _ in suite:
        if name in ours:
            continue
        known = lm_eval_tasks()
        if name not in known:
            close = difflib.get_close_matches(name, [*known, *LOCAL_TASKS], n=2, cutoff=0.75)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise M2DError(f"unknown lm-eval task {name!r}{hint} (`lm-eval ls tasks` lists them; offline suites: local, text:PATH)")
    return suite, text


@functools.lru_cache(maxsize=1)
def lm_eval_tasks() -> frozenset[str]:
    """Every task, group and tag name lm-eval knows (its index takes seconds to build: once per process)."""
    from lm_eval.tasks import TaskManager

    return frozenset(TaskManager().all_tasks)


def _group_yaml(tasks: list[tuple[str, int]], dest: Path) -> None:
    group = {"group": GROUP, "task": [{"task": name, "num_fewshot": shots} for name, shots in tasks],
             "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": False}], "metadata": {"version": 1.0}}
    (dest / f"{GROUP}.yaml").write_text(yaml.safe_dump(group, sort_keys=False))


def evaluate(model, tokenizer, tasks: list[tuple[str, int]], batch_size: int = 16, device: str = "cpu", limit: int | None = None,
             text: str | None = None) -> dict:
    """{"tasks": {name: {"acc", "acc_norm", "score", "shots", "n"}}, "mean": unweighted mean score}.

    `text`: the file `text_continuation` is built from (`text_source` of a `text:PATH` spec)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    with tempfile.TemporaryDirectory(prefix="m2d-lmeval-") as tmp:
        include = write_task_yamls(Path(tmp), text)
        _group_yaml(tasks, include)
        try:
            out = simple_evaluate(model=lm, tasks=[GROUP], task_manager=TaskManager(include_path=str(include)), limit=limit, log_samples=False)
        except Exception as exc:  # the names were checked (check_tasks): this is the data, mostly the hub offline
            names = ", ".join(t for t, _ in tasks if t not in LOCAL_TASKS + TEXT_TASKS)
            raise M2DError(f"lm-eval could not load the data of {names or 'the tasks'} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
                           "these datasets come from the Hugging Face hub: offline? use --tasks local or text:PATH") from None
    by_alias = {v.get("alias", k).strip(" -"): v for k, v in out["results"].items() if k != GROUP}
    results = {}
    for name, shots in tasks:
        r = by_alias.get(name, {})
        acc, norm = r.get("acc,none"), r.get("acc_norm,none")
        score = norm if name in NORMED and norm is not None else acc
        n = r.get("sample_len") or (r.get("sample_count") or {}).get("acc,none")
        results[name] = {"acc": acc, "acc_norm": norm, "score": score, "shots": shots, "n": n}
    scores = [r["score"] for r in results.values() if r["score"] is not None]
    return {"tasks": results, "mean": sum(scores) / len(scores) if scores else None}
