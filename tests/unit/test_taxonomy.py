"""The paper's error taxonomy as pure functions (evaluate/taxonomy.py): each rule just above and just below its
threshold, the priority order, the final answer's extraction from the shapes a chain-of-thought answer takes (one
table, `SHAPES`: a new shape is one row), the answer key's rule, the cut where a model's answer ended, and what a
model's answers add up to."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from m2d_ray.evaluate.extraction import HEDGED, NO_ANSWER, OUTSIDE, extract, integer_base, key_letter
from m2d_ray.evaluate.questions import answer_part, group_of
from m2d_ray.evaluate.taxonomy import (
    CATEGORIES,
    DRIFT,
    Thresholds,
    by_rules,
    classify,
    digit_ratio,
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


# ---- the final answer: the shapes a chain-of-thought answer ends with --------------------------------------------
CELL = {
    "subject": "college_biology",
    "question": "Which organelle carries out photosynthesis in plant cells?",
    "choices": ["Mitochondrion", "Chloroplast", "Ribosome", "Nucleus"],
}
#: on-topic reasoning before the answer (well above the drift threshold, no 3-gram repeated, coherent)
P = (
    "Photosynthesis needs chlorophyll, and in plant cells chlorophyll sits in one organelle; the mitochondrion "
    "makes energy, the ribosome builds proteins and the nucleus keeps the genes. "
)
JUDGE = "judge"  # a wrong answer among the choices: the judge's (unjudged here, no judge asked)

#: (response, key, expected class): "correct", JUDGE, or why the response is `other`. A new shape is one more row.
SHAPES = [
    # the table (key B)
    (P + "The answer is: B", "B", "correct"),
    (P + "Therefore, the correct answer is: (B) Chloroplast.", "B", "correct"),
    (P + "**Answer**: B", "B", "correct"),
    (P + "So the answer is option B.", "B", "correct"),
    (P + "The answer is B or C.", "B", HEDGED),
    (P + "The answer is AB.", "B", OUTSIDE),  # not "in range": a letter set is no substring test
    (P + "The answer isn't A, since the mitochondrion makes energy.", "A", NO_ANSWER),
    ("", "B", NO_ANSWER),  # empty: no answer, not topic drift
    ("  \n\t ", "B", NO_ANSWER),
    # the common others
    (P + "Answer: B", "B", "correct"),
    (P + "answer: (B)", "B", "correct"),
    (P + "So it is this one:\n\n**B**", "B", "correct"),
    (P + "So it is this one:\n(B)", "B", "correct"),
    (P + "Answer:\nB", "B", "correct"),
    (P + "The correct answer is **B**.", "B", "correct"),
    (P + "so the answer is b.", "B", "correct"),  # lower case before punctuation
    (P + "The answer is (b)", "B", "correct"),
    (P + "Final answer: $\\boxed{B}$", "B", "correct"),
    (P + "\\boxed{\\text{B}}", "B", "correct"),
    (P + "The correct option is B.", "B", "correct"),
    (P + "The answer is Chloroplast.", "B", "correct"),  # a choice's text instead of its letter
    (P + "The answer is chloroplast, the green organelle.", "B", "correct"),  # ... then more words
    (P + "The answer is B, the chloroplast.", "B", "correct"),  # a comma is no hedge
    (P + "The answer is B and it holds the chlorophyll.", "B", "correct"),
    (P + "The answer is (C).", "B", JUDGE),
    (P + "The answer is (E).", "B", OUTSIDE),  # a letter past the choices
    (P + "The answer is Venus.", "B", OUTSIDE),  # a text that is no choice
    (P + "the answer is a fact of plant cells", "B", OUTSIDE),  # lower-case 'a' before a word: no letter
    (P + "The answer is", "B", NO_ANSWER),  # cut off
    (P + "So B holds the pigment, I think.", "B", NO_ANSWER),  # a letter inside a sentence states nothing
    # hedges
    (P + "The answer is either B or C.", "B", HEDGED),
    (P + "The answer is (B) or (C).", "B", HEDGED),
    (P + "The answer is B/C.", "B", HEDGED),
    (P + "The answer is B, or C.", "B", HEDGED),
    (P + "The answer is B or B.", "B", "correct"),  # one letter twice is one answer
    # the final answer when several are given in sequence
    (P + "The answer is (A). Wait: the mitochondrion makes energy, so the answer is (B).", "B", "correct"),
    (P + "The answer is (B). On second thought the answer is (C).", "B", JUDGE),
    (P + "The answer is not A. The answer is B.", "B", "correct"),
    (P + "The answer is (B).\n\nIn short, the answer is clear.", "B", "correct"),  # a statement naming nothing
    (P + "The answer is (C).\n(B)", "B", "correct"),  # a bare last line after the statement
    (P + "The answer is (B). Then again, the answer is AB.", "B", OUTSIDE),
    # the rules before the answer
    ("Cooking pasta needs salted water and time. The answer is (C).", "B", DRIFT),
]


def _class(v) -> str:
    return v.reason if v.category == "other" else (v.category or JUDGE)


@pytest.mark.parametrize("response, key, expected", SHAPES, ids=[f"{i:02d}" for i in range(len(SHAPES))])
def test_answer_shapes(response, key, expected):
    assert _class(by_rules({**CELL, "answer": key, "response": response})) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is B or C.", ("B/C", HEDGED)),
        ("The answer is AB.", ("AB", OUTSIDE)),
        ("the answer is a fact we know", ("a fact we know", OUTSIDE)),  # the statement's text, as written
        ("The answer is (E).", ("E", OUTSIDE)),  # a letter outside the choices, kept as stated
        ("The answer is Rome", ("C", "")),
        ("The answer is (B). Question: next one. The answer is C.", ("C", "")),  # the last (the run-on is cut
        # before the rules read it: test_a_run_on_answer_is_read_where_it_ended)
        ("", (None, NO_ANSWER)),
    ],
)
def test_what_extraction_records(response, expected):
    assert extract(response, ["Paris", "London", "Rome", "Berlin"]) == expected


def test_a_choice_text_of_two_choices_names_none():
    assert extract("The answer is Rome.", ["Rome", "Paris", "Rome"]) == ("Rome", OUTSIDE)
    assert extract("The answer is Rome, Italy.", ["Rome", "Rome, Italy"]) == ("B", "")  # equal beats starting with


#: issue 55's kinds: (choices, response, what extraction reads) - the rules of taxonomy.py, one row per kind
METALS = ["Iron", "Copper", "Zinc", "Tin"]
ROMAN = ["I only", "II only", "I and III", "II and III"]
ECON = ["A fall in prices", "Lower taxes", "A rise in interest rates", "A trade surplus"]
CELLS = ["Chloroplast", "Mitochondria", "Ribosome", "Nucleus"]
GASES = ["Nitrogen", "Hydrogen", "Oxygen", "Helium"]
KINDS = [
    # rule 2: a choice's own text before a single letter
    (ROMAN, "Statement I fails, so it has to be II and III", ("D", "")),
    (ROMAN, "The answer is I only.", ("A", "")),
    (ECON, "Thus the answer is A rise in interest rates.", ("C", "")),
    (ECON, "The answer is (A) A fall in prices.", ("A", "")),  # a letter written as a label is a letter
    # rule 6: "Answer:" then a capitalised word is no letter
    (METALS, "Answer: I'd go with option D.", ("D", "")),
    (METALS, "Answer: A metal, namely copper (B).", ("B", "")),
    # rule 4: hypotheticals, negations and questions are no answers
    (METALS, "If the answer is D, the boiling point would double, which is absurd. So B.", ("B", "")),
    (METALS, "If tin were harder, D would be right, but it is not.", (None, NO_ANSWER)),
    (METALS, "If I had to choose, the answer would be B.", ("B", "")),  # a choice, not a hypothesis
    (METALS, "D is not correct.", (None, NO_ANSWER)),
    (METALS, "It can't be D.", (None, NO_ANSWER)),
    (METALS, "Is the answer D?", (None, NO_ANSWER)),
    # rule 3: the common statements, wherever they stand
    (METALS, "Hence D is the correct answer.", ("D", "")),
    (METALS, "(D) is correct.", ("D", "")),
    (METALS, "B seems right: copper conducts well.", ("B", "")),
    (CELLS, "Energy comes from them.\nB. Mitochondria", ("B", "")),  # a final "A. text" line
    (CELLS, "The choices are:\nA. Chloroplast\nB. Mitochondria", (None, NO_ANSWER)),  # a list of choices is not
    (METALS, "Answer - D", ("D", "")),
    (METALS, "After all that, the right choice would be B", ("B", "")),
    (METALS, "Tin is soft, so it can only be D", ("D", "")),
    (METALS, "$\\boxed{\\mathbf{B}}$", ("B", "")),
    (METALS, "so the answer is d since tin is soft", ("D", "")),  # lower case before a connective
    (GASES, "The answer is 3) oxygen", ("C", "")),  # a numbered option when the choices are lettered
    (METALS, "We can rule out A, C and D. That leaves B.", ("B", "")),  # a final sentence ending in a letter
    (METALS, "Copper is soft. So my pick is B) Copper.", ("B", "")),
    (METALS, "The best conductor here is copper.", ("B", "")),  # a final sentence ending in a choice's text
    (METALS, "There will be C atoms in it.", (None, NO_ANSWER)),  # a letter in a sentence is not a label
    # non-English cues (and full-width forms)
    (METALS, "答案是 D", ("D", "")),
    (METALS, "答案：Ｄ", ("D", "")),
    (METALS, "Die Antwort ist B.", ("B", "")),
    (METALS, "La réponse est C.", ("C", "")),
    (METALS, "La respuesta correcta es B.", ("B", "")),
    (METALS, "Ответ: C", ("C", "")),
    # rule 5: hedges by meaning, not adjacency
    (METALS, "The answer is B, and D is far too large.", ("B", "")),
    (METALS, "The answer is B (though maybe C).", ("B/C", HEDGED)),
    (METALS, "The answer is B, or possibly C.", ("B/C", HEDGED)),
    (METALS, "The answer is B, but C is also plausible.", ("B/C", HEDGED)),
]


@pytest.mark.parametrize("choices, response, expected", KINDS, ids=[f"{i:02d}" for i in range(len(KINDS))])
def test_the_kinds_a_grader_reads(choices, response, expected):
    assert extract(response, choices) == expected


#: (the key as a responses file gives it, its letter, or the error's start) for the choices of CELL
KEYS = [
    ("B", "B"),
    ("b", "B"),
    (" B ", "B"),
    (1, "B"),  # Hugging Face's MMLU: 0-based
    (0, "A"),
    ("Chloroplast", "B"),  # the choice's exact text
    (4, "is 4, not an index"),
    (-1, "is -1, not an index"),
    ("E", "is 'E': no letter A-D nor a choice's text"),
    ("1", "is '1': no letter"),  # a string of digits is no index
    ("chloroplast", "is 'chloroplast': no letter"),  # exact text only
    (1.0, "is 1.0, neither"),
    (True, "is True, neither"),
    (None, "is None, neither"),
]


@pytest.mark.parametrize("key, expected", KEYS)
def test_the_answer_key_rule(key, expected):
    if len(expected) == 1:
        assert key_letter(key, CELL["choices"]) == expected
    else:
        with pytest.raises(ValueError, match=re.escape(expected)):
            key_letter(key, CELL["choices"])


def test_keys_counted_from_one_when_asked_or_detected_and_numpy_integers():
    import numpy as np

    choices = CELL["choices"]
    assert key_letter(np.int64(1), choices) == "B" and key_letter(np.int32(4), choices, base=1) == "D"
    assert key_letter(1, choices, base=1) == "A"
    with pytest.raises(ValueError, match=re.escape("is 0, not an index of its 4 choices (1 to 4, counted from 1)")):
        key_letter(0, choices, base=1)
    assert integer_base([(4, 4), (1, 4), ("B", 4)]) == 1  # the number of choices, never 0: counted from 1
    assert integer_base([(np.int64(4), 4), (2, 4)]) == 1
    assert integer_base([(4, 4), (0, 4)]) == 0  # both: no base reads them (key_letter then refuses the 4)
    assert integer_base([(1, 4), (3, 4)]) == 0  # nothing says: Hugging Face's MMLU counts from 0
    assert integer_base([(True, 1), ("1", 1)]) == 0  # neither is an integer key


def test_a_key_that_is_two_choices_texts_is_refused():
    with pytest.raises(ValueError, match="the text of 2 choices"):
        key_letter("Rome", ["Rome", "Paris", "Rome"])


# ---- where the answer ended -------------------------------------------------------------------------------------
#: a base model that answers right, then writes five questions of its own in the prompt's format
RUN_ON = (
    P
    + "The answer is (B).\n"
    + "".join(
        f"\nQuestion: Which planet is number {i} from the sun?\nA. Mars\nB. Venus\nAnswer: Let's think step by step. "
        "The answer is (A).\n"
        for i in range(5)
    )
)


def test_a_run_on_answer_is_read_where_it_ended():
    r = {**CELL, "answer": "B", "response": RUN_ON}
    assert by_rules(r).category == "repetitive"  # the whole text: its made-up questions repeat 3-grams
    answer, run_on = answer_part(RUN_ON)
    assert answer == P + "The answer is (B).\n" and run_on.startswith("\nQuestion: Which planet")
    assert by_rules({**r, "response": answer}).category == "correct"


@pytest.mark.parametrize(
    "text, kept",
    [
        ("The answer is (B).\n\nQuestion: next?", "The answer is (B).\n"),
        ("The answer is (B).\n**Question:** next?", "The answer is (B)."),
        ("The answer is (B).\nThe following is a multiple choice question about x.", "The answer is (B)."),
        ("The answer is (B).</s>junk", "The answer is (B)."),
        ("The answer is (B).<|im_end|>", "The answer is (B)."),
        # issue 55: every common next-question and chat-turn marker
        ("The answer is (B).\nThe following are multiple choice questions about x.", "The answer is (B)."),
        ("The answer is (B).\nQuestion 7: next?", "The answer is (B)."),
        ("The answer is (B).\n### Question\nnext?", "The answer is (B)."),
        ("The answer is (B).\n**Question 2**\nnext?", "The answer is (B)."),
        ("The answer is (B).\nProblem: next?", "The answer is (B)."),
        ("The answer is (B).\nQ: next?", "The answer is (B)."),
        ("The answer is (B).\nUser: thanks", "The answer is (B)."),
        ("The answer is (B).\n\nHuman: next", "The answer is (B).\n"),
        ("The answer is (B).<end_of_turn>\n<start_of_turn>user", "The answer is (B)."),
        ("The answer is (B).<|im_start|>user", "The answer is (B)."),
        ("Questions like this one are hard.\nQuestionable. (B)", None),  # words that only begin like markers
        ("The question: which one? The answer is (B).", None),  # inside a line, or not the template's opening
        ("Consider the Question: of light.\nSo (B).", None),
    ],
)
def test_answer_part_cuts_at_the_next_question_or_an_end_of_text(text, kept):
    answer, run_on = answer_part(text)
    assert (answer, run_on) == ((text, "") if kept is None else (kept, text[len(kept) :]))


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


# ---- the labelled set: m2d against the extractors people use (python -m benchmarks.science.answer_extraction) ------
EXTRACTION_SET = ROOT / "benchmarks" / "data" / "extraction_set.jsonl"  # labelled by hand (RESULTS.md)


def _extraction(rows_file: Path) -> dict:
    """The benchmark's --json line over a set file: each extractor's letters ("read") and agreement with the labels."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.science.answer_extraction", "--set", str(rows_file), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _opencompass_here() -> bool:
    """OpenCompass's code is here: installed, or its wheel fetched where the benchmark reads it."""
    wheels = Path.home() / ".cache" / "m2d" / "wheels"
    return importlib.util.find_spec("opencompass") is not None or any(wheels.glob("opencompass-0.5.2-*.whl"))


def test_m2d_leads_every_anchor_on_the_labelled_set():
    rows = [json.loads(line) for line in EXTRACTION_SET.read_text().splitlines()]
    real = [r for r in rows if r["source"] != "written"]
    assert len(rows) >= 150 and len(real) > len(rows) / 2  # the bulk real generations
    assert all(r["label"] is None or r["label"] in "ABCDE" and len(r["label"]) == 1 for r in rows)
    scores = _extraction(EXTRACTION_SET)["agreement"]
    assert len(scores) == 5 + _opencompass_here()  # OpenCompass: where its wheel is
    for part in ("all", "written", "held out", "committed"):
        ours = scores["m2d"][part][0]
        assert all(ours > s[part][0] for name, s in scores.items() if name != "m2d"), (part, scores)
    assert scores["m2d"]["real"][0] == len(real)  # no letter read into text that commits to none


def test_the_anchors_read_as_their_sources_do(tmp_path):
    said = ["The answer is (C).", "答案是B", "I think A metal", "nothing here", "Answer: b", "Answer - B"]
    said += ["so (B).", "it is zinc", "hm"]
    rows = [
        {"id": str(i), "response": r, "choices": ["Iron", "Copper", "Zinc", "Tin"], "label": None}
        | {"source": "written", "kind": "anchor"}
        for i, r in enumerate(said)
    ]
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = _extraction(tmp_path / "set.jsonl")["read"]
    fo = read.get("OpenCompass first_option_postprocess")
    if _opencompass_here():  # OpenCompass's own code (science/answer_extraction.py); "" read as no letter
        assert fo[:4] == ["C", "B", "A", None]  # its cushion: any capital
    assert read["simple-evals Answer: pattern"][4:6] == ["b", None]
    mcr = next(got for name, got in read.items() if "multi_choice_regex" in name)
    assert mcr[6:] == ["B", "C", None]  # its regex, then a choice's text, then none


# ---- issue 55's judge kinds: one verdict, Retry-After in both forms, how sure it was, what it extracts -----------
def test_only_one_label_is_a_verdict():
    from m2d_ray.evaluate.judges import parse_letter, parse_reply

    replies = ["Reasoning or knowledge", "knowledge, not reasoning", "Knowledge.", "**Reasoning** error", "none"]
    assert [parse_reply(x) for x in replies] == ["unjudged", "unjudged", "knowledge", "reasoning", "unjudged"]
    assert [parse_letter(x, 4) for x in ("B", "(c)", "none", "E", "B or C")] == ["B", "C", None, None, "B"]


def test_retry_after_in_seconds_and_as_an_http_date():
    from m2d_ray.evaluate.judges import retried, retry_after

    assert [retried(c) for c in (408, 429, 500, 503, 400, 401, 404)] == [True] * 4 + [False] * 3

    now = 1_700_000_000.0
    assert retry_after("3", now) == 3.0 and retry_after("0.5", now) == 0.5
    assert retry_after("Tue, 14 Nov 2023 22:13:50 GMT", now) == 30.0  # 30 s after `now`
    assert retry_after("Tue, 14 Nov 2023 22:00:00 GMT", now) == 0.0  # past: at once
    assert retry_after("soon", now) is None and retry_after(None, now) is None


def test_the_judges_log_odds_are_kept_and_summed_up():
    from m2d_ray.evaluate.judges import log_odds

    class Sure:
        log_odds: list[float] = []

        def __call__(self, records):
            self.log_odds = [log_odds(0.9), log_odds(0.6)]
            return ["knowledge", "knowledge"]

    rows = [{**QUESTION, "id": str(i), "response": ON_TOPIC + f"The answer is ({x})."} for i, x in enumerate("BC")]
    out = classify(rows, Sure())
    assert [r["judge_log_odds"] for r in out] == [round(math.log(9), 4), round(math.log(1.5), 4)]
    s = summary(out, group_of)["judge_sureness"]
    assert (
        s["n"] == 2
        and s["unsure"] == 0.5
        and s["median_abs_log_odds"] == pytest.approx((math.log(9) + math.log(1.5)) / 2, abs=1e-4)
    )
    assert summary(classify(rows), group_of)["judge_sureness"] is None  # no odds given: none claimed
    assert log_odds(1.0) == pytest.approx(27.631, abs=1e-3)  # finite: JSON has no infinity


def test_a_judge_reads_what_no_rule_reads_recorded_as_judge_extracted():
    rows = [
        {**QUESTION, "id": "a", "response": ON_TOPIC + "I'd say the gas giant that Ganymede circles."},
        {**QUESTION, "id": "b", "response": ON_TOPIC + "The answer is (A)."},  # the rules read it: not asked
        {**QUESTION, "id": "c", "response": ON_TOPIC + "The answer is (B) or (C)."},
    ]
    asked = []

    def extractor(records):
        asked.extend(r["id"] for r in records)
        return ["A", None]

    out = classify(rows, extractor=extractor)
    assert asked == ["a", "c"]
    assert [(r["category"], r["extracted"], r["extracted_by"]) for r in out] == [
        ("correct", "A", "judge"),
        ("correct", "A", "rules"),
        ("other", "B/C", "rules"),
    ]
