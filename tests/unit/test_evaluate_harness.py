"""lm-eval (the real harness, offline) on the local task built from the embedded corpus."""

from __future__ import annotations

import json

import pytest

from m2d_ray.errors import M2DError
from m2d_ray.evaluate.harness import PAPER_SUITE, evaluate, parse_tasks, text_source
from m2d_ray.evaluate.local_tasks import (
    CONTINUATION,
    TASKS_DIR,
    TEXT_CONTINUATION,
    continuation_rows,
    paragraphs,
    text_rows,
)

WIKI_STYLE = " = Title = \n" + "".join(
    f" Paragraph {i} starts here . It has a second sentence with several words in it . "
    f"The third sentence of paragraph {i} is long enough to cut somewhere inside . "
    "A fourth one makes the line as long as a real WikiText paragraph , which is one line of the file .\n"
    for i in range(40)
)


def test_the_shipped_task_files_are_what_build_makes():
    for split, n, seed in (("test", 200, 4), ("train", 50, 5)):
        shipped = [json.loads(x) for x in (TASKS_DIR / f"{CONTINUATION}.{split}.jsonl").read_text().splitlines()]
        assert shipped == continuation_rows(split, n, seed=seed)
        assert all(len(r["choices"]) == 4 and r["choices"][r["label"]] for r in shipped)
    test_contexts = {r["context"] for r in continuation_rows("test", 200, seed=4)}
    assert not test_contexts & {r["context"] for r in continuation_rows("train", 50, seed=5)}


def test_parse_tasks():
    assert parse_tasks("paper") == list(PAPER_SUITE)
    assert parse_tasks("hellaswag:10,arc_easy", num_fewshot=3) == [("hellaswag", 10), ("arc_easy", 3)]
    assert parse_tasks("local", num_fewshot=1) == [(CONTINUATION, 1), (f"{CONTINUATION}_fewshot", 1)]
    with pytest.raises(M2DError, match="name:shots"):
        parse_tasks("hellaswag:ten")


def test_paragraphs_of_wikitext_lines_and_of_wrapped_blocks():
    paras = paragraphs(WIKI_STYLE.replace("\n", "\r\n"))
    assert (
        len(paras) == 40 and paras[0][0] == "Paragraph 0 starts here ."
    )  # heading dropped, one paragraph per long line
    wrapped = "First sentence here . Second one\nwraps onto a line . Third sentence ends it .\n\nA heading-free block"
    assert paragraphs(wrapped) == [
        ["First sentence here .", "Second one wraps onto a line .", "Third sentence ends it ."]
    ]


def test_text_task_items_differ_from_the_truth_only_in_word_order(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text(WIKI_STYLE)
    rows = text_rows(path, n_test=20, n_fewshot=5)
    assert len(rows["test"]) == 20 and len(rows["train"]) == 5
    for r in rows["test"]:
        truth = r["choices"][r["label"]]
        wrong = [c for i, c in enumerate(r["choices"]) if i != r["label"]]
        assert len(set(wrong)) == 3 and truth not in wrong
        assert all(sorted(c.split()) == sorted(truth.split()) and c.endswith(" .") for c in wrong)
        assert r["context"].count(" . ") <= 3  # the last three sentences at most
    assert not {r["context"] for r in rows["test"]} & {r["context"] for r in rows["train"]}
    assert parse_tasks(f"text:{path}") == [(TEXT_CONTINUATION, 0)] and text_source(f"text:{path}") == str(
        path.resolve()
    )
    with pytest.raises(M2DError, match="is not a file"):
        text_source(f"text:{tmp_path / 'missing.txt'}")
    (tmp_path / "short.txt").write_text("One . Two .")
    with pytest.raises(M2DError, match="usable paragraphs"):
        text_rows(tmp_path / "short.txt")


def test_teacher_beats_a_random_student_on_the_local_task():
    from m2d_ray.catalog.methods import RANDOM_BASELINES
    from m2d_ray.models import load_teacher

    teacher = load_teacher()
    suite = [(CONTINUATION, 0)]
    good = evaluate(teacher.model, teacher.tokenizer, suite, limit=40)
    bad = evaluate(RANDOM_BASELINES["random-init"](teacher), teacher.tokenizer, suite, limit=40)
    assert good["tasks"][CONTINUATION]["n"] == 40 and good["mean"] == good["tasks"][CONTINUATION]["acc"]
    assert good["mean"] >= 0.9 and bad["mean"] <= 0.5  # chance is 0.25


def test_text_task_through_the_harness(tmp_path):
    """text:PATH builds its JSONL at evaluation time; the embedded teacher knows its corpus' word order."""
    from m2d_ray.catalog.methods import RANDOM_BASELINES
    from m2d_ray.data.synthetic import corpus_text
    from m2d_ray.models import load_teacher

    path = tmp_path / "corpus.txt"
    path.write_text(corpus_text("test"))
    teacher, suite = load_teacher(), parse_tasks(f"text:{path}")
    good = evaluate(teacher.model, teacher.tokenizer, suite, limit=40, text=text_source(f"text:{path}"))
    bad = evaluate(RANDOM_BASELINES["random-init"](teacher), teacher.tokenizer, suite, limit=40, text=str(path))
    assert good["tasks"][TEXT_CONTINUATION]["n"] == 40 and good["mean"] > bad["mean"] + 0.2


def test_m2d_eval_cli(capsys):
    from m2d_ray.cli import main
    from m2d_ray.models import default_teacher

    assert main(["eval", "--model", default_teacher(), "--tasks", "local", "--limit", "8", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        set(out["tasks"]) == {CONTINUATION, f"{CONTINUATION}_fewshot"}
        and out["tasks"][f"{CONTINUATION}_fewshot"]["shots"] == 2
    )
    assert main(["eval", "--model", default_teacher(), "--tasks", "no_such_task", "--device", "cpu"]) == 2
    assert "unknown lm-eval task 'no_such_task'" in capsys.readouterr().err
    assert main(["eval", "--model", "no/such/model", "--tasks", "text:no/such/file.txt"]) == 2  # before any model loads
    assert "is not a file" in capsys.readouterr().err
