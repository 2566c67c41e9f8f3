"""Remake the real generations of the answer-extraction set (benchmarks/data/extraction_set.jsonl, issue 55).

Each model answers the offline questions (`--questions local`: the embedded corpus, no WikiText) with the analysis'
prompt (evaluate/questions.TEMPLATE) and sampling (temperature 0.7, seeded per batch), a few tokens each, one
process, one torch thread. The responses are written UNLABELLED to --out; the set's labels were then given by hand,
one response at a time (the letter a careful grader reads as the response's committed final answer, or none), and
kept with each response in the set. A new generation must be labelled again by hand: no extractor labels it.

    python -m benchmarks.tools.make_extraction_set --out /tmp/raw.jsonl            # the models below that exist
    python -m benchmarks.tools.make_extraction_set --model DIR --name NAME --out …  # one more model

Models: the embedded tiny teacher (m2d_ray/assets/tiny_qwen3_moe), its dense sibling asset, a student converted from
it (`m2d convert --out /tmp/m2d55/tiny_student`), the real-text teacher and its dense twin under
../shared/teachers/ and a student converted from that teacher (`m2d convert --model ../shared/teachers/qwen3moe-wiki4
--calib-data ../shared/data/wikitext-2/wiki.valid.tokens --max-tokens 4096 --out /tmp/m2d55/wiki_student`); a model
whose directory is absent is skipped with a line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import REPO, SHARED
from m2d_ray.evaluate.generation import Sampling, answer_all, load
from m2d_ray.evaluate.questions import sample

ASSETS = REPO / "m2d_ray" / "assets"
MODELS = {
    "tiny-moe": ASSETS / "tiny_qwen3_moe",
    "tiny-dense": ASSETS / "tiny_qwen3_dense",
    "tiny-student": Path("/tmp/m2d55/tiny_student"),
    "wiki-moe": SHARED / "teachers" / "qwen3moe-wiki4",
    "wiki-dense": SHARED / "teachers" / "qwen3dense-wiki4",
    "wiki-student": Path("/tmp/m2d55/wiki_student"),
}
#: the analysis' sampling (config.AnalysisConfig: temperature 0.7, seed 0), few tokens: a CPU and a reader's budget
TOKENS, TEMPERATURE, SEED, PER_DOMAIN = 48, 0.7, 0, 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--per-domain", type=int, default=PER_DOMAIN)
    a = ap.parse_args()
    torch.set_num_threads(1)
    models = {a.name or Path(a.model).name: Path(a.model)} if a.model else MODELS
    questions = sample("local", a.per_domain, SEED)
    s = Sampling(a.tokens, TEMPERATURE, SEED, 8)
    with open(a.out, "a") as f:
        for name, path in models.items():
            if not (path / "config.json").is_file():
                print(f"{name}: {path} absent, skipped")
                continue
            lm, tok = load(str(path), "cpu")
            rows = answer_all(lm, tok, questions, s)
            for r in rows:
                f.write(json.dumps({"source": name, **{k: r[k] for k in ("id", "question", "choices", "answer")},
                                    "response": r["response"]}) + "\n")  # fmt: skip
            f.flush()
            print(f"{name}: {len(rows)} answers")


if __name__ == "__main__":
    main()
