"""Offline multiple-choice tasks built from local text (no hub needed).

`synthetic_continuation`: a paragraph cut inside a sentence, and four candidate endings: the true one and
the endings of sentences from three other paragraphs. A model of the corpus picks the ending that fits
the sentence's grammar and the paragraph's topic. The JSONL ships in the package (m2d_ray/evaluate/tasks/); `build()`
regenerates it deterministically.

`text_continuation`: built at evaluation time from any WikiText-style text file (`--tasks text:PATH`,
0-shot, 400 items from the file's last three quarters): the last three sentences of a paragraph cut inside
a sentence, the true ending and three copies of it with two words swapped. Ends from other paragraphs
(the synthetic task's distractors) left a 4.4M-parameter real-text teacher near chance (0.31), a full
shuffle at the ceiling (0.94); a swap separates the teacher (0.79) from a random-init student (0.62).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import yaml

from m2d_ray.data import source
from m2d_ray.data.synthetic import corpus_text
from m2d_ray.errors import M2DError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
from m2d_ray.catalog.evaluate import CONTINUATION, TEXT_CONTINUATION  # noqa: E402


def paragraphs(text: str) -> list[list[str]]:
    """Paragraphs as lists of ` . `-separated sentences; headings `= … =` dropped (`text` with `\\n` line ends).

    Blocks are blank-line separated; a block of long lines (WikiText: one paragraph per line) is split at
    its lines, a block of hard-wrapped short lines is one paragraph."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.split("\n") if ln.strip()]
        paras = lines if lines and max(map(len, lines)) > 200 else [" ".join(lines)]
        out += [sents for sents in map(_sentences, paras) if sents]
    return out


def _sentences(para: str) -> list[str] | None:
    if para.startswith("="):
        return None
    sents = [s.strip(" .") + ("" if s.rstrip(" .").endswith("?") else " .") for s in para.split(" . ") if s.strip(" .")]
    return sents if len(sents) >= 3 else None


def _cut(sents: list[str], rng: random.Random, context_sents: int | None = None) -> tuple[str, str] | None:
    """(context, ending): the paragraph (or its last `context_sents` whole sentences) up to a point inside
    its last usable sentence, and that sentence's rest."""
    for j in range(len(sents) - 1, 0, -1):
        words = sents[j].split()
        if len(words) >= 6:
            k = rng.randint(2, len(words) - 4)
            return " ".join(sents[max(0, j - (context_sents or j)) : j] + words[:k]), " ".join(words[k:])
    return None


def continuation_rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """The synthetic task's items from the embedded corpus' `split`."""

    return rows_from(paragraphs(corpus_text(split)), n, seed)


def rows_from(
    paras: list[list[str]], n: int, seed: int = 0, context_sents: int | None = None, shuffle: bool = False
) -> list[dict]:
    """Context = a paragraph cut inside a sentence; choices = its true ending and the endings of three other
    paragraphs, or (`shuffle`) three copies of the true ending with two words swapped."""
    rng = random.Random(seed)
    cuts = [c for c in (_cut(p, rng, context_sents) for p in paras) if c is not None]
    rows = []
    for i in rng.sample(range(len(cuts)), len(cuts)):
        if len(rows) == n:
            break
        wrong = (
            _swapped(cuts[i][1], rng)
            if shuffle
            else [cuts[j][1] for j in rng.sample([j for j in range(len(cuts)) if j != i], 3)]
        )
        if wrong is None:
            continue
        choices = [cuts[i][1], *wrong]
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


def _swapped(ending: str, rng: random.Random) -> list[str] | None:
    """Three distinct copies of `ending` with two of its words swapped (a final "." stays last): same words
    and length, so only word order tells them apart. None when the words allow fewer."""
    words = ending.split()
    tail = [words.pop()] if words[-1] in ".?" else []
    seen, out = {ending}, []
    for _ in range(50):
        i, j = rng.sample(range(len(words)), 2)
        w = words[:]
        w[i], w[j] = w[j], w[i]
        cand = " ".join(w + tail)
        if cand not in seen:
            seen.add(cand)
            out.append(cand)
            if len(out) == 3:
                return out
    return None


def text_rows(
    path: str | Path, n_test: int = 400, n_fewshot: int = 50, context_sents: int = 3
) -> dict[str, list[dict]]:
    """{"train", "test"} items of `text_continuation` from a text file (disjoint paragraphs); contexts keep
    the last `context_sents` sentences (WikiText paragraphs are long: whole ones cost 5x and fill the window)."""
    paras = paragraphs(source.decode(Path(path).read_bytes()))  # universal newlines, as every corpus reader
    cut = len(paras) // 4
    if cut < 4:
        raise M2DError(
            f"{path} has {len(paras)} usable paragraphs; text:PATH needs a WikiText-style file with at least 16"
        )
    return {
        "train": rows_from(paras[:cut], n_fewshot, 5, context_sents, shuffle=True),
        "test": rows_from(paras[cut:], n_test, 4, context_sents, shuffle=True),
    }


def write_task_yamls(dest: Path, text: str | Path | None = None) -> Path:
    """lm-eval task YAMLs for the local tasks, with absolute data paths, into `dest` (an include_path);
    with `text`, also `text_continuation` built from that file (its JSONL written into `dest`)."""

    dest.mkdir(parents=True, exist_ok=True)
    sources = {CONTINUATION: {s: str(TASKS_DIR / f"{CONTINUATION}.{s}.jsonl") for s in ("train", "test")}}
    if text is not None:
        sources[TEXT_CONTINUATION] = {}
        for split, rows in text_rows(text).items():
            path = dest / f"{TEXT_CONTINUATION}.{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            sources[TEXT_CONTINUATION][split] = str(path)
    for task, files in sources.items():
        _write_yaml(dest, task, files, yaml)
    return dest


def _write_yaml(dest: Path, task: str, files: dict[str, str], yaml) -> None:
    cfg = {
        "task": task,
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
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }
    for name in (task, f"{task}_fewshot"):  # one name per shot count in a suite
        (dest / f"{name}.yaml").write_text(yaml.safe_dump({**cfg, "task": name}, sort_keys=False))


if __name__ == "__main__":
    build()
