"""What the models write, without Ray: the question sets, batched generation (left padding, KV cache, seeded per
batch, stopped at the next question and at EOS), `m2d analyze` killed and continued and reading a responses file,
the teacher judge (both label orders) against a float64 brute force on the embedded teacher, and the openai judge
against a real OpenAI-compatible server on 127.0.0.1 (tests/judge_server.py) that serves the embedded teacher,
scripted replies, and the errors servers answer with (404, 400, 5xx, cut and malformed bodies).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from conftest import ROOT
from judge_server import CUT, JudgeServer

from m2d_ray import pipeline
from m2d_ray.cli import main
from m2d_ray.config import load_config
from m2d_ray.errors import M2DError
from m2d_ray.evaluate import paper_data
from m2d_ray.evaluate.extraction import letters
from m2d_ray.evaluate.generation import BatchStore, Sampling, answer_all, answer_batch, recorded
from m2d_ray.evaluate.judges import (
    TEACHER_ASKS,
    TEACHER_LABELS,
    TIE,
    OpenAIJudge,
    TeacherJudge,
    context_ids,
    knowledge_probability,
    label_loglikelihoods,
    parse_reply,
    render,
    verdict,
)
from m2d_ray.evaluate.paper_tasks import MMLU_SUBJECTS
from m2d_ray.evaluate.questions import GROUPS, UNTIL, group_of, sample
from m2d_ray.models import default_teacher, load_model, model_config
from m2d_ray.plan.run_plan import Devices
from m2d_ray.shipped import EXPERIMENTS


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as a Ray worker has: a tiny model's decoding steps are too small to share (two threads on a
    busy 2-core machine made them 100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def teacher():
    torch.manual_seed(0)
    return load_model(default_teacher())


@pytest.fixture(scope="module")
def local():
    return sample("local", 2, 0)


# ---- the questions --------------------------------------------------------------------------------------------
def test_local_questions_are_seeded_prefix_stable_and_grouped(local):
    assert len(local) == 12 and [q.subject for q in local][::2] == [q.subject for q in local][1::2]
    assert all(len(q.choices) == 4 and q.answer in letters(4) for q in local)
    three = sample("local", 3, 0)
    assert {q.id for q in local} <= {q.id for q in three}  # a larger sample keeps the smaller
    assert {q.id for q in sample("local", 2, 1)} != {q.id for q in local}
    assert {group_of(q.subject) for q in local} <= set(GROUPS)
    assert "Think step by step" in local[0].prompt() and "A. " + local[0].choices[0] in local[0].prompt()


def _mmlu_root(root: Path, rows: int = 3) -> str:
    """MMLU's test split in the layout `m2d fetch-data` unpacks (Arrow stream files), its manifest's digest."""
    where = paper_data.data_dir(root)
    for s in MMLU_SUBJECTS:
        d = where / "hails" / "mmlu_no_train" / s / "test"
        d.mkdir(parents=True)
        table = pa.table(
            {
                "question": [f" {s} question {i}? " for i in range(rows)],
                "subject": [s] * rows,
                "choices": [[f"{s} {i} choice {j}" for j in range(4)] for i in range(rows)],
                "answer": [(i + len(s)) % 4 for i in range(rows)],
            }
        )
        with pa.ipc.new_stream(str(d / "data-00000-of-00001.arrow"), table.schema) as w:
            w.write_table(table)
    files = {str(p.relative_to(where)): paper_data.sha256_file(p) for p in sorted(where.rglob("*")) if p.is_file()}
    (where / paper_data.MANIFEST).write_text(json.dumps({"files": files}))
    return paper_data._digest(files)


def test_mmlu_questions_come_from_the_fetched_test_split(tmp_path, monkeypatch):
    monkeypatch.setenv("M2D_DATA_DIR", str(tmp_path / "none"))
    with pytest.raises(M2DError, match="run `m2d fetch-data`"):
        sample("mmlu", 2, 0)
    monkeypatch.setenv("M2D_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(paper_data, "DATA_SHA256", _mmlu_root(tmp_path))
    qs = sample("mmlu", 2, 0)
    assert len(qs) == 2 * 57 and len({q.id for q in qs}) == 114
    for q in qs:
        i = int(q.id.split("/")[1])
        assert q.question == f"{q.subject} question {i}?" and q.answer == letters(4)[(i + len(q.subject)) % 4]
    assert {group_of(q.subject) for q in qs} == set(GROUPS)  # all 57 subjects are in one of the four groups


# ---- generation -----------------------------------------------------------------------------------------------
def test_left_padded_batches_answer_as_one_question_at_a_time(teacher, local):
    lm, tok = teacher
    qs = local[:4]
    greedy = Sampling(max_new_tokens=12, temperature=0.0, seed=0)
    batched = answer_all(lm, tok, qs, Sampling(12, 0.0, 0, batch_size=4))
    alone = answer_all(lm, tok, qs, Sampling(12, 0.0, 0, batch_size=1))
    assert len({r["prompt_tokens"] for r in batched}) > 1  # the prompts differ in length: the batch is padded
    assert [r["response"] for r in batched] == [r["response"] for r in alone]
    assert all(r["finish"] in ("stop", "length") and r["new_tokens"] <= greedy.max_new_tokens for r in batched)


def test_sampling_is_seeded_per_batch(teacher, local, tmp_path):
    lm, tok = teacher
    s = Sampling(16, 0.7, 3, batch_size=4)
    first = answer_all(lm, tok, local[:8], s)
    assert [r["response"] for r in answer_all(lm, tok, local[:8], s)] == [r["response"] for r in first]
    other = answer_all(lm, tok, local[:8], Sampling(16, 0.7, 4, batch_size=4))
    assert [r["response"] for r in other] != [r["response"] for r in first]
    store = BatchStore(str(tmp_path / "answers"))  # batch 0 saved (here: made up), batch 1 generated alone
    store.save(0, [{**q.record(), "response": "saved", "finish": "stop"} for q in local[:4]])
    resumed = answer_all(lm, tok, local[:8], s, store)
    assert [r["response"] for r in resumed[:4]] == ["saved"] * 4
    assert [r["response"] for r in resumed[4:]] == [r["response"] for r in first[4:]]
    assert sorted(store.done()) == [0, 1]


def _analyze(out: Path, *extra: str) -> list[str]:
    return [
        "analyze",
        "--model",
        default_teacher(),
        "--questions",
        "local",
        "--per-subject",
        "2",
        "--max-new-tokens",
        "40",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
        *extra,
    ]


def test_analyze_killed_continues_where_it_stopped(tmp_path, capfd):
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2d_ray.cli", *_analyze(killed)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    batches = killed / Path(default_teacher()).name
    while not list(batches.glob("batch-0000[12].jsonl")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = {p.name: p.stat().st_mtime_ns for p in batches.glob("batch-*.jsonl")}
    assert 0 < len(saved) < 6 and not (killed / "responses.jsonl").exists(), saved
    capfd.readouterr()
    assert main(_analyze(killed)) == 0  # the same command continues
    out = json.loads(capfd.readouterr().out)
    assert {p.name: p.stat().st_mtime_ns for p in batches.glob("batch-*.jsonl") if p.name in saved} == saved
    assert len(list(batches.glob("batch-*.jsonl"))) == 6
    assert main(_analyze(tmp_path / "unbroken")) == 0
    unbroken = json.loads(capfd.readouterr().out)
    rows = [json.loads(x) for x in (killed / "responses.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (tmp_path / "unbroken" / "responses.jsonl").read_text().splitlines()]
    assert rows == again and out["models"] == unbroken["models"]  # what an unbroken run writes
    assert len(rows) == 12 and all({"category", "extracted", "reason", "model"} <= set(r) for r in rows)
    assert main(_analyze(killed, "--max-new-tokens", "41")) == 2  # other settings: refused, nothing written
    assert "pass --overwrite" in capfd.readouterr().err


def test_analyze_reclassifies_a_responses_file(tmp_path, capfd):
    lines = [
        {"id": "1", "subject": "astronomy", "question": "Which planet?", "choices": ["Mars", "Venus"], "answer": "A"},
        {"id": "2", "subject": "philosophy", "question": "Who wrote it?", "choices": ["Kant", "Hume"], "answer": 1},
        {"id": "3", "subject": "astronomy", "question": "Which star?", "choices": ["Sun", "Vega"], "answer": "Vega"},
    ]
    run_on = "\nQuestion: Which moon?\nA. Io\nB. Titan\nAnswer: Let's think step by step. The answer is (A)."
    responses = ["The answer is (A).", "7 7 7 7 7 7 7 7", "Vega is the star, so the answer is (B)." + run_on]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({**x, "response": r}) + "\n" for x, r in zip(lines, responses)))
    assert main(["analyze", "--responses", str(path), "--out", str(tmp_path / "out")]) == 0
    result = json.loads(capfd.readouterr().out)
    assert result["counts"]["correct"] == 2 and result["counts"]["incoherent"] == 1 and result["n"] == 3
    assert result["groups"]["STEM"]["accuracy"] == 1.0 and result["groups"]["humanities"]["accuracy"] == 0.0
    out = [json.loads(x) for x in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert [(r["category"], r["extracted"], r["answer"]) for r in out] == [
        ("correct", "A", "A"),
        ("incoherent", None, "B"),  # the integer key 1: B (0-based, as Hugging Face's MMLU)
        ("correct", "B", "B"),  # the key given as the choice's text; the run-on question's "(A)" never read
    ]
    assert [(r["response"], r["run_on"]) for r in out] == [(x, "") for x in responses[:2]] + [
        (responses[2][: -len(run_on)], run_on)  # read up to where the answer ended; the rest kept
    ]


def test_analyze_reads_keys_counted_from_one_when_the_file_says_so(tmp_path, capfd):
    q = {"subject": "astronomy", "question": "Which planet?", "choices": ["Mars", "Venus", "Earth"]}
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({**q, "id": str(k), "answer": k, "response": "The answer is (A)."}) + "\n"
                            for k in (1, 3)))  # fmt: skip
    assert main(["analyze", "--responses", str(path), "--out", str(tmp_path / "auto")]) == 0
    out, err = capfd.readouterr()
    assert "never 0: read as counted from 1" in err and json.loads(out)["counts"]["correct"] == 1  # 1 is A
    assert main(["analyze", "--responses", str(path), "--key-base", "0", "--out", str(tmp_path / "zero")]) == 2
    assert "line 2: field 'answer' is 3, not an index of its 3 choices (0 to 2" in capfd.readouterr().err


# ---- generation stops where the answer ended -------------------------------------------------------------------
def test_generation_stops_at_the_next_question_and_at_eos(byte_teacher_dir):
    """The tiny teacher with a byte-level tokenizer (it can write a line break) and its logits overwritten to write a
    script per row: row 0 answers, then starts the next question; row 1 ends with EOS; row 2 runs to the limit."""
    lm, tok = load_model(str(byte_teacher_dir))
    eos = tok.eos_token_id
    lm.generation_config.eos_token_id = eos  # the byte tokenizer's (EOS is also its pad)
    scripts = [
        "The answer is (B).\nQuestion: Which one? The answer is (A).",
        "The answer is (C).",
        "x" * 100,
    ]
    ids = [tok(x, add_special_tokens=False)["input_ids"] + [eos] for x in scripts]
    forward, calls = lm.forward, []

    def scripted(*args, **kwargs):
        out = forward(*args, **kwargs)
        step = len(calls)
        calls.append(step)
        logits = torch.full_like(out.logits, -1e4)
        for row, seq in enumerate(ids):
            logits[row, -1, seq[min(step, len(seq) - 1)]] = 0.0
        out.logits = logits
        return out

    lm.forward = scripted
    rows = answer_batch(lm, tok, ["Q?", "Question two?", "Q3"], Sampling(40, 0.0, 0, 3), 0)
    assert [r["finish"] for r in rows] == ["until", "stop", "length"]
    assert [r["response"] for r in rows] == ["The answer is (B).", "The answer is (C).", "x" * 40]
    assert [r["run_on"] for r in rows] == ["\nQuestion:", "", ""]
    assert [r["new_tokens"] for r in rows] == [len("The answer is (B).\nQuestion:"), len("The answer is (C)."), 40]
    assert len(calls) == 40  # the others went on: row 0 stopped alone
    assert recorded("local", 2, Sampling())["until"] == ["<end of sequence>", *(f"\n{m}" for m in UNTIL)]


# ---- the teacher judge ----------------------------------------------------------------------------------------
def _wrong(local) -> list[dict]:
    return [
        {**q.record(), "response": f"the chef serves the {w} with salt . the answer is ({b})"}
        for q, w, b in zip(local, ["soup", "honey", "rice", "egg", "flour", "sauce"], "ABCDAB")
    ]


def test_teacher_judge_averages_both_label_orders_as_a_float64_brute_force_does(byte_teacher_dir, local):
    """On the tiny teacher with a byte-level tokenizer (the word-level one reads none of the asks' words: its two
    orders are the same tokens, every verdict a tie) and a context that holds the whole prompt."""
    lm, tok = load_model(str(byte_teacher_dir))
    lm.config.max_position_embeddings = 2048
    records = _wrong(local)[:3]
    contexts = [context_ids(tok, r, None, ask) for r in records for ask in TEACHER_ASKS]
    batched = label_loglikelihoods(lm, tok, contexts, TEACHER_LABELS, 5)
    ref = lm.double()
    said, sure = [], []
    for i, r in enumerate(records):
        want = []
        for ask in TEACHER_ASKS:
            ids = context_ids(tok, r, None, ask)
            assert tok.decode(ids).endswith(render(r, ask))  # the whole prompt
            scores = []
            for label in TEACHER_LABELS:  # one unpadded sequence at a time, float64 weights
                cont = tok(label, add_special_tokens=False)["input_ids"]
                with torch.no_grad():
                    logits = ref(torch.tensor([ids + cont])).logits[0].log_softmax(-1)
                scores.append(sum(logits[len(ids) - 1 + j, t].item() for j, t in enumerate(cont)))
            want.append(scores)
        assert batched[2 * i : 2 * i + 2] == [pytest.approx(w, abs=1e-4) for w in want]
        p1 = [math.exp(s[0]) / (math.exp(s[0]) + math.exp(s[1])) for s in want]  # P(" 1") in each order
        knowledge = (p1[0] + 1 - p1[1]) / 2  # " 1" is knowledge in the first order, reasoning in the second
        assert abs(knowledge - 0.5) > TIE  # the byte-level teacher reads the asks: no tie
        said.append("knowledge" if knowledge > 0.5 else "reasoning")
        sure.append(math.log(knowledge / (1 - knowledge)))
    judge = TeacherJudge(ref, tok)
    assert judge(records) == said
    assert judge.log_odds == [pytest.approx(x, abs=1e-3) for x in sure]  # how sure, kept with each verdict
    assert len({tuple(s) for s in batched}) == len(contexts)  # the scores depend on the answer and the order


def test_a_teacher_no_node_holds_judges_a_decoder_layer_at_a_time_as_the_loaded_one_does(byte_teacher_dir, local):
    """The streamed judge (every sequence in one pass over the weights, a decoder layer at a time, the labels scored
    through the output head) gives the loaded judge's log-likelihoods, verdicts and log-odds; the analysis' judge task
    takes that path when its placement says streamed."""
    from m2d_ray.evaluate.judges import StreamedTeacherJudge, streamed_label_loglikelihoods
    from m2d_ray.evaluate.placement import EvalPlacement
    from m2d_ray.stages.analysis import _judge_task
    from m2d_ray.weights import open_model

    lm, tok = load_model(str(byte_teacher_dir))
    records = _wrong(local)[:3]
    contexts = [context_ids(tok, r, None, ask) for r in records for ask in TEACHER_ASKS]
    lazy = open_model(str(byte_teacher_dir))
    loaded = label_loglikelihoods(lm, tok, contexts, TEACHER_LABELS, 5)
    streamed = streamed_label_loglikelihoods(lazy, tok, contexts, TEACHER_LABELS, 5, "cpu")
    assert len({tuple(s) for s in streamed}) == len(contexts)  # the scores depend on the answer and the order
    for got, want in zip(streamed, loaded):
        assert got == [pytest.approx(w, abs=1e-5) for w in want]
    said = TeacherJudge(lm, tok)(records)
    judge = StreamedTeacherJudge(lazy, tok)
    assert judge(records) == said
    placed = EvalPlacement(0, False, 5, 5, 64, None, 0, 0, streamed=True)

    class Visible:
        def ensure_visible(self):
            pass

    verdicts, odds = _judge_task(str(byte_teacher_dir), records, 5, "cpu", placed, 1, Visible())
    assert verdicts == said and odds == [pytest.approx(x, abs=1e-4) for x in judge.log_odds]


def test_the_label_orders_cancel_a_bias_for_one_label():
    ln = math.log
    assert verdict([ln(0.7), ln(0.3)], [ln(0.7), ln(0.3)]) == "unjudged"  # " 1" either way: a bias, no verdict
    assert verdict([ln(0.7), ln(0.3)], [ln(0.700001), ln(0.299999)]) == "unjudged"  # float noise is no verdict
    assert verdict([ln(0.9), ln(0.1)], [ln(0.8), ln(0.2)]) == "knowledge"  # (0.9 + 0.2) / 2 = 0.55
    assert verdict([ln(0.6), ln(0.4)], [ln(0.9), ln(0.1)]) == "reasoning"  # (0.6 + 0.1) / 2 = 0.35
    assert knowledge_probability([-1000.0, 0.0], [0.0, -1000.0]) == 0.0  # no overflow far from a tie


# ---- the openai judge against a real server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def app(teacher):
    """The server: `tiny` (the embedded teacher continuing the messages' text greedily, at most 8 tokens) and
    `scripted` (what the test queues), behind a key."""
    lm, tok = teacher

    def complete(body: dict) -> str:
        prompt = "\n".join(m["content"] for m in body["messages"])
        ids = tok(prompt)["input_ids"][-200:]
        new = min(8, body.get("max_tokens") or body.get("max_completion_tokens") or 8)
        with torch.no_grad():
            out = lm.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0)
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    a = JudgeServer(("tiny", "scripted"), complete, key="sk-test")
    yield a
    a.close()


@pytest.fixture
def judge(app, monkeypatch):
    monkeypatch.setenv("M2D_TEST_KEY", app.key)
    app.reset()
    fast = {"url": app.url, "key_env": "M2D_TEST_KEY", "backoff": 0.05, "rate": 1000.0}
    return lambda model, **kw: OpenAIJudge(model, **{**fast, **kw})


def test_openai_judge_on_the_served_teacher_records_unparsable_replies_as_unjudged(judge, app, local):
    j = judge("tiny")
    j.check()
    assert app.bodies == []  # /models lists it: no request spent
    records = _wrong(local)[:3]
    said = j(records)
    assert said == ["unjudged"] * 3  # the embedded teacher has no word "knowledge" or "reasoning": never guessed
    assert len(app.bodies) == 3 and all(b["model"] == "tiny" and b["temperature"] == 0 for b in app.bodies)
    assert all(b["max_tokens"] == 4096 for b in app.bodies)  # room for a thinking model's thoughts
    asked = [b["messages"][0]["content"] for b in app.bodies]  # in any order: four workers
    assert all(sum(r["response"] in x for x in asked) == 1 for r in records)
    assert j.failures == 0 and j.problems == {"a reply whose first word is no label": 3}


def test_openai_judge_reads_one_word_after_any_thinking(judge, app, local):
    app.script = [
        "Knowledge.",
        "reasoning",
        "It is a knowledge error",
        "**Reasoning** error",
        "<think>The student misremembers a fact; but is it reasoning?</think>\n\nKnowledge",
        "The student recalls wrongly, so knowledge.\n</think>\nreasoning",  # <think> was in the chat template
        ("<think>A long deliberation that never", "length"),  # out of tokens while thinking
    ]
    j = judge("scripted", workers=1)
    got = j(_wrong(local)[:6] + _wrong(local)[:1])
    assert got == ["knowledge", "reasoning", "unjudged", "reasoning", "knowledge", "reasoning", "unjudged"]
    assert j.problems == {
        "a reply whose first word is no label": 1,
        "a reply cut at 4096 tokens before its word (stage3.analysis.judge_max_tokens)": 1,
    }
    assert [parse_reply(x) for x in ("", None, "knowledgeable", "reasoning!", "<think>knowledge")] == [
        "unjudged",
        "unjudged",
        "unjudged",
        "reasoning",
        "unjudged",
    ]
    app.script = ["Reasoning or knowledge", "knowledge, not reasoning", "Knowledge error."]
    j = judge("scripted", workers=1)
    assert j(_wrong(local)[:3]) == ["unjudged", "unjudged", "knowledge"]  # only one label is a verdict
    assert j.problems == {"a reply naming both labels": 2}


def test_openai_judge_retries_with_backoff_and_bounds_its_rate(judge, app, local):
    app.fail, app.script = 2, ["knowledge"]
    assert judge("scripted", backoff=0.2)(_wrong(local)[:1]) == ["knowledge"]  # a 503, a 429, then the reply
    gaps = [b - a for a, b in zip(app.times, app.times[1:])]
    assert len(app.times) == 3 and gaps[0] >= 0.2 and gaps[1] >= 0.4, gaps  # 0.2 s, then twice that
    app.fail, app.times, app.retry_after, app.script = 1, [], "0.3", ["reasoning"]
    assert judge("scripted", backoff=0.01)(_wrong(local)[:1]) == ["reasoning"]
    assert app.times[1] - app.times[0] >= 0.3  # the server's Retry-After, not the backoff
    app.fail, app.times, app.retry_after = 10, [], None
    j = judge("scripted", retries=2)
    assert j(_wrong(local)[:1]) == ["unjudged"] and j.failures == 1  # every try failed: no verdict, counted
    assert len(app.times) == 3 and j.problems == {"HTTP 503: busy": 1}
    app.fail, app.times, app.script = 0, [], ["knowledge"] * 6
    judge("scripted", rate=10.0, workers=4)(_wrong(local))
    gaps = [b - a for a, b in zip(app.times, app.times[1:])]
    assert len(app.times) == 6 and min(gaps) >= 0.09 and app.times[-1] - app.times[0] >= 0.49, gaps


def test_openai_judge_retries_408_reads_retry_after_as_a_date_and_keeps_its_deadline(judge, app, local):
    import email.utils

    app.raw = [(408, {"error": {"message": "request timeout"}})]
    app.script = ["knowledge"]
    assert judge("scripted", workers=1)(_wrong(local)[:1]) == ["knowledge"] and len(app.bodies) == 2  # retried
    app.reset()
    when = email.utils.formatdate(time.time() + 2, usegmt=True)  # an HTTP date 2 s ahead (1 s resolution)
    app.raw, app.script = [(503, {"error": {"message": "busy"}}, {"Retry-After": when})], ["reasoning"]
    assert judge("scripted", workers=1, backoff=0.01)(_wrong(local)[:1]) == ["reasoning"]
    assert app.times[1] - app.times[0] >= 0.9  # the date's wait, not the 0.01 s backoff
    app.reset()
    app.fail = 100  # the server never recovers: the deadline ends the call, not 100 retries of backoff
    j = judge("scripted", workers=1, retries=100, backoff=0.2, deadline=1.0)
    t0 = time.monotonic()
    assert j(_wrong(local)[:2]) == ["unjudged"] * 2 and time.monotonic() - t0 < 3
    assert all(p.startswith("the judge's deadline of 1 s passed") for p in j.problems), j.problems


def test_openai_judge_reads_the_answers_the_rules_cannot(judge, app, local, tmp_path, capfd):
    """Rule 8: where no rule reads a single answer, the judge is asked which letter it commits to; what it reads is
    recorded as judge-extracted and classified as any answer."""
    q = local[0].record()
    texts = ["I reckon it's the one about " + q["choices"][0] + " really", "The answer is (B) or (C)."]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({**q, "id": str(i), "response": t}) + "\n" for i, t in enumerate(texts)))
    app.script = [q["answer"], "none"]
    args = ["analyze", "--responses", str(path), "--judge", "openai:scripted", "--judge-url", app.url]
    assert main([*args, "--judge-key-env", "M2D_TEST_KEY", "--out", str(tmp_path / "out")]) == 0
    out = [json.loads(x) for x in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert [(r["extracted"], r["extracted_by"]) for r in out] == [(q["answer"], "judge"), ("B/C", "rules")]
    assert out[0]["category"] == "correct" and json.loads(capfd.readouterr().out)["judge_extracted"] == 1
    assert "Which choice does the student's answer commit to" in app.bodies[0]["messages"][0]["content"]
    assert main([*args, "--judge-key-env", "M2D_TEST_KEY", "--no-judge-extracts", "--out", str(tmp_path / "o2")]) == 0
    assert len(app.bodies) == 2  # not asked again: no extraction, and no wrong answer left for the judge


def test_openai_judge_retries_or_counts_every_network_error_and_malformed_body(judge, app, local):
    app.raw = [CUT, (200, {"choices": None}), (200, b"<html>bad gateway</html>"), (200, {"choices": []})]
    app.script = ["knowledge"]
    j = judge("scripted", retries=4, workers=1)
    assert j(_wrong(local)[:1]) == ["knowledge"] and j.failures == 0  # four bad bodies retried, the fifth read
    assert len(app.bodies) == 5
    app.reset()
    app.raw = [(200, {"choices": None})] * 2 + [CUT] * 2
    j = judge("scripted", retries=1, workers=1)
    assert j(_wrong(local)[:2]) == ["unjudged"] * 2 and j.failures == 2
    assert sum(j.problems.values()) == 2 and any("IncompleteRead" in p for p in j.problems), j.problems
    assert any(p.startswith("ValueError: a reply without choices[0].message") for p in j.problems), j.problems
    app.reset()
    app.raw = [(404, {"error": {"message": "The model `scripted` does not exist."}})]
    j = judge("scripted", workers=1)
    assert j(_wrong(local)[:1]) == ["unjudged"] and len(app.bodies) == 1  # a 404 is not retried
    assert j.problems == {"HTTP 404: The model `scripted` does not exist.": 1}


def test_openai_judge_drops_the_fields_a_hosted_reasoning_model_refuses(judge, app, local):
    app.raw = [
        (400, {"error": {"message": "Unsupported value: 'temperature' does not support 0 with this model."}}),
        (400, {"error": {"message": "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                                    "'max_completion_tokens' instead."}}),
    ]  # fmt: skip
    app.script = ["reasoning", "knowledge"]
    j = judge("scripted", workers=1)
    assert j(_wrong(local)[:2]) == ["reasoning", "knowledge"] and j.failures == 0
    sent = [({k for k in b if k not in ("model", "messages")}) for b in app.bodies]
    assert sent == [
        {"temperature", "max_tokens"},
        {"max_tokens"},
        {"max_completion_tokens"},
        {"max_completion_tokens"},  # the next answer's request keeps what the model takes
    ]
    app.reset()
    app.raw = [(400, {"error": {"message": "This model's maximum context length is 4096 tokens."}})]
    j = judge("scripted", workers=1)
    assert j(_wrong(local)[:1]) == ["unjudged"] and len(app.bodies) == 1  # nothing to change: counted, not retried
    assert j.problems == {"HTTP 400: This model's maximum context length is 4096 tokens.": 1}


def test_openai_judge_checks_its_server_and_model_before_any_work(judge, app, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(M2DError, match=f"judge URL {closed} is unreachable"):
        OpenAIJudge("tiny", closed).check()
    with pytest.raises(M2DError, match=r"refused the request \(HTTP 401\); set \$M2D_TEST_KEY"):
        OpenAIJudge("tiny", app.url, "M2D_TEST_KEY_UNSET").check()
    # a misspelt model: not listed, and a one-token request to it answers 404
    with pytest.raises(M2DError) as exc:
        judge("tinny").check()
    line = str(exc.value)
    assert f"judge {app.url} cannot judge with model 'tinny' (HTTP 404: The model `tinny` does not exist.)" in line
    assert "did you mean 'tiny'?" in line and "\n" not in line
    assert [b["max_tokens"] for b in app.bodies] == [1]  # one token asked
    # a base URL without /v1: /models and the request both 404
    with pytest.raises(M2DError, match=r"cannot judge with model 'tiny' \(HTTP 404"):
        judge("tiny", url=app.url[: -len("/v1")]).check()
    # a server without /models that serves the model: the one-token request decides
    app.reset()
    app.listed = False
    judge("scripted").check()
    assert len(app.bodies) == 1
    app.raw = [(400, {"error": {"message": "bad request"}}), (200, b"not json")]  # refused; a body with no message
    with pytest.raises(M2DError, match=r"cannot judge with model 'scripted' \(HTTP 400: bad request\)"):
        judge("scripted").check()
    with pytest.raises(M2DError, match=r"cannot judge with model 'scripted' \(JSONDecodeError"):
        judge("scripted", retries=0).check()


def test_analyze_fails_when_its_judge_leaves_answers_unjudged(judge, app, local, tmp_path, capfd):
    """A judge that passes the check but cannot judge (here: it replies no label) fails the command with one line,
    nothing written; run again once it judges, the command classifies them."""
    path = tmp_path / "in.jsonl"
    records = [{**r, "response": f"{r['question']} so the answer is ({wrong(r)})."} for r in _wrong(local)[:3]]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["analyze", "--responses", str(path), "--judge", "openai:scripted", "--judge-url", app.url]
    argv += ["--judge-key-env", "M2D_TEST_KEY", "--out", str(tmp_path / "out")]
    app.script = ["I cannot tell"] * 3
    capfd.readouterr()
    assert main(argv) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("m2d: failed: judge openai:scripted left 3 of 3 answers unjudged")
    assert "(100% > 5%, stage3.analysis.max_unjudged): 3 x a reply whose first word is no label" in err[0]
    assert not (tmp_path / "out").exists()
    app.script = ["knowledge", "I cannot tell", "reasoning"]
    assert main([*argv, "--max-unjudged", "0.5"]) == 0  # 1 of 3 left: within the share
    out = [json.loads(x)["category"] for x in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert sorted(out) == ["knowledge", "reasoning", "unjudged"]  # replies in the order four workers asked


def wrong(r: dict) -> str:
    return next(x for x in "ABCD" if x != r["answer"])


# ---- the plan -----------------------------------------------------------------------------------------------------
def test_the_plan_prices_the_analysis_and_refuses_what_cannot_fit():
    qwen = model_config(str(EXPERIMENTS / "configs" / "Qwen--Qwen3-30B-A3B"))
    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml", ["stage3.accelerator=H100"])  # priced at an H100's peak
    a = cfg.stage3.analysis
    assert a.enabled and (a.questions, a.per_subject, a.max_new_tokens, a.temperature) == ("mmlu", 10, 2048, 0.7)

    def plan(**changes):
        c = replace(cfg, stage3=replace(cfg.stage3, analysis=replace(a, **changes)))
        return pipeline.plan(c, qwen, Devices(gpu_memory=80 * 10**9, gpus_per_node=8))

    base = plan()
    rows = {s.name: s for s in base.stages if s.name.startswith("analysis")}
    teacher = rows["analysis:teacher"]
    assert teacher.units == 1 and teacher.fits and teacher.parts["weights"] > 55 * 2**30  # the whole MoE on one H100
    wide = {s.name: s for s in plan(batch_size=512).stages}["analysis:teacher"]
    assert wide.units > 1 and wide.fits and wide.parts["weights"] < teacher.parts["weights"]  # sharded for the batch
    assert any(
        p.startswith("analysis:teacher") and "stage3.analysis.batch_size" in p
        for p in plan(batch_size=100_000).problems()
    )  # no number of a node's GPUs holds it: refused before any work, saying what to change
    cost = base.cost.by_name()["analysis"]
    none = plan(judge="none").cost.by_name()["analysis"]
    double = plan(judge="none", per_subject=20).cost.by_name()["analysis"]
    assert double.flops == pytest.approx(2 * none.flops) and cost.flops > none.flops  # the teacher judge's share
    openai = plan(judge="openai:m", judge_rate=5.0).cost.by_name()["analysis"]
    answers = 570 * none.units  # 10 questions of each of 57 subjects, every model
    assert openai.flops == none.flops and openai.seconds == pytest.approx(none.seconds + 2 * answers / 5.0)
    plain = plan(judge="openai:m", judge_rate=5.0, judge_extracts=False).cost.by_name()["analysis"]
    assert plain.seconds == pytest.approx(none.seconds + answers / 5.0)  # no extraction: one request per answer
