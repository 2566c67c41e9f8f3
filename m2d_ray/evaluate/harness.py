"""lm-eval on a model in memory or on disk: one `simple_evaluate` over a group with per-task shots.

A suite is a list of (task, shots). `paper` is the paper's (Winogrande 5, HellaSwag 10, ARC-Easy 25,
ARC-Challenge 25, MMLU 5), always offline: lm-eval's prompts over the Arrow files `m2d fetch-data` unpacks
(paper_tasks.py says which splits); `paper-hub` is the same five of lm-eval's own hub tasks (ARC on test,
few-shot examples from train; needs the hub); `local` is the offline task built from the embedded corpus;
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

from m2d_ray.catalog.evaluate import (  # noqa: F401  (the suites, checked without lm-eval; re-exported)
    CONTINUATION,
    HUB_PAPER_SUITE,
    LOCAL_SUITE,
    PAPER_NAMES,
    PAPER_SUITE,
    SUITES,
    TEXT_CONTINUATION,
    TEXT_SUITE,
    parse_tasks,
)
from m2d_ray.errors import M2DError
from m2d_ray.evaluate import paper_tasks
from m2d_ray.evaluate.local_tasks import write_task_yamls
from m2d_ray.evaluate.paper_data import verify

# Imported inside functions: lm-eval (seconds to import; only where a suite runs).

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


LOCAL_TASKS = (CONTINUATION, f"{CONTINUATION}_fewshot")
TEXT_TASKS = (TEXT_CONTINUATION, f"{TEXT_CONTINUATION}_fewshot")


def base_name(task: str) -> str:
    """The lm-eval name a task stands for (paper_hellaswag -> hellaswag)."""
    return task.removeprefix(paper_tasks.PREFIX) if task in PAPER_NAMES else task


def check_tasks(spec: str, num_fewshot: int | None = None) -> tuple[list[tuple[str, int]], str | None]:
    """(suite, text file) of a task spec, checked before any model loads: every task is ours or in
    lm-eval's own index (an unknown one fails with a suggestion), a text:PATH file exists."""
    suite, text = parse_tasks(spec, num_fewshot), text_source(spec)
    ours = LOCAL_TASKS + (TEXT_TASKS if text else ()) + PAPER_NAMES
    if any(name in PAPER_NAMES for name, _ in suite):
        verify()  # fetched and intact, else one line with the command that fetches it
    for name, _ in suite:
        if name in ours:
            continue
        known = lm_eval_tasks()
        if name not in known:
            close = difflib.get_close_matches(name, [*known, *LOCAL_TASKS, *PAPER_NAMES], n=2, cutoff=0.75)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise M2DError(
                f"unknown lm-eval task {name!r}{hint} (`lm-eval ls tasks` lists them; offline suites: paper, local, "
                "text:PATH)"
            )
    return suite, text


@functools.lru_cache(maxsize=1)
def lm_eval_tasks() -> frozenset[str]:
    """Every task, group and tag name lm-eval knows (its index takes seconds to build: once per process)."""
    from lm_eval.tasks import TaskManager

    return frozenset(TaskManager().all_tasks)


def _group_yaml(tasks: list[tuple[str, int]], dest: Path, groups: set[str] = frozenset()) -> None:
    """The suite as one group; a member that is itself a group (mmlu) is referenced as `group:` (as `task:`,
    lm-eval 0.4.13 renames every subtask to the group's name and recurses forever)."""
    group = {
        "group": GROUP,
        "task": [{"group" if name in groups else "task": name, "num_fewshot": shots} for name, shots in tasks],
        "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": False}],
        "metadata": {"version": 1.0},
    }
    (dest / f"{GROUP}.yaml").write_text(yaml.safe_dump(group, sort_keys=False))


def evaluate(
    model,
    tokenizer,
    tasks: list[tuple[str, int]],
    batch_size: int | str = 16,
    device: str = "cpu",
    limit: int | None = None,
    text: str | None = None,
    lm_kwargs: dict | None = None,
) -> dict:
    """{"tasks": {name: {"acc", "acc_norm", "score", "shots", "n"}}, "mean": unweighted mean score}.

    `text`: the file `text_continuation` is built from (`text_source` of a `text:PATH` spec). Paper tasks
    also give their split, few-shot split and (MMLU) the unweighted subject mean; `lm_kwargs` go to HFLM
    (e.g. max_batch_size with batch_size "auto")."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device, **(lm_kwargs or {}))
    ours = LOCAL_TASKS + TEXT_TASKS + PAPER_NAMES
    paper = {base_name(t): s for t, s in tasks if t in PAPER_NAMES}
    with tempfile.TemporaryDirectory(prefix="m2d-lmeval-") as tmp:
        include = write_task_yamls(Path(tmp), text)
        if paper:
            paper_tasks.write_yamls(include, verify(), paper)
        _group_yaml(tasks, include)
        try:
            # lm-eval's own index (~15 k tasks, seconds to build) only when a task is not one of ours
            builtin = any(t not in ours for t, _ in tasks)
            manager = TaskManager(include_path=str(include), include_defaults=builtin)
            groups = {t for t, _ in tasks if t in manager.all_groups}
            if groups:  # the index has the file's path; lm-eval reads it again when it loads the suite
                _group_yaml(tasks, include, groups)
            out = simple_evaluate(model=lm, tasks=[GROUP], task_manager=manager, limit=limit, log_samples=False)
        except Exception as exc:  # the names were checked (check_tasks): this is the data, mostly the hub offline
            names = ", ".join(t for t, _ in tasks if t not in ours)
            if not names:
                raise
            raise M2DError(
                f"lm-eval could not load the data of {names} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
                "these datasets come from the Hugging Face hub: offline? use --tasks paper (after m2d fetch-data), "
                "local or text:PATH"
            ) from None
    by_alias = {v.get("alias", k).strip(" -"): v for k, v in out["results"].items() if k != GROUP}
    results = {}
    for name, shots in tasks:
        r = out["results"].get(name) or by_alias.get(name, {})
        acc, norm = r.get("acc,none"), r.get("acc_norm,none")
        score = norm if base_name(name) in NORMED and norm is not None else acc
        n = r.get("sample_len") or (r.get("sample_count") or {}).get("acc,none")
        results[name] = {"acc": acc, "acc_norm": norm, "score": score, "shots": shots, "n": n}
        if name in PAPER_NAMES:
            results[name].update(paper_tasks.details(base_name(name), out))
    scores = [r["score"] for r in results.values() if r["score"] is not None]
    return {
        "tasks": results,
        "mean": sum(scores) / len(scores) if scores else None,
        **({"data": paper_tasks.data_note()} if paper else {}),
    }
