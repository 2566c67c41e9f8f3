"""The analysis stage on Ray, on a copy of the stored small run (its two teachers are here; its students were in a
test's temporary directory, so stage 3's list is the teachers): one task per model writes its answers to the run's
storage a batch at a time, the teacher judges in its own task, a model killed part-way continues from its saved
batches, a finished model is not generated again, a changed judge classifies the saved answers again without
generating, and a judge that cannot judge (the embedded teacher reads none of the asks' words: every verdict a tie;
an openai server that replies no label) fails the model it judged (the run fails) until a resume judges it."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from judge_server import JudgeServer
from small_run import finished_run

from m2d_ray.commands.runs import check_outcome
from m2d_ray.config import load_config
from m2d_ray.errors import RunFailed
from m2d_ray.evaluate.generation import BatchStore
from m2d_ray.evaluate.judges import TeacherJudge, shortfall, ties
from m2d_ray.evaluate.questions import sample
from m2d_ray.evaluate.taxonomy import by_rules
from m2d_ray.models import default_teacher, load_model
from m2d_ray.pipeline import run_stages
from m2d_ray.run_dir import RunDir


def wrong(q) -> str:
    return next(x for x in "ABCD" if x != q.answer)


def _mtimes(d) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(d.glob("*"))}


def test_analysis_stage_resumes_per_model_and_per_batch(ray_address, tmp_path):
    run_dir, _ = finished_run(tmp_path / "run")
    rd = RunDir(run_dir)
    shutil.rmtree(rd.analysis)
    promotions = rd.read_promotions()  # the stored run's teacher: the embedded one, where the run was made
    rd.promotions.write_text(json.dumps({**promotions, "teacher": default_teacher()}))
    cfg = load_config(rd.config)
    a = replace(cfg.stage3.analysis, per_subject=2, max_new_tokens=24, batch_size=4, judge="teacher")
    cfg = replace(cfg, stage3=replace(cfg.stage3, analysis=a))

    # teacher-d2d's answers saved already (as a killed run leaves them): wrong, coherent, on topic, for the judge
    questions = sample("local", 2, 0)
    saved = [
        {**q.record(), "response": f"{q.question} the answer is ({wrong(q)}).", "finish": "stop"} for q in questions
    ]
    assert all(by_rules(r).category is None for r in saved)
    store = BatchStore(str(run_dir / "analysis" / "teacher-d2d"))
    for i in range(3):
        store.save(i, saved[4 * i : 4 * i + 4])
    pre = _mtimes(run_dir / "analysis" / "teacher-d2d")

    first = run_stages(cfg, run_dir, "analysis")["analysis"]
    assert set(first) == {"teacher", "teacher-d2d"} and first["teacher"]["status"] == "ok"
    # the teacher judged them in its Ray task as it does here: the embedded teacher's two label orders are the same
    # tokens (it reads no word of the asks), so every verdict is a tie, and the model it judged fails
    lm, tok = load_model(default_teacher())
    said = TeacherJudge(lm, tok)(saved)
    assert said == ["unjudged"] * 12
    d2d = first["teacher-d2d"]
    assert d2d["status"] == "failed" and d2d["error"] == shortfall("teacher", said, 0.05, ties(said))
    with pytest.raises(RunFailed, match="the analysis failed for 1 models \\(teacher-d2d: judge teacher left 12 of 12"):
        check_outcome(run_dir)
    assert _mtimes(run_dir / "analysis" / "teacher-d2d") == pre  # read back, not generated
    teacher = run_dir / "analysis" / "teacher"  # the run's storage is the run directory
    assert sorted(p.name for p in teacher.glob("batch-*")) == [f"batch-0000{i}.jsonl" for i in range(3)]
    responses = [json.loads(x) for x in (run_dir / first["teacher"]["responses"]).read_text().splitlines()]
    assert len(responses) == 12 and first["teacher"]["judged_by"]["judge"] == "teacher"

    # killed while the teacher answered its last batch: its record, responses and that batch are not there
    rd.analysis_responses("teacher").unlink()
    (rd.analysis_results / "teacher.json").unlink()
    last = (teacher / "batch-00002.jsonl").read_text()
    (teacher / "batch-00002.jsonl").unlink()
    kept = _mtimes(teacher)
    again = run_stages(cfg, run_dir, "analysis")["analysis"]
    assert {k: v for k, v in _mtimes(teacher).items() if k in kept} == kept  # saved batches read back
    assert (teacher / "batch-00002.jsonl").read_text() == last  # the missing one: what the first run wrote
    assert {k: v for k, v in again["teacher"].items() if k not in ("gen_s", "placement") and "peak" not in k} == {
        k: v for k, v in first["teacher"].items() if k not in ("gen_s", "placement") and "peak" not in k
    }
    assert again["teacher-d2d"]["status"] == "failed"  # tried again (the judge failed it): still ties

    # an openai judge: the saved answers classified again, nothing generated; while it replies no label the model
    # fails, and a resume once it judges classifies it
    batches = {m: _mtimes(run_dir / "analysis" / m) for m in ("teacher", "teacher-d2d")}
    server = JudgeServer()
    try:
        openai = replace(a, judge="openai:scripted", judge_url=server.url, judge_retries=0, judge_extracts=False)
        cfg = replace(cfg, stage3=replace(cfg.stage3, analysis=openai))
        server.script = ["I cannot tell"] * 12
        failed = run_stages(cfg, run_dir, "analysis")["analysis"]
        assert failed["teacher"]["status"] == "ok" and failed["teacher-d2d"]["status"] == "failed"
        assert "judge openai:scripted left 12 of 12 answers unjudged" in failed["teacher-d2d"]["error"]
        teacher_record = _mtimes(rd.analysis_results)["teacher.json"]
        server.script = ["knowledge", "reasoning"] * 6
        judged = run_stages(cfg, run_dir, "analysis")["analysis"]
    finally:
        server.close()
    assert judged["teacher-d2d"]["status"] == "ok" and len(server.bodies) == 24  # only the failed model again
    assert judged["teacher-d2d"]["counts"]["knowledge"] == judged["teacher-d2d"]["counts"]["reasoning"] == 6
    assert _mtimes(rd.analysis_results)["teacher.json"] == teacher_record  # finished: not redone
    assert check_outcome(run_dir)["analysis_failed"] == {}

    # another judge: the saved answers classified again, nothing generated
    none = replace(cfg, stage3=replace(cfg.stage3, analysis=replace(a, judge="none")))
    third = run_stages(none, run_dir, "analysis")["analysis"]
    assert {m: _mtimes(run_dir / "analysis" / m) for m in batches} == batches
    assert all(r["classified"]["judge"] == "none" and r["counts"]["knowledge"] == 0 for r in third.values())
    assert sum(r["counts"]["unjudged"] for r in third.values()) == 12  # teacher-d2d's, as judged above
