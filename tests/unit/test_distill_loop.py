"""The distillation loop without Ray: learning on the embedded teacher, exact resume, schedule, routing."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import SYNTHETIC_DISTILL
from transformers import AutoModelForCausalLM

from m2d_ray.config import STOP_POLL_STEPS, DistillConfig, load_config
from m2d_ray.distill.loop import DistillJob, WorkerIO, run_distill
from m2d_ray.distill.step import lr_factor
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.perplexity import window_nll, windows
from m2d_ray.models import default_teacher

CFG = replace(
    SYNTHETIC_DISTILL, steps=24, warmup_steps=2, batch_size=8, seq_len=128, eval_every=8, eval_max_tokens=4096
)


@pytest.fixture(scope="module")
def do_acp_student(tmp_path_factory) -> Path:
    from m2d_ray.commands.convert import convert_one

    out = tmp_path_factory.mktemp("init") / "do-acp"
    convert_one(None, "do-acp", "rr", "uniform", None, out, calib_kwargs={"max_tokens": 4096, "seq_len": 128})
    return out


class Keep:
    """A WorkerIO sink that keeps every report and a copy of every checkpoint."""

    def __init__(self, root: Path) -> None:
        self.root, self.reports, self.ckpts = root, [], {}

    def __call__(self, metrics: dict, ckpt: Path | None) -> None:
        self.reports.append(metrics)
        if ckpt is not None:
            self.ckpts[metrics["step"]] = shutil.copytree(ckpt, self.root / f"ckpt{metrics['step']}")


def _weights(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_distillation_lowers_the_loss_and_the_students_perplexity(do_acp_student, tmp_path):
    keep = Keep(tmp_path)
    last = run_distill(
        DistillJob(default_teacher(), str(do_acp_student), CFG, "synthetic:valid", out=str(tmp_path / "s")),
        WorkerIO(report=keep),
    )
    steps = [r["step"] for r in keep.reports]
    assert steps == [8, 16, 24] and last["final"] and last["student_path"] == str(tmp_path / "s")
    assert keep.reports[-1]["train_loss"] < 0.5 * keep.reports[0]["train_loss"]
    assert last["val_ppl"] < 0.5 * last["val_ppl_initial"]
    # the exported student loads natively and has the perplexity the loop reported
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "s").eval()
    w, m = _val_windows()
    nll, n = window_nll(student, w, m)
    assert nll / n == pytest.approx(last["val_loss"], rel=1e-5)


def _val_windows():
    from m2d_ray.distill.loop import validation_windows
    from m2d_ray.models import load_teacher

    return validation_windows(load_teacher().tokenizer, "synthetic:valid", CFG.seq_len, CFG.eval_max_tokens)


def test_resume_from_a_checkpoint_continues_exactly(do_acp_student, tmp_path):
    cfg = DistillConfig(**{**CFG.__dict__, "steps": 6, "eval_every": 3, "grad_accum": 2, "batch_size": 2})

    def job(out):
        return DistillJob(default_teacher(), str(do_acp_student), cfg, "synthetic:valid", out=str(tmp_path / out))

    straight = Keep(tmp_path / "a")
    run_distill(job("straight"), WorkerIO(report=straight))
    resumed = Keep(tmp_path / "b")
    last = run_distill(job("resumed"), WorkerIO(report=resumed, restore=straight.ckpts[3]))
    assert [r["step"] for r in resumed.reports] == [6] and last["resumed_from"] == 3
    assert [s for s, _ in last["curve"]] == [0, 3, 6] and last["curve"][:2] == straight.reports[0][
        "curve"
    ]  # history survives
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    # the host died after the final checkpoint, before its report: the resumed run trains nothing and reports it again
    again = Keep(tmp_path / "d")
    last = run_distill(job("again"), WorkerIO(report=again, restore=straight.ckpts[6]))
    assert [(r["step"], r["final"]) for r in again.reports] == [(6, True)] and last["curve"] == straight.reports[-1][
        "curve"
    ]
    assert last["student_path"] == str(tmp_path / "again") and last["val_loss"] == pytest.approx(
        straight.reports[-1]["val_loss"], rel=1e-6
    )
    c = _weights(tmp_path / "again")
    assert all(torch.equal(a[k], c[k]) for k in a)
    # and resuming is not a no-op: the step-3 weights differ from the final ones
    fresh = Keep(tmp_path / "c")
    run_distill(
        DistillJob(
            default_teacher(),
            str(do_acp_student),
            DistillConfig(**{**cfg.__dict__, "steps": 3}),
            "synthetic:valid",
            out=str(tmp_path / "s3"),
        ),
        WorkerIO(report=fresh),
    )
    s3 = _weights(tmp_path / "s3")
    assert any(not torch.allclose(a[k], s3[k]) for k in a)


def test_chunked_window_cross_entropy_equals_whole_logits(tiny_teacher):
    """window_nll (stage 1 and validation) forms logits in chunks; the reference takes the model's own logits."""
    ids = torch.randint(0, tiny_teacher.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    w, m = windows(ids, 64)  # the last window is padded and masked
    with torch.no_grad():
        logits = tiny_teacher.model(input_ids=w, attention_mask=m).logits[:, :-1].double()
    valid = m[:, 1:].bool()
    ref = torch.nn.functional.cross_entropy(logits[valid], w[:, 1:][valid], reduction="sum").item()
    got = window_nll(tiny_teacher.model, w, m, chunk=7)
    assert got[1] == int(valid.sum()) == 300 - 5 and got[0] == pytest.approx(ref, rel=1e-6)


def test_warmup_then_cosine_schedule():
    cfg = DistillConfig(steps=100, lr=1e-4, min_lr=1e-5, warmup_steps=20)
    assert lr_factor(0, cfg) == pytest.approx(1 / 20) and lr_factor(19, cfg) == pytest.approx(1.0)
    assert lr_factor(20, cfg) == pytest.approx(1.0) and lr_factor(60, cfg) == pytest.approx((1 + 0.1) / 2)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    assert all(lr_factor(s, cfg) >= lr_factor(s + 1, cfg) for s in range(20, 100))


def test_expanded_teacher_routing_changes_the_teacher(tiny_teacher):
    model, adapter = tiny_teacher.model, tiny_teacher.adapter
    k, E = adapter.top_k(model.config), adapter.num_experts(model.config)
    ids = torch.arange(40).view(2, 20) % model.config.vocab_size
    with torch.no_grad():
        base = model(ids).logits
        adapter.set_top_k(model, E)
        wide = model(ids).logits
        adapter.set_top_k(model, k)
        again = model(ids).logits
    assert not torch.allclose(base, wide, atol=1e-4) and torch.equal(base, again)
    with pytest.raises(M2DError, match="outside"):
        adapter.set_top_k(model, E + 1)


def test_teacher_topk_below_k_and_bad_settings_are_rejected(tiny_teacher_dir):
    from m2d_ray.models import check_teacher_topk

    with pytest.raises(M2DError, match=r"outside \[k, E\] = \[2, 8\]"):
        check_teacher_topk(str(tiny_teacher_dir), 1)
    check_teacher_topk(str(tiny_teacher_dir), 4)
    with pytest.raises(M2DError, match="did you mean 'fkl'"):
        load_config(None, ["distill.loss=fk"])
    with pytest.raises(M2DError, match="distill.steps=0"):
        load_config(None, ["distill.steps=0"])
    assert load_config(None, ["distill.lr=1e-4"]).distill.lr == 1e-4  # YAML 1.1 reads 1e-4 as a string


def test_flops_per_token_counts_what_the_models_multiply(tiny_teacher, do_acp_student):
    """Brute force: torch's FLOP counter on real forwards (eager attention, whose QK^T and AV it counts over
    the full square; the estimate counts the causal half), teacher forward + 3 x student forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from m2d_ray.distill.flops import flops_per_token

    student = AutoModelForCausalLM.from_pretrained(do_acp_student)
    ids = torch.randint(0, tiny_teacher.config.vocab_size, (2, 64))

    def counted(model) -> float:
        before = model.config._attn_implementation
        model.set_attn_implementation("eager")
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            model(input_ids=ids)
        model.set_attn_implementation(before)
        attention = sum(v for op, v in fc.get_flop_counts()["Global"].items() if "bmm" in str(op))
        return (fc.get_total_flops() - attention / 2) / ids.numel()

    want = counted(tiny_teacher.model) + 3 * counted(student)
    assert flops_per_token(tiny_teacher.model, tiny_teacher.adapter, student, 64) == pytest.approx(want, rel=1e-9)


def test_reports_count_training_time_only(do_acp_student, tmp_path, monkeypatch):
    """tokens_per_s is over the training time since the previous report: validation (slowed here by 0.5 s)
    and checkpoints are reported apart (eval_s, ckpt_s), not folded into it."""
    import time

    import m2d_ray.distill.loop as loop

    real = loop.validate

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "validate", slow)
    cfg = DistillConfig(**{**CFG.__dict__, "steps": 6, "eval_every": 3, "batch_size": 2})
    reports, stamps = [], []

    def report(metrics, ckpt):
        reports.append(metrics)
        stamps.append(time.perf_counter())

    run_distill(DistillJob(default_teacher(), str(do_acp_student), cfg, "synthetic:valid"), WorkerIO(report=report))
    tokens = 3 * cfg.batch_size * cfg.seq_len
    for r in reports:
        assert r["tokens_per_s"] == pytest.approx(tokens / r["train_s"]) and r["eval_s"] >= 0.5 and r["ckpt_s"] > 0
        assert 0 < r["mfu"] < 1
    # between two reports: training, then validation, then the checkpoint
    assert reports[1]["train_s"] + reports[1]["eval_s"] + reports[1]["ckpt_s"] <= stamps[1] - stamps[0]
    assert reports[1]["train_s"] <= stamps[1] - stamps[0] - 0.5


def test_the_stop_request_is_polled_every_few_steps_not_every_step(do_acp_student, tmp_path, monkeypatch):
    """Each poll is a collective and a host read: every min(eval_every, STOP_POLL_STEPS) steps."""
    import m2d_ray.distill.loop as loop

    polls = []
    monkeypatch.setattr(loop, "stop_requested", lambda job, io: polls.append(1) and False)
    cfg = DistillConfig(**{**CFG.__dict__, "steps": 24, "eval_every": 12, "batch_size": 1, "seq_len": 32})
    run_distill(
        DistillJob(default_teacher(), str(do_acp_student), cfg, "synthetic:valid", stop=lambda: False), WorkerIO()
    )
    assert cfg.stop_poll == STOP_POLL_STEPS and len(polls) == 24 // STOP_POLL_STEPS
