"""lm-eval (the real harness, offline) on the local task built from the embedded corpus."""

from __future__ import annotations

import json

import pytest

from m2d_ray.errors import M2DError
from m2d_ray.evaluate.harness import PAPER_SUITE, evaluate, parse_tasks
from m2d_ray.evaluate.local_tasks import CONTINUATION, TASKS_DIR, continuation_rows


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


def test_teacher_beats_a_random_student_on_the_local_task():
    from m2d_ray.convert.baselines import BASELINES
    from m2d_ray.models import load_teacher

    teacher = load_teacher()
    suite = [(CONTINUATION, 0)]
    good = evaluate(teacher.model, teacher.tokenizer, suite, limit=40)
    bad = evaluate(BASELINES["random-init"](teacher), teacher.tokenizer, suite, limit=40)
    assert good["tasks"][CONTINUATION]["n"] == 40 and good["mean"] == good["tasks"][CONTINUATION]["acc"]
    assert good["mean"] >= 0.9 and bad["mean"] <= 0.5  # chance is 0.25


def test_m2d_eval_cli(capsys):
    from m2d_ray.cli import main
    from m2d_ray.models import default_teacher

    assert main(["eval", "--model", default_teacher(), "--tasks", "local", "--limit", "8", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["tasks"]) == {CONTINUATION, f"{CONTINUATION}_fewshot"} and out["tasks"][f"{CONTINUATION}_fewshot"]["shots"] == 2
    assert main(["eval", "--model", default_teacher(), "--tasks", "no_such_task", "--device", "cpu"]) == 2
    assert "lm-eval failed" in capsys.readouterr().err
