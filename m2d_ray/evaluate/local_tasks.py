"""Offline multiple-choice tasks built from the embedded synthetic corpus (no hub needed).

`synthetic_continuation`: a paragraph cut inside a sentence, and four candidate endings: the true one and
the endings of sentences from three other paragraphs. A model of the corpus picks the ending that fits
the sentence's grammar and the paragraph's topic. The JSONL ships in the package (m2d_ray/evaluate/tasks/); `build()`
regenerates it deterministically.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
CONTINUATION = "synthetic_continuation"


def _paragraphs(split: str) -> list[list[str]]:
    from m2d_ray.data.synthetic import corpus_text

    out = []
    for para in corpus_text(split).split("\n\n"):
        sents = [s.strip(" .") + ("" if s.rstrip(" .").endswith("?") else " .") for s in para.split(" . ") if s.strip(" .")]
        if len(sents) >= 3:
            out.append(sents)
    return out


def _cut(sents: list[str], rng: random.Random) -> tuple[str, str] | None:
    """(context, ending): the paragraph up to a point inside its last usable sentence, and that sentence's rest."""
    for j in range(len(sents) - 1, 0, -1):
        words = sents[j].split()
        if len(words) >= 6:
            k = rng.randint(2, len(words) - 4)
            return " ".join(sents[:j] + words[:k]), " ".join(words[k:])
    return None


def continuation_rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """Context = a paragraph cut inside a sentence; choices = its true ending and the endings of three other paragraphs."""
    rng = random.Random(seed)
    cuts = [c for c in (_cut(p, rng) for p in _paragraphs(split)) if c is not None]
    rows = []
    for i in rng.sample(range(len(cuts)), min(n, len(cuts))):
        others = rng.sample([j for j in range(len(cuts)) if j != i], 3)
        choices = [cuts[i][1]] + [cuts[j][1] for j in others]
        order = list(range(4))
        rng.shuffle(order)
        rows.append({"context": cuts[i][0], "choices": [choices[o] for o in order], "label": order.index(0)})
    return rows


def build(n_test: int = 200, n_fewshot: int = 50) -> None:
    """Write the shipped JSONL files (test from the corpus' test split, few-shot examples from train)."""
    TASKS_DIR.mkdir(exist_ok=True)
    for name, split, n in (("test", "test", n_test), ("train", "train", n_fewshot)):
        rows = continuation_rows(split, n, seed=len(name))
        (TASKS_DIR / f"{CONTINUATION}.{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_task_yamls(dest: Path) -> Path:
    """lm-eval task YAMLs for the local tasks, with absolute data paths, into `dest` (an include_path)."""
    import yaml

    dest.mkdir(parents=True, exist_ok=True)
    files = {s: str(TASKS_DIR / f"{CONTINUATION}.{s}.jsonl") for s in ("train", "test")}
    cfg = {
        "task": CONTINUATION,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": files},
        "training_split": "train",
        "test_split": "test",
        "fewshot_split": "train",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    for name in (CONTINUATION, f"{CONTINUATION}_fewshot"):  # one name per shot count in a suite
        (dest / f"{name}.yaml").write_text(yaml.safe_dump({**cfg, "task": name}, sort_keys=False))
    return dest


if __name__ == "__main__":
    build()
