"""The GPU acceptance call (benchmarks/gpu/acceptance.py) on the CPU: its budget plan and its timeout
(workshop/time_budget.py), and the whole call's plumbing with tiny shapes (`--cpu-smoke`) and its plan on a GPU
(`--plan-only`), so that the script a GPU session runs has run here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from workshop import time_budget as acc


def _acceptance(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m benchmarks.gpu.acceptance ARGS` from the repository's root, its output captured."""
    cmd = [sys.executable, "-m", "benchmarks.gpu.acceptance", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, check=False)


def _part(name: str, required: bool, *ests: float) -> acc.Part:
    return acc.Part(name, required, tuple(acc.Variant(f"{name}-{e:g}", e) for e in ests), lambda ctx, v: {})


PARTS = [_part("A", True, 100, 50), _part("B", True, 200, 80), _part("C", True, 60), _part("D", False, 90, 30)]


@pytest.mark.parametrize(
    "left, want",
    [
        (1000, {"A": 0, "B": 0, "C": 0, "D": 0}),  # everything at its largest
        (400, {"A": 0, "B": 0, "C": 0, "D": 1}),  # the required parts grow first; the optional one joins small
        (300, {"A": 0, "B": 1, "C": 0, "D": 1}),  # growth in priority order: A before B
        (200, {"A": 1, "B": 1, "C": 0}),  # coverage before size: A and B stay small so that C runs; D does not fit
        (150, {"A": 1, "B": 1}),  # C, the last required part, is skipped
        (40, {"D": 1}),  # no required part fits; the optional one does
    ],
)
def test_the_plan_covers_the_required_parts_first_then_grows_them_in_priority_order(left, want):
    choice, lines = acc.plan(PARTS, left)
    assert choice == want
    assert sum(p.variants[choice[p.name]].est_s for p in PARTS if p.name in choice) <= left
    for p, line in zip(PARTS, lines):
        assert line.startswith(f"{p.name}: ") and (("skipped: its smallest variant" in line) == (p.name not in choice))
        assert ("shrunk from" in line) == bool(choice.get(p.name))


def test_a_command_past_the_parts_timeout_is_killed_with_its_process_group(tmp_path):
    """A part that overruns its share is killed whole (here a shell and the child it started; in the call, `m2d
    run` and its Ray processes), so the call keeps to its budget."""
    pid_file = tmp_path / "child.pid"
    t = time.monotonic()
    with pytest.raises(acc.TimedOut, match="killed after 2 s"):
        acc.run_logged(
            ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], tmp_path / "sleepy", acc.Share(2.0, t)
        )
    assert time.monotonic() - t < 30
    child = int(pid_file.read_text())
    time.sleep(0.5)
    stat = Path(f"/proc/{child}/stat")
    state = stat.read_text().split()[2] if stat.exists() else "gone"
    assert state in ("gone", "Z"), f"the part's child {child} outlived its timeout (state {state})"
    fails = ["bash", "-c", "echo '{\"a\": 1}'; exit 3"]
    assert acc.run_logged(fails, tmp_path / "fails", acc.Share(60.0), check=False) == (3, '{"a": 1}\n')
    with pytest.raises(RuntimeError, match="exited 3; see .*fails.log"):
        acc.run_logged(["bash", "-c", "exit 3"], tmp_path / "fails", acc.Share(60.0))


SMOKE_PARTS = "P7-paper,P7-head,P7,run,tokens"  # the default suite's; memory and P5 join them in the slow test


def test_cpu_smoke_runs_its_parts_and_writes_the_table_and_results(tmp_path):
    """`python -m benchmarks.gpu.acceptance --cpu-smoke`: the real-head part first (P7 at the smoke preset in
    bf16-mixed, with the head's GPU branch at the real head's shapes on meta tensors), P7 for online, hidden and
    sampled targets, a whole `m2d run`
    (hidden targets, one student) and the Ray Data token pass, on the CPU with tiny shapes; one table at the end, the
    efficiency per mode in the results (on the CPU: `plan.cpu_efficiency`'s figure, tiny shapes: plumbing only), and
    no measured_gpu.json (a CPU measures no GPU figure; tests/unit/test_plan_gpu.py checks the file's making)."""
    proc = _acceptance("--cpu-smoke", "--parts", SMOKE_PARTS, "--work", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert {k: v["status"] for k, v in results["parts"].items()} == {
        "P7-paper": "ok",
        "P7-head": "ok",
        "P7": "ok",
        "run": "ok",
        "tokens": "ok",
    }
    table = (tmp_path / "table.md").read_text()
    assert table == proc.stdout[proc.stdout.index("# GPU acceptance") :].rstrip("\n") + "\n"  # printed once, at the end
    names = [
        ln.split("|")[1].strip() for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| part")
    ]
    assert names == [
        "P7-paper hidden",
        "P7-paper hidden levers",
        "P7-paper efficiency",
        "P7-head meta",
        "P7-head online",
        "P7 online",
        "P7 hidden",
        "P7 sampled:8",
        "P7 efficiency",
        "run",
        "tokens",
    ]
    head = results["parts"]["P7-head"]
    # the head's GPU branch ran at the paper student's head and micro-batch (meta tensors, the seam forced)
    assert "'vocab': 151936" in table and "'tokens': 16384" in table and "torch.bfloat16" in table
    paper = results["parts"]["P7-paper"]["p7"]["targets"]["hidden"]  # one path at a time, a lever beside the platform
    lever = "lever:ckpt:selective@1x32"  # a micro-batch of 1 x 32 tokens (its plan's, on a GPU), said in its row
    assert set(paper["tokens_per_s"]) == {"platform", "reference", lever} and paper["losses_agree"]
    assert paper["micro_batch"] == {"platform": "2 x 64", "reference": "2 x 64", lever: "1 x 32"}
    assert "ckpt:selective at micro-batch 1 x 32" in table and "micro-batch 2 x 64: tok/s platform" in table
    assert "ckpt:selective" in table and results["parts"]["P7-paper"]["efficiency"]["modes"]["hidden"]["efficiency"] > 0
    online = head["p7"]["targets"]["online"]  # bf16-mixed: its spread against float32 measured, kernels held to it
    assert online["bf16_spread"] > 0 and online["kernel_admission"] == online["bf16_spread"]
    assert 0 < online["head_kl_share"] < 1 and online["losses_agree"]
    entry = dict(head["kl_kernel"]["online"])
    assert isinstance(entry.pop("tokens"), int)  # the micro-batch it was measured at
    assert entry == {
        "kernel": "chunked",
        "device": head["p7"]["device"],
        "loss": "fkl",
        "temperature": 1.0,
        "path": "plain",
    }
    p7 = results["parts"]["P7"]["p7"]["targets"]
    assert set(p7) == {"online", "hidden", "sampled:8"} and all(
        m["losses_agree"] and m["ratio"] > 0 for m in p7.values()
    )
    assert (
        p7["hidden"]["flops_per_token"] > p7["sampled:8"]["flops_per_token"]
    )  # the teacher's head, counted as the bill does
    eff = results["parts"]["P7"]["efficiency"]
    assert eff["key"] == "plan.cpu_efficiency" and set(eff["modes"]) == set(p7)
    assert all(m["efficiency"] > 0 for m in eff["modes"].values())
    assert {m: k["kernel"] for m, k in results["parts"]["P7"]["kl_kernel"].items()} == {
        "online": "chunked",
        "hidden": "chunked",
    }
    assert not (tmp_path / "measured_gpu.json").exists()
    run = results["parts"]["run"]["result"]
    assert (
        set(results["parts"]["run"]["walls"]) == set(run["stages"]) and results["parts"]["run"]["machine"]["gpus"] == 0
    )
    assert run["outcome"]["students"]["ok"] == 1 and set(run["stages"]) >= {"stage1", "stage2", "stage3"}
    assert (
        "targets" in results["parts"]["run"]["bill"]["stages"]
    )  # the run cached hidden states (the GPU run's setting)
    tokens = results["parts"]["tokens"]["p9"]
    assert [r["mode"] for r in tokens] == ["loop", "ray1"] and len({r["shards_sha"] for r in tokens}) == 1


@pytest.mark.slow
def test_cpu_smoke_runs_every_part_by_default(tmp_path):
    """Without --parts the smoke runs every part of the GPU call, the optional ones (memory, P5) too (~4.5 minutes
    on two busy cores)."""
    proc = _acceptance("--cpu-smoke", "--work", str(tmp_path), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert {k: v["status"] for k, v in results["parts"].items()} == dict.fromkeys(
        ["P7-paper", "P7-head", "P7", "run", "tokens", "memory", "P5"], "ok"
    )


def test_on_a_gpu_the_paper_student_runs_first_then_its_kernels_and_the_memory_plan_within_one_call():
    """The call's parts in the issue's order: the paper's student (its step, the plain loop and each lever), then the
    kernels at the paper's micro-batch (the head preset: vocabulary 151,936, hidden 2048, 32 heads, 4 x 4096 tokens),
    then the memory plan (the time it took: --small's measured seconds); all three planned in at a 540-s call."""
    proc = _acceptance("--plan-only", "1", "--budget-s", "540", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    call = json.loads(proc.stdout.strip().splitlines()[-1])  # the parts planned at 540 s less the call's reserve
    todo = call["parts"]
    assert [(p["name"], p["required"]) for p in todo[:4]] == [
        ("P7-paper", True),
        ("P7-head", True),
        ("memory", True),
        ("P5", False),
    ]
    assert all(v["args"]["preset"] == "paper" and v["args"]["targets"] == "hidden" for v in todo[0]["variants"])
    assert all(v["args"]["preset"] == "head" for v in todo[1]["variants"])
    from workshop.random_models import STEP_PRESETS

    head = STEP_PRESETS["head"]
    assert (head["vocab"], head["hidden"], head["heads"], head["batch"] * head["seq_len"]) == (151936, 2048, 32, 16384)
    assert {p["name"] for p in todo if p["required"]} <= set(call["choice"])
    # the paper part runs the platform's own kernel (chunked) and no attention lever (the platform's attention is SDPA)
    assert all(v["args"]["kernels"] == "" and "attn" not in v["args"].get("levers", "") for v in todo[0]["variants"])
    assert all(v["args"]["one_path_at_a_time"] for v in todo[1]["variants"])  # the head's plain loop alone: ~66 GiB
    for card, x in call["cards"].items():  # every path within its card, the whole call within the budget
        assert x["fits_budget"] and x["planned_s"] <= 540 and x["paths_over_card"] == [], card
        paper = x["parts"]["P7-paper"]
        assert "platform" in paper["paths"] and all(
            b["peak_bytes"] <= x["memory_bytes"] for b in paper["paths"].values()
        )
        assert "reference" in paper["left_out"] and "GiB" in paper["left_out"]["reference"]  # never attempted
    h100, h200 = call["cards"]["H100 80 GB"]["parts"]["P7-paper"], call["cards"]["H200 141 GB"]["parts"]["P7-paper"]
    assert (h100["checkpointing"], h200["checkpointing"]) == ("full", "selective")
    # SAC at the paper's shape on an H100: at the largest micro-batch whose rank the plan fits in 80 GB (the paper's
    # 4 x 4096 and one of its sequences do not), named so; on an H200 it is the platform's own policy
    from workshop.random_models import STEP_PRESETS
    from workshop.step_paths import checkpointing_of, micro_batch

    paper_preset = STEP_PRESETS["paper"]
    _, plans = checkpointing_of(paper_preset, "cuda", call["cards"]["H100 80 GB"]["memory_bytes"])
    selective, cap = plans["policies"]["selective"], plans["decided"]["capacity_bytes"]
    fits = [mb for mb, b in selective["rank_by_micro_batch"].items() if b <= cap]
    assert selective["rank_bytes"] > cap and selective["rank_by_micro_batch"][micro_batch(1, 4096)] > cap and fits
    assert [n for n in h100["paths"] if "selective" in n] == [f"lever:ckpt:selective@{fits[0]}"]
    assert h100["paths"][f"lever:ckpt:selective@{fits[0]}"]["peak_bytes"] == selective["rank_by_micro_batch"][fits[0]]
    assert "ckpt:selective" not in h100["left_out"] and h200["left_out"]["ckpt:selective"].startswith("the platform")


def test_a_killed_smoke_keeps_the_figures_of_the_paths_it_finished(tmp_path):
    """Killed mid-part (SIGTERM, as a device's limit or the call's own alarm would), the call ends its running
    benchmark and leaves results.json and table.md with every path that finished: the paper part runs one path at a
    time and its child writes its figures after each, which the call reads as it goes."""
    cmd = [sys.executable, "-m", "benchmarks.gpu.acceptance", "--cpu-smoke", "--parts", "P7-paper", "--work"]
    proc = subprocess.Popen(
        [*cmd, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    child = tmp_path / "logs" / "p7_paper.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if child.exists() and json.loads(child.read_text()).get("running", {}).get("tokens_per_s"):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the part ended before a path finished: nothing to kill"
    proc.terminate()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 3, out[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    part = results["parts"]["P7-paper"]
    assert part["status"] == "KILLED (SIGTERM)"
    assert "platform" in part["partial"]["running"]["tokens_per_s"]
    table = (tmp_path / "table.md").read_text()
    row = next(ln for ln in table.splitlines() if ln.startswith("| P7-paper hidden (unfinished) |"))
    assert "KILLED by SIGTERM" in table and "| running | paths finished: platform " in row


@pytest.mark.parametrize("runner", ["one_at_a_time", "in_turns"])
def test_a_failing_path_the_plain_loop_included_is_said_and_the_others_kept(runner):
    """Any path that raises, the reference (plain loop) as much as a kernel, is recorded with its one line and left
    out; the others' figures are kept (on an H100 the loop's out-of-memory ended the whole part before)."""
    import torch

    from workshop import step_paths

    def good(student):
        losses = []
        return (lambda batch: losses.append(float(batch.sum()))), (lambda: losses.pop())

    def oom(student):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB")

    p = {"device": "cpu", "warmup": 0, "batch": 1, "seq_len": 4}
    make = {"platform": good, "reference": oom, "lever:compile": good}
    times, losses, _, failed = getattr(step_paths, runner)(
        list(make), make, torch.nn.Linear(1, 1), [torch.ones(2)] * 2, p
    )
    assert set(failed) == {"reference"} and failed["reference"].startswith("OutOfMemoryError: CUDA out of memory")
    assert set(times) == set(losses) == {"platform", "lever:compile"} and losses["platform"] == [2.0, 2.0]


def test_a_path_the_plan_says_cannot_fit_is_left_out_with_its_planned_peak():
    """The plain loop at the paper's micro-batch holds its whole float32 logits: its planned peak is over both
    cards, so it is never attempted; the platform's own step fits."""
    from workshop.random_models import STEP_PRESETS
    from workshop.step_paths import checkpointing_of, fitting_paths, path_peaks

    p = STEP_PRESETS["paper"]
    for memory in (80 * 10**9, 141 * 10**9):
        policy, plans = checkpointing_of(p, "cuda", memory)
        names = ["platform", "reference", "lever:ckpt:none"]
        peaks = path_peaks(names, plans, p, policy)
        kept, left = fitting_paths(names, peaks, plans)
        assert kept == ["platform"] and set(left) == {"reference", "lever:ckpt:none"}
        assert peaks["reference"] > peaks["platform"] and "GiB" in left["reference"]
