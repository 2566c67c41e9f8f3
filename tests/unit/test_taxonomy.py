"""The paper's error taxonomy as pure functions (evaluate/taxonomy.py): each rule just above and just below its
threshold, the priority order, the final answer's extraction from the shapes a chain-of-thought answer takes, and
what a model's answers add up to."""

from __future__ import annotations

import pytest

from m2d_ray.evaluate.questions import group_of
from m2d_ray.evaluate.taxonomy import (
    CATEGORIES,
    DRIFT,
    NO_ANSWER,
    OUTSIDE,
    Thresholds,
    by_rules,
    classify,
    digit_ratio,
    extract,
    filler_ratio,
    incoherent,
    keywords,
    overlap,
    repetitive,
    summary,
    unique_ratio,
    words,
)

TH = Thresholds()


def _text(fillers: int, distinct: int, total: int = 100) -> str:
    """`total` words: `fillers` of them filler words (two distinct ones), the rest content words, `distinct` distinct
    words in all; shuffled deterministically so that no word 3-gram repeats much."""
    content = ["kw" + "abcdefghijklmnop"[i % (distinct - 2)] for i in range(total - fillers)]
    filler = ["the" if i % 2 else "of" for i in range(fillers)]
    ws = content + filler
    order = sorted(range(total), key=lambda i: (i * 37) % 101)
    return " ".join(ws[i] for i in order)


@pytest.mark.parametrize(
    "fillers, distinct, expected",
    [
        (36, 14, True),  # filler 0.36 > 0.35 and unique 0.14 < 0.15
        (35, 14, False),  # filler exactly 0.35: not above
        (36, 15, False),  # unique exactly 0.15: not below
    ],
)
def test_incoherent_by_filler_and_unique_words_at_the_thresholds(fillers, distinct, expected):
    text = _text(fillers, distinct)
    ws = words(text)
    assert len(ws) == 100 and filler_ratio(ws) == fillers / 100 and unique_ratio(ws) == distinct / 100
    assert incoherent(text) is expected


@pytest.mark.parametrize("digits, expected", [(31, True), (30, False)])
def test_incoherent_by_digits_at_the_threshold(digits, expected):
    text = "1" * digits + " " + "x" * (100 - digits)  # spaces do not count
    assert digit_ratio(text) == digits / 100 and incoherent(text) is expected


@pytest.mark.parametrize("times, expected", [(5, True), (4, False)])
def test_repetitive_at_the_threshold(times, expected):
    text = "so first " + "we add salt " * times + "and then serve"
    assert repetitive(text) is expected


@pytest.mark.parametrize("used, drift", [(15, False), (14, True)])
def test_topic_drift_at_the_threshold(used, drift):
    question = " ".join(f"term{i}" for i in range(90))
    choices = [f"pick{i} pick{i + 10}" for i in range(5)]  # 10 more keywords: 100 in all
    keys = keywords(question, choices)
    assert len(keys) == 100
    response = "we consider " + " ".join(f"term{i}" for i in range(used)) + " so the answer is (B)."
    assert overlap(words(response), keys) == used / 100
    r = {"question": question, "choices": choices, "answer": "C", "response": response}
    v = by_rules(r)
    assert (v.category, v.reason) == (("other", DRIFT) if drift else (None, ""))


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Let's see. The answer is (B).", "B"),
        ("Reasoning ... Answer: C", "C"),
        ("The correct answer is **D**.", "D"),
        ("so the answer is b.", "B"),  # lower case, followed by punctuation
        ("the answer is a fact we know", "a fact we know"),  # lower-case 'a' before a word: not a letter
        ("Final answer: $\\boxed{A}$", "A"),
        ("\\boxed{\\text{C}}", "C"),
        ("The answer is Rome", "C"),  # a choice's text maps to its letter
        ("The answer is (E).", "E"),  # a letter outside the choices is kept as stated
        ("I think it is this one.\n(B)", "B"),  # no statement: a last line that is only a letter
        ("Answer:\nA", "A"),
        ("The answer is B. Question: next one. The answer is C.", "B"),  # the first statement, as lm-eval's CoT MMLU
        ("Paris is the capital, so A is right", None),  # a letter inside a sentence is no final answer
        ("", None),
    ],
)
def test_answer_extraction(response, expected):
    assert extract(response, ["Paris", "London", "Rome", "Berlin"]) == expected


QUESTION = {
    "subject": "astronomy",
    "question": "Which planet of the solar system has the largest moon Ganymede orbiting it?",
    "choices": ["Jupiter", "Saturn", "Neptune", "Mars"],
    "answer": "A",
}
ON_TOPIC = "Ganymede is a large moon of the solar system; the planet it orbits is a gas giant. "
#: on topic, many distinct words (not incoherent), one 3-gram five times
LOOP = ON_TOPIC + " ".join(f"{w} orbits Jupiter quickly." for w in ("Io", "Europa", "Ganymede", "Callisto", "Amalthea"))


@pytest.mark.parametrize(
    "response, category, reason",
    [
        ("7 " * 40 + "the answer is (A)", "incoherent", ""),  # digits first, whatever else holds
        (LOOP + "The answer is (A).", "repetitive", ""),  # before correct: a loop is no answer
        ("The answer is (A).", "correct", ""),  # before drift: a bare right answer shares no keywords
        ("Cooking pasta needs salted water and time.", "other", DRIFT),  # drift before no answer
        (ON_TOPIC, "other", NO_ANSWER),
        (ON_TOPIC + "The answer is (F).", "other", OUTSIDE),
        (ON_TOPIC + "The answer is (B).", "unjudged", ""),  # wrong, coherent, on-topic: the judge's; none asked
    ],
)
def test_priority_order(response, category, reason):
    [out] = classify([{**QUESTION, "id": "q", "response": response}])
    assert (out["category"], out["reason"]) == (category, reason)


def test_the_judge_decides_only_wrong_coherent_on_topic_answers():
    rows = [
        {**QUESTION, "id": "right", "response": ON_TOPIC + "The answer is (A)."},
        {**QUESTION, "id": "wrong1", "response": ON_TOPIC + "The answer is (B)."},
        {**QUESTION, "id": "loop", "response": "the moon the moon the moon the moon the moon the moon"},
        {**QUESTION, "id": "wrong2", "response": ON_TOPIC + "Answer: D"},
    ]
    asked = []

    def judge(records):
        asked.extend(r["id"] for r in records)
        return ["knowledge", "reasoning"]

    out = classify(rows, judge)
    assert asked == ["wrong1", "wrong2"]
    assert [r["category"] for r in out] == ["correct", "knowledge", "repetitive", "reasoning"]
    assert [r["extracted"] for r in out] == ["A", "B", None, "D"]


def test_thresholds_are_the_rules():
    text = "so first " + "we add salt " * 4 + "and then serve"
    assert not repetitive(text) and repetitive(text, Thresholds(repeats=4))
    assert by_rules({**QUESTION, "response": "The answer is (B)."}, Thresholds(overlap=0.0)).category is None


def test_summary_counts_shares_rates_and_subject_groups():
    cats = ["correct", "correct", "incoherent", "repetitive", "knowledge", "other", "reasoning", "unjudged"]
    subjects = ["philosophy", "astronomy", "astronomy", "sociology", "virology", "virology", "philosophy", "x"]
    s = summary([{"category": c, "subject": sub} for c, sub in zip(cats, subjects)], group_of)
    assert s["n"] == 8 and sum(s["counts"].values()) == 8 and set(s["counts"]) == set(CATEGORIES)
    assert sum(s["shares"].values()) == pytest.approx(1.0)
    assert (s["catastrophic"], s["knowledge_errors"], s["accuracy"]) == (2 / 8, 1 / 8, 2 / 8)
    assert s["groups"]["humanities"] == {"n": 2, "correct": 1, "accuracy": 0.5}
    assert s["groups"]["STEM"] == {"n": 2, "correct": 1, "accuracy": 0.5}
    assert s["groups"]["social sciences"]["accuracy"] == 0.0 and s["groups"]["other"]["n"] == 2
    assert s["groups"]["unmapped"]["n"] == 1  # a subject of neither question set is not put in MMLU's "other"
