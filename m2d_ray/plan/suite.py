"""The tokens stage 3 forwards through one model: lm-eval's loglikelihood requests of the suite.

A multiple-choice row is one request per choice (context + that choice), each shot adds a whole worked
example to the context; MMLU's answers are one token (" A"), whose requests share their context and lm-eval
forwards it once (its one-token logits cache). The paper tasks' figures are counted from the requests lm-eval
builds over their fetched data (benchmarks/perf/suite_tokens.py), at about 4 characters a token in a Qwen/Llama BPE;
the local task's lengths are counted from its shipped rows, a `text:PATH` task's from the rows stage 3 builds
from that file, at the same 4 characters a token (a shot adds its context and its gold answer).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from m2d_ray.evaluate import local_tasks
from m2d_ray.evaluate.harness import (
    CONTINUATION,
    TEXT_CONTINUATION,
    base_name,
    parse_tasks,
    text_source,
)
from m2d_ray.evaluate.local_tasks import text_rows
from m2d_ray.evaluate.paper_tasks import PREFIX

CHARS_PER_TOKEN = 4.0
#: task -> (rows, requests per row, tokens of a 0-shot request, tokens each shot adds): lm-eval's own requests over
#: the fetched data, counted by benchmarks/perf/suite_tokens.py (2026-11-25; its characters / CHARS_PER_TOKEN)
PAPER = {
    "winogrande": (1267, 2.0, 26, 27),
    "hellaswag": (10042, 4.0, 91, 91),
    "arc_easy": (570, 4.0, 39, 39),
    "arc_challenge": (299, 3.99, 46, 46),
    "mmlu": (14042, 1.0, 138, 124),
}
SUBTASKS = {"mmlu": 57}  # lm-eval's limit applies to each subtask of a group
UNKNOWN = (1000, 4, 100, 100)  # a hub task m2d has no figures for


def _figures(test: list[dict], shots: list[dict]) -> tuple[int, int, float, float]:
    """(rows, choices, tokens of a 0-shot request, tokens a shot adds) of a multiple-choice task's rows."""
    choices = max(len(r["choices"]) for r in test)
    request = sum(len(r["context"]) for r in test) / len(test) + sum(len(c) for r in test for c in r["choices"]) / sum(
        len(r["choices"]) for r in test
    )
    shot = sum(len(r["context"]) + len(r["choices"][r["label"]]) for r in shots) / len(shots) if shots else request
    return len(test), choices, request / CHARS_PER_TOKEN, shot / CHARS_PER_TOKEN


@cache
def _local_rows(split: str) -> list[dict]:
    base = Path(local_tasks.__file__).parent / "tasks"
    text = (base / f"{CONTINUATION}.{split}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@cache
def _local() -> tuple[int, int, float, float]:
    """The local task's figures from its shipped rows."""
    return _figures(_local_rows("test"), _local_rows("train"))


def prompt_tokens(questions: str, template_chars: int) -> float:
    """The mean tokens of a generation-analysis prompt (evaluate/questions.py): its template's own characters, and a
    question with its choices (MMLU: lm-eval's 0-shot request; local: the shipped rows of the same construction)."""
    if questions == "mmlu":
        return PAPER["mmlu"][2] + template_chars / CHARS_PER_TOKEN
    rows = _local_rows("test")
    chars = sum(len(r["context"]) + sum(len(c) + 4 for c in r["choices"]) for r in rows) / len(rows)
    return (chars + template_chars) / CHARS_PER_TOKEN


@cache
def _text(path: str) -> tuple[int, int, float, float]:
    """The `text:PATH` task's figures from the rows lm-eval will get (built from the file as stage 3 builds them:
    WikiText contexts are several times the synthetic task's)."""

    rows = text_rows(path)
    return _figures(rows["test"], rows["train"])


def task_figures(task: str, text: str | None = None) -> tuple[int, int, float, float]:
    """`text`: the file of a `text:PATH` suite (harness.text_source)."""
    name = base_name(task).removeprefix(PREFIX).removesuffix("_fewshot")
    if name in PAPER:
        return PAPER[name]
    if name == TEXT_CONTINUATION and text is not None:
        return _text(text)
    if name in (CONTINUATION, TEXT_CONTINUATION):
        return _local()
    return UNKNOWN


def suite_tokens(spec: str, num_fewshot: int | None, limit: int | None) -> tuple[float, float]:
    """(tokens forwarded through one model by the suite, their mean request length)."""
    tokens = requests = 0.0
    text = text_source(spec)
    for task, shots in parse_tasks(spec, num_fewshot):
        rows, per_row, tok, shot = task_figures(task, text)
        if limit is not None:
            rows = min(rows, limit * SUBTASKS.get(base_name(task).removeprefix(PREFIX), 1))
        requests += rows * per_row
        tokens += rows * per_row * (tok + shots * shot)
    return tokens, tokens / requests if requests else 0.0
