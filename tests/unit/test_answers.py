"""What the models write, without Ray: the question sets, batched generation (left padding, KV cache, seeded per
batch), `m2d analyze` killed and continued, the teacher judge against a float64 brute force on the embedded
teacher, and the openai judge against a real OpenAI-compatible server on 127.0.0.1 that serves the embedded teacher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from conftest import ROOT

from m2d_ray import pipeline
from m2d_ray.cli import main
from m2d_ray.config import load_config
from m2d_ray.errors import M2DError
from m2d_ray.evaluate import paper_data
from m2d_ray.evaluate.generation import BatchStore, Sampling, answer_all
from m2d_ray.evaluate.judges import (
    TEACHER_LABELS,
    OpenAIJudge,
    TeacherJudge,
    context_ids,
    label_loglikelihoods,
    parse_reply,
)
from m2d_ray.evaluate.paper_tasks import MMLU_SUBJECTS
from m2d_ray.evaluate.questions import GROUPS, group_of, sample
from m2d_ray.evaluate.taxonomy import letters
from m2d_ray.models import default_teacher, load_model
from m2d_ray.models import load_config as model_config
from m2d_ray.plan.run_plan import Devices


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
        {"id": "2", "subject": "philosophy", "question": "Who wrote it?", "choices": ["Kant", "Hume"], "answer": "B"},
    ]
    responses = ["The answer is (A).", "7 7 7 7 7 7 7 7"]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({**x, "response": r}) + "\n" for x, r in zip(lines, responses)))
    assert main(["analyze", "--responses", str(path), "--out", str(tmp_path / "out")]) == 0
    result = json.loads(capfd.readouterr().out)
    assert result["counts"]["correct"] == 1 and result["counts"]["incoherent"] == 1 and result["n"] == 2
    assert result["groups"]["STEM"]["accuracy"] == 1.0 and result["groups"]["humanities"]["accuracy"] == 0.0
    out = [json.loads(x) for x in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert [(r["category"], r["extracted"]) for r in out] == [("correct", "A"), ("incoherent", None)]
    assert all(r["id"] == x["id"] and r["response"] == y for r, x, y in zip(out, lines, responses))


# ---- the teacher judge ----------------------------------------------------------------------------------------
def _wrong(local) -> list[dict]:
    return [
        {**q.record(), "response": f"the chef serves the {w} with salt . the answer is ({b})"}
        for q, w, b in zip(local, ["soup", "honey", "rice", "egg", "flour", "sauce"], "ABCDAB")
    ]


def test_teacher_judge_takes_the_likelier_label_as_a_float64_brute_force_does(teacher, local):
    lm, tok = teacher
    records = _wrong(local)
    room = lm.config.max_position_embeddings - 1
    batched = label_loglikelihoods(lm, tok, [context_ids(tok, r, room) for r in records], TEACHER_LABELS, 5)
    ref = lm.double()
    try:
        for r, got in zip(records, batched):
            ids = context_ids(tok, r, room)
            assert len(ids) <= room
            want = []
            for label in TEACHER_LABELS:  # one unpadded sequence at a time, float64 weights
                cont = tok(label, add_special_tokens=False)["input_ids"]
                with torch.no_grad():
                    logits = ref(torch.tensor([ids + cont])).logits[0].log_softmax(-1)
                want.append(sum(logits[len(ids) - 1 + i, t].item() for i, t in enumerate(cont)))
            assert got == pytest.approx(want, abs=1e-4)
            assert TeacherJudge(ref, tok)([r]) == ["knowledge" if want[0] > want[1] else "reasoning"]
    finally:
        lm.float()
    assert len({tuple(s) for s in batched}) == len(records)  # the scores depend on the answer judged


# ---- the openai judge against a real server ---------------------------------------------------------------------
class App:
    """An OpenAI-compatible chat-completions server on 127.0.0.1 serving the embedded teacher (model `tiny`: the
    messages' text continued greedily), and a model `scripted` that replies what the test queues. It checks the key,
    answers 503 and 429 in turn (with `retry_after` as Retry-After) while `fail` > 0, and records when each request
    came."""

    def __init__(self, lm, tok, key: str = "sk-test") -> None:
        self.lm, self.tok, self.key = lm, tok, key
        self.fail, self.script, self.times, self.bodies, self.retry_after = 0, [], [], [], None
        app = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.headers.get("Authorization") != f"Bearer {app.key}":
                    return self._send(401, {"error": {"message": "bad key"}})
                self._send(200, {"object": "list", "data": [{"id": "tiny"}, {"id": "scripted"}]})

            def do_POST(self):
                app.times.append(time.monotonic())
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                app.bodies.append(body)
                if self.headers.get("Authorization") != f"Bearer {app.key}":
                    return self._send(401, {"error": {"message": "bad key"}})
                if app.fail > 0:
                    app.fail -= 1
                    after = {"Retry-After": app.retry_after} if app.retry_after else {}
                    return self._send(503 if app.fail % 2 else 429, {"error": {"message": "busy"}}, after)
                text = app.script.pop(0) if body["model"] == "scripted" else app.complete(body)
                self._send(
                    200,
                    {
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                    },
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> str:
        prompt = "\n".join(m["content"] for m in body["messages"])
        ids = self.tok(prompt)["input_ids"][-200:]
        with torch.no_grad():
            out = self.lm.generate(
                torch.tensor([ids]), max_new_tokens=body.get("max_tokens", 8), do_sample=False, pad_token_id=0
            )
        return self.tok.decode(out[0, len(ids) :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def app(teacher):
    a = App(*teacher)
    yield a
    a.server.shutdown()


@pytest.fixture
def judge(app, monkeypatch):
    monkeypatch.setenv("M2D_TEST_KEY", app.key)
    app.fail, app.script, app.times, app.bodies, app.retry_after = 0, [], [], [], None
    return lambda model, **kw: OpenAIJudge(model, app.url, "M2D_TEST_KEY", **{"backoff": 0.05, "rate": 1000.0, **kw})


def test_openai_judge_on_the_served_teacher_records_unparsable_replies_as_unjudged(judge, app, local):
    j = judge("tiny")
    j.check()
    records = _wrong(local)[:3]
    said = j(records)
    assert said == ["unjudged"] * 3  # the embedded teacher has no word "knowledge" or "reasoning": never guessed
    assert len(app.bodies) == 3 and all(b["model"] == "tiny" and b["temperature"] == 0 for b in app.bodies)
    assert records[0]["response"] in app.bodies[0]["messages"][0]["content"]
    assert j.failures == 0


def test_openai_judge_reads_one_word_and_nothing_else(judge, app, local):
    app.script = ["Knowledge.", "reasoning", "It is a knowledge error", "**Reasoning** error"]
    assert judge("scripted", workers=1)(_wrong(local)[:4]) == ["knowledge", "reasoning", "unjudged", "reasoning"]
    assert [parse_reply(x) for x in ("", None, "knowledgeable", "reasoning!")] == [
        "unjudged",
        "unjudged",
        "unjudged",
        "reasoning",
    ]


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
    assert len(app.times) == 3
    app.fail, app.times, app.script = 0, [], ["knowledge"] * 6
    judge("scripted", rate=10.0, workers=4)(_wrong(local))
    gaps = [b - a for a, b in zip(app.times, app.times[1:])]
    assert len(app.times) == 6 and min(gaps) >= 0.09 and app.times[-1] - app.times[0] >= 0.49, gaps


def test_openai_judge_checks_its_server_before_any_work(judge, app, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(M2DError, match=f"judge URL {closed} is unreachable"):
        OpenAIJudge("tiny", closed).check()
    monkeypatch.setenv("M2D_TEST_KEY", "wrong")
    with pytest.raises(M2DError, match=r"refused the request \(HTTP 401\); set \$M2D_TEST_KEY"):
        OpenAIJudge("tiny", app.url, "M2D_TEST_KEY").check()


# ---- the plan -----------------------------------------------------------------------------------------------------
def test_the_plan_prices_the_analysis_and_refuses_what_cannot_fit():
    qwen = model_config(str(ROOT / "experiments" / "configs" / "Qwen--Qwen3-30B-A3B"))
    cfg = load_config(ROOT / "experiments" / "qwen3_30b_a3b.yaml")
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
    assert openai.flops == none.flops and openai.seconds == pytest.approx(none.seconds + answers / 5.0)
