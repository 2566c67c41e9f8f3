"""What the models write (stage 3's generation analysis, stages/analysis.py), as the report shows it, from the records
in RUN_DIR/analysis/:

    categories.png            the paper's figure: each model's answers by category, stacked, models by accuracy
    answer_groups.csv/.md     accuracy per MMLU subject group, the catastrophic-failure and knowledge-error rates
    answer_excerpts.csv/.md   one answer per category per model (the paper's examples table)
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from m2d_ray.evaluate.questions import GROUPS, UNMAPPED
from m2d_ray.evaluate.taxonomy import CATEGORIES
from m2d_ray.report.analysis import RunData
from m2d_ray.report.figures import pyplot, save
from m2d_ray.report.page import Figure, Table

COLOURS = {
    "correct": "#2e7d32",
    "knowledge": "#1565c0",
    "reasoning": "#6a1b9a",
    "other": "#9e9e9e",
    "repetitive": "#ef6c00",
    "incoherent": "#c62828",
    "unjudged": "#d7ccc8",
}


def models(data: RunData) -> list[dict]:
    """The classified models, most accurate first (ties by fewer catastrophic failures, then by name)."""
    ok = [r for r in data.analysis.values() if r.get("status") == "ok"]
    return sorted(ok, key=lambda r: (-(r["accuracy"] or 0.0), r["catastrophic"] or 0.0, r["pair"]))


def label(r: dict) -> str:
    return r["pair"].upper() if "/" in r["pair"] else r["pair"]


def categories_figure(rows: list[dict], path: Path) -> Path | None:
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    names = [label(r) for r in rows][::-1]
    left = [0.0] * len(rows)
    for cat in CATEGORIES:
        share = [100 * (r["shares"][cat] or 0.0) for r in rows][::-1]
        if any(share):
            ax.barh(names, share, left=left, color=COLOURS[cat], label=cat, edgecolor="white", linewidth=0.5)
            left = [a + b for a, b in zip(left, share)]
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of answers")
    ax.legend(ncol=len(CATEGORIES), loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return save(fig, path)


def groups_table(rows: list[dict]) -> Table:
    groups = [*GROUPS, *([UNMAPPED] if any(UNMAPPED in r["groups"] for r in rows) else [])]
    body = [
        [
            label(r),
            r["n"],
            r["accuracy"],
            *[r["groups"].get(g, {}).get("accuracy") for g in groups],
            r["catastrophic"],
            r["knowledge_errors"],
            r["truncated"],
            (r.get("judge_sureness") or {}).get("unsure"),
            r.get("judge_extracted"),
        ]
        for r in rows
    ]
    return Table(
        "answer_groups",
        [
            "model",
            "answers",
            "accuracy",
            *groups,
            "catastrophic",
            "knowledge errors",
            "cut at the token limit",
            "judge unsure",
            "judge-extracted",
        ],
        body,
        "Accuracy of the generated answers (the extracted final answer is the key) per MMLU subject group; "
        "catastrophic = incoherent + repetitive; the shares of all answers. Empty: no question of that group. Judge "
        "unsure: the share of the teacher judge's verdicts less sure than 3:1 (|log-odds| < log 3; empty: a judge "
        "that gives no odds); judge-extracted: answers whose final answer the judge read where no rule could.",
    )


def excerpts_table(rows: list[dict]) -> Table:
    body = [
        [label(r), cat, e["subject"], e["extracted"], e["reason"], e["text"]]
        for r in rows
        for cat in CATEGORIES
        if (e := r.get("excerpts", {}).get(cat))
    ]
    return Table(
        "answer_excerpts",
        ["model", "category", "subject", "extracted", "why (other)", "answer (start)"],
        body,
        "The first answer of each category per model, in question order; every answer is in "
        "RUN_DIR/analysis/responses/KEY.jsonl and in the model's MLflow run.",
    )


def _judge_note(data: RunData) -> str:
    path = data.run_dir / "analysis" / "judge.json"
    judge = json.loads(path.read_text())["judge"] if path.exists() else "?"
    th = data.cfg.stage3.analysis.thresholds
    return (
        f"<p class='note'>Each answer is put in one category, in this order: incoherent (filler words &gt; "
        f"{th.filler_ratio:.0%} and distinct words &lt; {th.unique_ratio:.0%}, or digits &gt; {th.digit_ratio:.0%}), "
        f"repetitive (a word {th.ngram}-gram {th.repeats} times or more), correct, other (keyword overlap with the "
        f"question &lt; {th.overlap:.0%}, no final answer, or one outside the choices), then knowledge or reasoning "
        f"error as the judge (<code>{judge}</code>) decides. Prompt, judge prompt and thresholds: "
        "RUN_DIR/analysis/.</p>"
    )


def answer_parts(data: RunData) -> list:
    """The parts of the report's analysis section (none when the run has no classified model)."""
    rows = models(data)
    if not rows:
        return []
    fig = Figure(
        "categories.png",
        "the models' answers by category",
        "Each model's generated answers by category (the paper's error taxonomy), models by accuracy, best at the top: "
        "green is correct; orange and red are the catastrophic failures (repetitive, incoherent).",
        partial(categories_figure, rows),
    )
    return [fig, _judge_note(data), groups_table(rows), excerpts_table(rows)]
