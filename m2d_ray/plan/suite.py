"""The tokens stage 3 forwards through one model: lm-eval's loglikelihood requests of the suite.

A multiple-choice row is one request per choice (context + that choice), each shot adds a whole worked
example to the context; MMLU's answers are one token (" A"), whose requests share their context and lm-eval
forwards it once (its one-token logits cache). The paper tasks' sizes are their rows (evaluate/paper_tasks.py)
and a typical request's length in a Qwen/Llama BPE (about 4 characters a token); the local tasks' lengths are
counted from their own files, at the same 4 characters a token.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from m2d_ray.evaluate.harness import CONTINUATION, TEXT_CONTINUATION, base_name, parse_tasks
from m2d_ray.evaluate.paper_tasks import PREFIX

CHARS_PER_TOKEN = 4.0
#: task -> (rows, requests per row, tokens of a 0-shot request, tokens each shot adds)
PAPER = {"winogrande": (1267, 2, 28, 28), "hellaswag": (10042, 4, 110, 110), "arc_easy": (570, 4, 40, 40),
         "arc_challenge": (299, 4, 45, 45), "mmlu": (14042, 1, 110, 100)}
SUBTASKS = {"mmlu": 57}  # lm-eval's limit applies to each subtask of a group
UNKNOWN = (1000, 4, 100, 100)  # a hub task m2d has no figures for


@lru_cache(maxsize=None)
def _local(task: str) -> tuple[int, int, float, float]:
    """The local task's figures from its shipped rows (the text: task reads its file the same way)."""
    from m2d_ray.evaluate import local_tasks

    base = Path(local_tasks.__file__).parent / "tasks"
    rows = [json.loads(line) for line in (base / f"{CONTINUATION}.test.jsonl").read_text().splitlines() if line.strip()]
    choices = max(len(r["choices"]) for r in rows)
    ctx = sum(len(r["context"]) for r in rows) / len(rows)
    choice = sum(len(c) for r in rows for c in r["choices"]) / sum(len(r["choices"]) for r in rows)
    return len(rows), choices, (ctx + choice) / CHARS_PER_TOKEN, (ctx + choice) / CHARS_PER_TOKEN


def task_figures(task: str) -> tuple[int, int, float, float]:
    name = base_name(task).removeprefix(PREFIX).removesuffix("_fewshot")
    if name in PAPER:
        return PAPER[name]
    if name in (CONTINUATION, TEXT_CONTINUATION):
        rows, choices, tok, shot = _local(CONTINUATION)
        return (400 if name == TEXT_CONTINUATION else rows), choices, tok, shot
    return UNKNOWN


def suite_tokens(spec: str, num_fewshot: int | None, limit: int | None) -> tuple[float, float]:
    """(tokens forwarded through one model by the suite, their mean request length)."""
    tokens = requests = 0.0
    for task, shots in parse_tasks(spec, num_fewshot):
        rows, per_row, tok, shot = task_figures(task)
        if limit is not None:
            rows = min(rows, limit * SUBTASKS.get(base_name(task).removeprefix(PREFIX), 1))
        requests += rows * per_row
        tokens += rows * per_row * (tok + shots * shot)
    return tokens, tokens / requests if requests else 0.0
