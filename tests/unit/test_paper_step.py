"""The paper's student as P7's step preset (benchmarks/perf/distill_step.py --preset paper): the student
`m2d plan qwen3_30b_a3b` builds for stage 2, its micro-batch and targets; its CPU rehearsal at its real shapes on `meta`
tensors (every checkpointing policy beside the plan's activations); and the one-path-at-a-time mode and the
levers its GPU run takes, reached on the CPU at the smoke preset."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

from conftest import ROOT

from m2d_ray.config import load_config
from m2d_ray.models import model_config
from m2d_ray.pipeline import STAGES, plan_run
from m2d_ray.plan.run_plan import Devices
from m2d_ray.plan.shapes import models_of
from m2d_ray.shipped import EXPERIMENTS
from workshop.random_models import STEP_PRESETS, preset_config

PAPER = STEP_PRESETS["paper"]
PAPER_CONFIG = EXPERIMENTS / "qwen3_30b_a3b.yaml"
PAPER_MODEL = EXPERIMENTS / "configs" / "Qwen--Qwen3-30B-A3B"


def test_the_preset_is_the_student_the_paper_plan_builds():
    planned = models_of(model_config(str(PAPER_MODEL))).student
    preset = models_of(preset_config(PAPER)).student
    fields = ("params", "hidden", "layers", "q_width", "kv_width", "ffn", "vocab", "tied")
    assert {f: getattr(preset, f) for f in fields} == {f: getattr(planned, f) for f in fields}
    assert (preset.layers, preset.hidden, preset.ffn, preset.vocab, preset.tied) == (48, 2048, 6144, 151936, False)
    cfg = load_config(PAPER_CONFIG)
    assert (PAPER["batch"], PAPER["seq_len"]) == (cfg.distill.batch_size, cfg.distill.seq_len) == (4, 4096)
    plan = plan_run(cfg, Devices(gpu_memory=80 * 10**9), model=str(PAPER_MODEL))
    assert plan.targets["teacher"].mode == PAPER["targets"] == "hidden"  # what the plan trains the paper run from
    assert cfg.distill.checkpointing == PAPER["checkpointing"] == "auto"


def test_the_plan_decides_the_paper_student_s_checkpointing_for_the_device(tmp_path):
    """At one rank on an H200 (141 GB) none does not fit and selective does; on 80 GB only full does; a path's plan
    is the rank's student, gradients, optimizer, activations and KL (P7's --plan-only: no model is built)."""
    r = _run(tmp_path, "--preset", "paper", "--plan-only")
    plans = r["plan"]
    assert r["checkpointing"] == plans["decided"]["checkpointing"] == "selective"
    assert plans["gpu_memory"] == 141 * 10**9  # no GPU here: an H200's memory
    ranks = {p: x["rank_bytes"] for p, x in plans["policies"].items()}
    assert ranks["none"] > plans["decided"]["capacity_bytes"] >= ranks["selective"] > ranks["full"]
    # the GPU run's levers: none is left out (the plan says it does not fit), selective is the platform's own
    assert set(r["levers_skipped"]) == {"ckpt:none", "ckpt:selective"} and "GiB" in r["levers_skipped"]["ckpt:none"]
    assert {"ckpt:full", "compile", "attn:sdpa"} <= set(r["levers"])
    for x in plans["policies"].values():
        parts = x["parts"]
        assert x["path_bytes"] == sum(parts[k] for k in ("student", "grads", "optimizer", "activations", "kl"))
    one_rank = ["distill.workers=1", "distill.deepspeed=false", "distill.accelerator=null", "stage2.targets=hidden"]
    cfg = load_config(PAPER_CONFIG, one_rank)
    h100 = plan_run(cfg, Devices(gpu_memory=80 * 10**9), model=str(PAPER_MODEL), stages=STAGES.only("stage2"))
    assert h100.decided == {"distill.checkpointing": "full", "distill.zero_stage": "2"}


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "p7.json"
    cmd = [sys.executable, "-m", "benchmarks.perf.distill_step", *args, "--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_meta_rehearsal_runs_the_paper_student_under_every_checkpointing_beside_the_plan(tmp_path):
    """The issue's CPU command: the head's GPU branch and the whole 48-layer student on meta tensors, each policy's
    live bytes within the plan's activations + KL (the plan within 0.9x-1.3x of what the step keeps)."""
    r = _run(tmp_path, "--preset", "smoke", "--meta-rehearsal", "paper", "--paths", "platform", "--steps", "1")
    rehearsal = r["meta_rehearsal"]
    assert rehearsal["vocab"] == 151936 and rehearsal["tokens"] == 16384
    policies = rehearsal["student"]["policies"]
    assert policies["none"]["peak_bytes"] > policies["selective"]["peak_bytes"] > policies["full"]["peak_bytes"]
    assert policies["selective"]["peak_bytes"] < 0.5 * policies["none"]["peak_bytes"]
    for name, x in policies.items():
        assert 0.9 <= x["plan_ratio"] <= 1.3, (name, x)


def test_one_path_at_a_time_with_a_lever_agrees_with_the_platform(tmp_path):
    """The paper preset's way on the CPU: each path built, trained and freed in turn, a lever among them, every
    trajectory within bf16-mixed's tolerance of the platform's, MFU said against the measured rate (no data sheet
    on a CPU)."""
    r = _run(
        tmp_path,
        *("--preset", "smoke", "--precision", "bf16-mixed", "--paths", "platform,reference"),
        *("--levers", "ckpt:selective,ckpt:full@1x32", "--one-path-at-a-time", "--no-fp32-spread"),
        *("--steps", "3", "--warmup", "1"),
    )
    m = r["modes"]["online"]
    small = "lever:ckpt:full@1x32"  # a lever at a smaller micro-batch (an H100's SAC): its own tokens, no gap
    assert set(m["tokens_per_s"]) == {"platform", "reference", "lever:ckpt:selective", small}
    assert m["losses_agree"] and not m["kernels_failed"] and all(len(v) == 3 for v in m["step_s"].values())
    assert set(m["gap"]) == {"platform", "reference", "lever:ckpt:selective"}
    assert m["micro_batch"] == {
        "platform": "2 x 64",
        "reference": "2 x 64",
        "lever:ckpt:selective": "2 x 64",
        small: "1 x 32",
    }
    speed = {n: 2 * 64 / statistics.median(m["step_s"][n]) for n in m["step_s"]} | {
        small: 32 / statistics.median(m["step_s"][small])
    }
    assert all(math.isclose(m["tokens_per_s"][n], t, rel_tol=1e-2) for n, t in speed.items())
    assert m["mfu"] > 0 and m["mfu_datasheet"] is None


def test_an_unknown_lever_is_one_line(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.perf.distill_step", "--preset", "smoke", "--levers", "ckpt:bogus"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=120)
    assert proc.returncode != 0 and "--levers: unknown ckpt:bogus (known: ckpt:none" in proc.stderr
