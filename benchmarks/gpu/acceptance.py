"""GPU acceptance call (driven by benchmarks/gpu_acceptance.sh): what stage 2 runs now, planned against a device budget.

    part     what runs                                                   figures
    P7-paper perf.distill_step --preset paper: the paper's student       tok/s and MFU (against the data sheet and
             (48 x 2048, 32/4 heads, FFN 6144, V 151,936), 4 x 4096       the measured matmul rate) of the platform,
             tokens, from cached hidden states on one rank, checkpointed  the plain loop and each lever; each path's
             as `m2d plan` decides for this GPU; platform, plain loop and  peak beside the plan's; the attention the
             each lever (checkpointing, compiled layers, attention), one   student dispatches to and the fastest
             path at a time (first: the step the bill rests on)           implementation; plan.efficiency (hidden)
    P7-head  perf.distill_step --preset head: the paper student's         the head + KL's share of the step, each
             head (V 151,936, d 2048, 32 heads) at 4 x 4096 tokens,       kernel's tok/s and step peak, bf16-mixed's
             online + hidden, platform + plain loop + fp32 + every kernel spread vs fp32; the kernel auto uses (and
             (it sets the kernel auto uses, at the paper's micro-batch)   where it was measured)
    P7      perf.distill_step --preset h100, online, hidden,        per mode: platform, DeepSpeed and plain-loop
            sampled:64: DistillStep (plain torch, DeepSpeed ZeRO-2, and   tok/s at equal numerics (bf16-mixed), both
            each exact-KL kernel: chunked, liger) against a       ratios, MFU, each kernel's tok/s, step peak
            plain PyTorch loop, 2.52B Qwen3-MoE teacher -> 0.40B student  and trajectory gap; the efficiency per mode
                                                                          and the fastest kernel at the same loss
    run     m2d run experiments/tiny.yaml on the GPU (short budgets):     stage walls against the bill (the GPU start-
            calibration and stage-1 trials on fractions of it, the bf16   ups are fit on them: plan/fit.py), students
            hidden-states targets pass (Ray Data), students in bf16-mixed ok / failed
            (two GPUs each over NCCL with DeepSpeed when there are two),
            lm-eval, the analysis, the report
    tokens  p9_corpus_tokens.py: the Ray Data token pass (4 actors)        tokens/s, ratio, identical shards
            against one loop, on a generated Parquet corpus
    memory  plan_measured.py --device cuda: the memory plan against       the largest deviation (bound 25%)
            torch.cuda.max_memory_allocated (the time it takes: ~125 s)
    P5      calibration at Qwen3-30B-A3B's layer shapes (make_teacher.py;  stats TFLOP/s vs the bf16 matmul (target >=
            calibrate() whole and layer-streamed) against a bf16 8192^3    60%), streamed = whole
            matmul (when the budget allows)
The required parts, in this order, fit one 540-s call: the paper student, the kernels at its micro-batch, the memory
plan; P5, P7 at the h100 preset, the whole run and the token pass follow as the budget allows.

Planning. Each part has variants, largest first, with an estimate of its seconds: what the last call measured of that
variant (m2d_ray/measured_gpu.json, "parts_s"), else a guess (the table prints both beside the measured seconds).
Before each part, the parts still to run are planned against what is left of --budget-s: coverage first (every
required part at its smallest), then size, in the table's order (its priority); a part left out is skipped with what
it needed. A part runs with a timeout that leaves the smallest variants of the required parts after it their time;
one that overruns is killed (its whole process group, Ray's processes included) and recorded as timed out, and the
call goes on.

Each part's benchmark writes its figures to WORK/logs/PART.json (--json-out, rewritten as it goes: a part killed
for its time keeps what it finished), not to be read back from its output.

Output: one table at the end (also WORK/table.md), every figure in WORK/results.json, logs in WORK/logs, and on a GPU
WORK/measured_gpu.json: m2d_ray/measured_gpu.json as this call measured it (plan.efficiency per targets mode, the
fastest exact kernel per mode for distill.kl_kernel=auto, the run's walls and the start-ups fit on them, each part's
seconds; what no part measured carried over). Copying it over the packaged one sets the defaults; no figure is copied
by hand. Exit status 1 when a part failed or timed out.

    bash benchmarks/gpu_acceptance.sh [--budget-s 540] [--work /tmp/m2d-gpu-acceptance] [--parts P7-head,P7,run]
    python -m benchmarks.gpu.acceptance --cpu-smoke [--parts P7,run,tokens]   # the same plumbing on the CPU, tiny
                                                                               # shapes: no figure of it means anything
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workshop.measured_write import accelerator_of, measured_file, prior
from workshop.time_budget import Part, Share, TimedOut, Variant, plan, run_logged

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
M2D = [PY, "-m", "m2d_ray.cli"]
RESERVE_S = 15.0  # the table, results and efficiency files after the last part
FULL = dict(
    d=2048, I=768, E=128, k=8, heads=32, kv_heads=4, head_dim=128, dtype="bfloat16"
)  # Qwen3-30B-A3B's layer shapes
TINY = dict(d=64, I=32, E=16, k=2, heads=4, kv_heads=2, head_dim=16, dtype="float32")


@dataclass
class Ctx:
    """What every part's runner shares: where it writes, the device, and the call's deadline."""

    work: Path
    cuda: bool
    smoke: bool
    deadline: float
    timeout_s: float = 0.0  # the running part's, from `started`
    started: float = 0.0

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    def json_out(self, log: str) -> Path:
        """Where a part's child writes its figures (its --json-out), beside its logs."""
        return self.logs / f"{log}.json"

    def figures(self, log: str) -> dict:
        """What the child writing `json_out(log)` left there ({} where it wrote nothing: it failed or was killed
        first)."""
        path = self.json_out(log)
        return json.loads(path.read_text()) if path.exists() else {}

    def sh(self, cmd: list, log: str, check: bool = True) -> tuple[int, str]:
        """`cmd` within the running part's timeout, logged under logs/ (`time_budget.run_logged`)."""
        return run_logged(cmd, self.logs / log, Share(self.timeout_s, self.started), REPO, check)


def json_lines(text: str) -> list[dict]:
    """The JSON lines of a command's stdout: `m2d run`'s result is its last (the CLI's contract); the benchmarks a
    part runs write their figures to a file instead (--json-out, `Ctx.figures`)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


# ---- P7: the step per targets mode, its kernels, and the efficiency the bill should use ------------------------------
def run_p7(ctx: Ctx, v: Variant) -> dict:
    """P7 at a preset (the part `P7-head`: the paper student's head, its kernel choice; `P7`: every targets mode and
    the efficiency the bill reads)."""
    a, name = v.args, v.args.get("name", "P7")
    log = name.lower().replace("-", "_")
    cmd = [PY, "-m", "benchmarks.perf.distill_step", "--preset", a["preset"], "--targets", a["targets"]]
    keys = ("paths", "kernels", "levers", "steps", "warmup", "threads", "precision", "meta_rehearsal")
    cmd += [x for k in keys if k in a for x in (f"--{k.replace('_', '-')}", a[k])]
    cmd += ["--one-path-at-a-time"] if a.get("one_path_at_a_time") else []
    ctx.json_out(log).unlink(missing_ok=True)
    try:
        rc, _ = ctx.sh([*cmd, "--json-out", ctx.json_out(log)], log, check=False)
        failed = (
            f"exit {rc}: a path's loss trajectory left its tolerance, or it failed; see logs/{log}.log" if rc else None
        )
    except TimedOut as exc:  # the modes that finished are in its file
        failed = str(exc)
    got = ctx.figures(log)
    final = got.get("final")
    modes = final["targets"] if final else got.get("modes", {})
    device = final["device"] if final else gpu_name() if ctx.cuda else None
    rows = [(f"{name} {m}", p7_figures(r)) for m, r in modes.items()]
    rows += [(f"{name} {m} levers", lever_figures(r)) for m, r in modes.items() if lever_figures(r)]
    rehearsal = got.get("meta_rehearsal")
    if rehearsal:
        rows.insert(0, (f"{name} meta", f"the head's GPU branch on meta tensors: {rehearsal}"))
    eff = efficiency(modes, device, ctx) if modes and name in ("P7", "P7-paper") else None
    if eff:
        per = ", ".join(f"{m} {x['efficiency']:.3f}" for m, x in eff["modes"].items())
        rows.append((f"{name} efficiency", f"{eff['key']}: {per} ({eff['peak']})"))
    return {
        "rows": rows or [(name, "no mode finished")],
        "failed": failed,
        "p7": final or {"targets": modes},
        "efficiency": eff,
        "kl_kernel": {
            m: {"kernel": r["kl_kernel"], "device": device, **r["measured_at"]}
            for m, r in modes.items()
            if m in ("online", "hidden") and name != "P7-paper"  # the paper part runs chunked (kernels: P7-head)
        },
        "attention": next((r["attention"] for r in modes.values() if r.get("attention")), None),
    }


def lever_figures(r: dict) -> str:
    """Each lever's tok/s against the platform's, its MFU against the data sheet, its trajectory gap and its peak
    beside the plan's bytes for it; the paths that failed or were left out, with why."""
    base = r.get("platform_tokens_per_s")
    sheet = r.get("lever_mfu_datasheet") or {}
    plan = r.get("peak_vs_plan") or {}
    out = [
        f"{n.removeprefix('lever:')} {t:,.0f} tok/s ({t / base:.2f}x"
        + (f", MFU {sheet[n]:.1%} of the data sheet" if n in sheet else "")
        + f", gap {r['gap'][n]:.1e}"
        + (f", peak {plan[n]:.2f}x the plan" if n in plan else "")
        + ")"
        for n, t in r.get("tokens_per_s", {}).items()
        if n.startswith("lever:") and base
    ]
    if "platform" in plan:
        out.insert(0, f"platform ({r.get('checkpointing')}) peak {plan['platform']:.2f}x the plan's path")
    if r.get("attention"):
        out.append(f"attention: {r['attention']['implementation']} fastest")
    out += [f"{n} left out ({why})" for n, why in (r.get("levers_skipped") or {}).items()]
    return "; ".join(out)


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def p7_figures(r: dict) -> str:
    def tps(k):
        return f"{r[k]:,.0f}" if r.get(k) else "-"

    def pct(x):
        return f"{x:.1%}" if x else "-"

    def ratio(x):
        return f"{x:.2f}x" if x else "-"

    kernels = "; ".join(
        f"{n.partition(':')[2] or 'compiled student'} {t:,.0f} tok/s (gap {r['gap'][n]:.1e}"
        + (f", step peak {r['peak_step_bytes'][n] / 2**30:.1f} GiB" if r.get("peak_step_bytes") else "")
        + ")"
        for n, t in r.get("tokens_per_s", {}).items()
        if n.startswith("platform:") or n == "platform_compiled"
    )
    agree = "" if r.get("losses_agree", True) else "; LOSS TRAJECTORIES DIFFER"
    agree += "".join(f"; {n} FAILED ({why})" for n, why in (r.get("kernels_failed") or {}).items())
    share = ""
    if r.get("head_kl_s"):
        share = f"head + KL {r['head_kl_s'] * 1e3:.1f} ms = {r['head_kl_share']:.0%} of the step; "
    spread = f" (admitted within bf16-mixed's spread vs fp32, {r['bf16_spread']:.1e})" if r.get("bf16_spread") else ""
    return (
        f"tok/s platform {tps('platform_tokens_per_s')}, DeepSpeed {tps('platform_deepspeed_tokens_per_s')}, "
        f"plain loop {tps('reference_tokens_per_s')}: ratio {ratio(r.get('ratio'))}, DeepSpeed "
        f"{ratio(r.get('deepspeed_ratio'))}; MFU {pct(r.get('mfu'))} of the measured matmul rate, "
        f"{pct(r.get('mfu_datasheet'))} of the data sheet (loop {pct(r.get('reference_mfu'))}, "
        f"{pct(r.get('reference_mfu_datasheet'))}); {share}"
        f"kernels: {kernels or 'chunked only'} -> auto: {r.get('kl_kernel', 'chunked')}{spread}{agree}"
    )


def efficiency(modes: dict, device: str | None, ctx: Ctx) -> dict | None:
    """The fraction of the peak the platform's step reached per mode (with the kernel distill.kl_kernel=auto would
    pick), at the bill's FLOPs per token: on a GPU against its data-sheet bf16 peak (accelerators.GPU_PEAK_BF16), the
    figures `plan.efficiency` holds per mode; on the CPU against the measured matmul rate (P7's MFU), what
    `plan.cpu_efficiency` is (plumbing only in the smoke)."""
    from m2d_ray.accelerators import GPU_PEAK_BF16

    per = {
        m: {
            "tokens_per_s": r["auto_tokens_per_s"],
            "flops_per_token": r["flops_per_token"],
            "mfu_vs_measured_matmul": r.get("mfu"),
            "ratio_to_plain_loop": r.get("ratio"),
        }
        for m, r in modes.items()
        if r.get("auto_tokens_per_s")
    }
    if not per:
        return None
    if ctx.cuda:
        name = accelerator_of(device)
        if name is None:
            print(f"plan.efficiency: not measured ({device} has no data-sheet peak in accelerators.GPU_PEAK_BF16)")
            return None
        peak, key, what = GPU_PEAK_BF16[name], "plan.efficiency", f"{name}'s data-sheet bf16 peak"
        for x in per.values():
            x["efficiency"] = x["tokens_per_s"] * x["flops_per_token"] / peak
    else:
        if any(x["mfu_vs_measured_matmul"] is None for x in per.values()):
            return None
        peak, key, what = None, "plan.cpu_efficiency", "the measured fp32 matmul rate (CPU smoke: plumbing only)"
        for x in per.values():
            x["efficiency"] = x["mfu_vs_measured_matmul"]
    return {"device": device, "key": key, "peak_flops": peak, "peak": what, "modes": per}


# ---- run: m2d run of the demo config on the device -----------------------------------------------------------------
def run_whole(ctx: Ctx, v: Variant) -> dict:
    """The whole tiny run on this machine (all its CPUs): its stage walls against its bill, and the walls, overrides
    and machine the measured file records (the GPU start-ups are fit on them)."""
    import torch

    out_dir = ctx.work / "run"
    shutil.rmtree(out_dir, ignore_errors=True)
    machine = {"cpus": os.cpu_count(), "gpus": torch.cuda.device_count() if ctx.cuda else 0}
    args = [f"ray.num_cpus={machine['cpus']}", *v.args["overrides"]]
    config = REPO / "m2d_ray" / "experiments" / v.args.get("config", "tiny.yaml")
    _, out = ctx.sh(M2D + ["run", config, "--out", out_dir, *args], "run")
    res = json_lines(out)[-1]
    walls = res.get("stages", {})
    bill = json.loads((out_dir / "memory_plan.json").read_text()).get("cost", {})
    est = {k: s["seconds"] for k, s in bill.get("stages", {}).items()}
    students = ", ".join(f"{n} {k}" for k, n in res.get("outcome", {}).get("students", {}).items() if n)
    fig = (
        f"walls {', '.join(f'{k} {s:.0f} s' for k, s in walls.items())} (the bill: "
        f"{', '.join(f'{k} {s:.0f} s' for k, s in est.items())}); "
        f"students {students}; evaluated {res.get('outcome', {}).get('evaluated')}"
    )
    failed = (
        None
        if not res.get("outcome", {}).get("students", {}).get("failed")
        else "a student failed (see the run's logs)"
    )
    return {
        "rows": [("run", fig)],
        "failed": failed,
        "result": res,
        "bill": bill,
        "walls": walls,
        "overrides": v.args["overrides"],
        "machine": machine,
    }


# ---- tokens: the Ray Data token pass against one loop --------------------------------------------------------------
def run_tokens(ctx: Ctx, v: Variant) -> dict:
    a = v.args
    ctx.json_out("tokens").unlink(missing_ok=True)
    ctx.sh(
        [
            PY,
            "-m",
            "benchmarks.perf.corpus_tokens",
            "--mb",
            a["mb"],
            "--shard-mb",
            a["shard_mb"],
            "--modes",
            *a["modes"],
            "--cache",
            ctx.work / "p9",
            "--json-out",
            ctx.json_out("tokens"),
        ],
        "tokens",
    )
    rows = ctx.figures("tokens")["p9"]
    same = len({r["shards_sha"] for r in rows}) == 1
    fig = (
        "; ".join(
            f"{r['mode']} {r['tokens_per_s']:,} tok/s"
            + (f" ({r['vs_loop']:.2f}x the loop)" if r["mode"] != "loop" and r["vs_loop"] else "")
            for r in rows
        )
        + f"; {rows[0]['tokens']:,} tokens; shards {'identical' if same else 'DIFFER'}"
    )
    return {"rows": [("tokens", fig)], "failed": None if same else "the modes wrote different token shards", "p9": rows}


# ---- memory: the memory plan against the device's peaks ------------------------------------------------------------
def run_memory(ctx: Ctx, v: Variant) -> dict:
    _, out = ctx.sh(
        [PY, "-m", "benchmarks.perf.memory_plan", "--device", "cuda" if ctx.cuda else "cpu", *v.args["flags"]],
        "memory",
        check=False,
    )
    worst = next((ln for ln in out.splitlines() if ln.startswith("largest deviation")), None)
    return {
        "rows": [("memory", worst or "no result; see logs/memory.log")],
        "failed": None if worst else "plan_measured failed",
    }


# ---- P5: calibration at full layer shapes against the matmul rate --------------------------------------------------
def run_p5(ctx: Ctx, v: Variant) -> dict:
    a, shape = v.args, FULL if ctx.cuda else TINY
    teacher = ctx.work / "teacher"
    ctx.sh(
        [
            PY,
            "-m",
            "benchmarks.tools.make_teacher",
            "--out",
            teacher,
            "--layers",
            a["layers"],
            "--E",
            shape["E"],
            "--k",
            shape["k"],
            "--d",
            shape["d"],
            "--I",
            shape["I"],
            "--heads",
            shape["heads"],
            "--kv-heads",
            shape["kv_heads"],
            "--head-dim",
            shape["head_dim"],
            "--dtype",
            shape["dtype"],
        ],
        "teacher",
    )
    mm = matmul_tflops(ctx.cuda)
    calib = {}
    for mode in ("whole", "streamed"):
        out = ctx.work / f"stats-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        log = f"calib-{mode}"
        ctx.json_out(log).unlink(missing_ok=True)
        ctx.sh(
            [
                PY,
                "-m",
                __spec__.name,
                "--child-calibrate",
                mode,
                "--json-out",
                ctx.json_out(log),
                "--teacher",
                teacher,
                "--out",
                out,
                "--tokens",
                a["tokens"],
                "--seq-len",
                a["seq_len"],
            ],
            log,
        )
        calib[mode] = ctx.figures(log)
    diff = stats_agree(ctx.work / "stats-whole", ctx.work / "stats-streamed")
    w, s = calib["whole"], calib["streamed"]
    fig = (
        f"{a['layers']} layers, {w['tokens']:,} tokens: stats {w['tflops']:.1f} TFLOP/s = {w['tflops'] / mm:.0%} of "
        "the "
        f"{'bf16 8192^3' if ctx.cuda else 'fp32 1024^3'} matmul's {mm:,.1f} (P5 target >= 60%); streamed "
        f"{s['seconds'] / w['seconds']:.2f}x "
        f"the whole's time, max rel diff {diff:.1e}"
    )
    return {"rows": [("P5", fig)], "failed": None, "calibration": calib, "matmul_tflops": mm}


def child_calibrate(a) -> None:
    import torch

    from m2d_ray.calibrate import calibrate
    from m2d_ray.calibrate.tokens import calibration_tokens
    from m2d_ray.models import load_teacher
    from m2d_ray.weights import open_teacher

    device = "cuda" if torch.cuda.is_available() else "cpu"
    streamed = a.mode == "streamed"
    teacher = open_teacher(a.teacher, device=device) if streamed else load_teacher(a.teacher, device=device)
    spec, tokens = calibration_tokens(teacher.tokenizer, "synthetic:valid", a.teacher, a.seq_len, a.tokens)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    art, _ = calibrate(teacher, tokens, spec, out=a.out, batch_size=8, device=device, stream=streamed, progress=False)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    cfg, adapter = teacher.config, teacher.adapter
    E, T, d, L, I = (
        adapter.num_experts(cfg),
        tokens.n_tokens,
        cfg.hidden_size,
        len(art.layers),
        cfg.moe_intermediate_size,
    )
    flops = L * (
        2.0 * T * E * 3 * I * d + 2.0 * E * E * T * d
    )  # P1's count: every expert on every token, plus the Gram
    from benchmarks.common import write_json

    figures = {"seconds": seconds, "tokens": T, "tflops": flops / seconds / 1e12, "sha256": art.checksum}
    print(json.dumps(figures), flush=True)
    write_json(a.json_out, figures)


def matmul_tflops(cuda: bool) -> float:
    import torch

    from benchmarks.common import matmul_gflops

    return (
        matmul_gflops(8192, torch.bfloat16, "cuda", iters=20) / 1e3
        if cuda
        else matmul_gflops(1024, torch.float32, "cpu") / 1e3
    )


def stats_agree(a: Path, b: Path) -> float:
    """Largest relative difference of any statistic between two artifacts."""
    from m2d_ray.arch.base import rel_error
    from m2d_ray.calibrate.artifact import load_stats

    x, y = load_stats(a).layers, load_stats(b).layers
    return max(rel_error(v, y[i].to_tensors("")[n]) for i in x for n, v in x[i].to_tensors("").items())


# ---- the parts, their variants and estimates ----------------------------------------------------------------------
RUN_SHORT = ["calib.max_tokens=8192", "stage2.targets=hidden", "grid.scaling=[uniform]"]
RUN_GRIDS = {  # label -> overrides of experiments/tiny.yaml
    "4 configs, 4 + 2 students, 20 steps": [
        "grid.scoring=[sf,do-acp]",
        "grid.grouping=[rr,oc]",
        "grid.K=[2,4]",
        "distill.steps=20",
        "distill.eval_every=10",
        "stage2.baselines=[random-ffn,random-init]",
        "stage3.limit=100",
    ],
    "1 config, 1 + 1 students, 10 steps": [
        "grid.scoring=[sf]",
        "grid.grouping=[rr]",
        "grid.K=[2]",
        "distill.steps=10",
        "distill.eval_every=5",
        "stage2.baselines=[random-init]",
        "stage3.limit=50",
    ],
}
RUN_SMOKE = {  # the CPU rehearsal's run: experiments/smoke.yaml and what it changes
    "config": "smoke.yaml",
    "overrides": ["stage2.targets=hidden", "stage3.limit=24", "stage3.teacher=false"],
}


# no DeepSpeed path (its CPU op compiles for ~80 s the first time in a checkout; the path is the same code with a flag);
# one thread (a core busy with another process stalls every 2-thread OpenMP region: RESULTS.md's header)
P7_SMOKE = {"preset": "smoke", "targets": "online,hidden,sampled:8", "paths": "platform,reference", "threads": 1}
# the paper part rehearsed: one path at a time, bf16-mixed, a checkpointing lever beside the platform and the loop
P7_PAPER_SMOKE = {
    "name": "P7-paper",
    "preset": "smoke",
    "targets": "hidden",
    "paths": "platform,reference",
    "levers": "ckpt:selective",
    "one_path_at_a_time": True,
    "threads": 1,
    "precision": "bf16-mixed",
    "steps": "3",
}
# the real-head part rehearsed: bf16-mixed (its fp32 spread path and the kernel admission), and the head's GPU branch
# at the real head's shapes on meta tensors (numerics.tensor_cores forced: what a GPU's first step would fail at)
P7_HEAD_SMOKE = {
    "name": "P7-head",
    "preset": "smoke",
    "targets": "online",
    "paths": "platform,reference",
    "threads": 1,
    "precision": "bf16-mixed",
    "meta_rehearsal": "head",
}


def gpu_overrides(gpus: int) -> list[str]:
    """The demo on one GPU: stage-1 trials on eighths of it, the calibration and targets actors on quarters, each
    student a Train worker on a quarter (plain torch in bf16-mixed: distill.deepspeed=auto at one rank), lm-eval on
    quarters; with two GPUs or more, each student on two workers of a whole GPU (DeepSpeed ZeRO-2 over NCCL between
    GPUs: below half a GPU two ranks would share one)."""
    students = ["distill.workers=2", "distill.gpus_per_worker=1"] if gpus >= 2 else ["distill.gpus_per_worker=0.25"]
    return [
        "ray.gpus_per_trial=0.125",
        "ray.max_concurrent_trials=8",
        "ray.data_gpus_per_actor=0.25",
        *students,
        "stage3.gpus_per_task=0.25",
    ]


def measured(part: str, label: str, guess: float, args: dict) -> Variant:
    """A GPU variant, its estimate what the last call measured of the variant of this name (else `guess`)."""
    return Variant(label, prior(part, label, guess), args)


PAPER_FULL = "paper preset (48 x 2048, V 151,936, 4 x 4096 tokens), hidden, platform + plain loop + levers, 2 + 4 steps"
PAPER_SHORT = "paper preset, hidden, platform + plain loop + compiled layers, 1 + 3 steps"
HEAD_FULL = (
    "head preset (V 151,936, d 2048, 32 heads, 4 x 4096 tokens), online,hidden, 2 paths + fp32 + kernels, 2 + 6 steps"
)
HEAD_SHORT = "head preset (4 x 4096 tokens), online, 2 paths + fp32 + kernels, 1 + 3 steps"


def parts(cuda: bool, gpus: int) -> list[Part]:
    """The call's parts in priority order, with their variants (largest first) and estimated seconds: on a GPU what the
    last call measured of a variant (`prior`), else a guess; or for the CPU smoke on 2 cores."""
    if not cuda:
        return [
            Part(
                "P7-paper",
                True,
                (
                    Variant(
                        "smoke preset, hidden, one path at a time, platform + plain loop + a lever", 20, P7_PAPER_SMOKE
                    ),
                ),
                run_p7,
            ),
            Part(
                "P7-head",
                True,
                (Variant("smoke preset, bf16-mixed, + the real head's GPU branch on meta", 20, P7_HEAD_SMOKE),),
                run_p7,
            ),
            Part(
                "P7",
                True,
                (Variant("smoke preset, online + hidden + sampled:8, platform + plain loop", 25, P7_SMOKE),),
                run_p7,
            ),
            Part(
                "run",
                True,
                (Variant("1 config, 1 student, 4 steps, hidden targets", 90, RUN_SMOKE),),
                run_whole,
            ),
            Part(
                "tokens",
                True,
                (Variant("0.5 MB corpus, loop + ray1", 35, {"mb": 0.5, "shard_mb": 0.25, "modes": ["loop", "ray1"]}),),
                run_tokens,
            ),
            Part(
                "memory", False, (Variant("--small, 1 case", 40, {"flags": ["--small", "--cases", "1"]}),), run_memory
            ),
            Part(
                "P5",
                False,
                (Variant("tiny shapes, 2 layers, 4,096 tokens", 45, {"layers": 2, "tokens": 4096, "seq_len": 256}),),
                run_p5,
            ),
        ]
    modes = "online,hidden,sampled:64"
    run = gpu_overrides(gpus) + RUN_SHORT
    paths = "platform,platform_deepspeed,reference"
    head = "online,hidden"
    head_paths = "platform,reference"  # + platform_fp32 and every kernel, added by P7 itself
    paper = {"name": "P7-paper", "preset": "paper", "targets": "hidden", "paths": "platform,reference"}
    return [
        Part(
            "P7-paper",
            True,
            (
                measured("P7-paper", PAPER_FULL, 200, paper),
                measured("P7-paper", PAPER_SHORT, 120, {**paper, "levers": "compile", "warmup": 1, "steps": 3}),
            ),
            run_p7,
        ),
        Part(
            "P7-head",
            True,
            (
                measured(
                    "P7-head",
                    HEAD_FULL,
                    150,
                    {"name": "P7-head", "preset": "head", "targets": head, "paths": head_paths},
                ),
                measured(
                    "P7-head",
                    HEAD_SHORT,
                    90,  # a compilation and Liger's Triton JIT in it
                    {
                        "name": "P7-head",
                        "preset": "head",
                        "targets": "online",
                        "paths": head_paths,
                        "warmup": 1,
                        "steps": 3,
                    },
                ),
            ),
            run_p7,
        ),
        Part(
            "memory",
            True,
            (
                Variant("all cases, mid sizes", 300, {"flags": []}),  # --small took 125 s, twice its guess
                Variant("all cases, --small", 60, {"flags": ["--small"]}),
            ),
            run_memory,
        ),
        Part(
            "P5",
            False,
            (
                Variant("4 layers, 262,144 tokens", 150, {"layers": 4, "tokens": 262144, "seq_len": 2048}),
                Variant("2 layers, 65,536 tokens", 70, {"layers": 2, "tokens": 65536, "seq_len": 2048}),
            ),
            run_p5,
        ),
        Part(
            "P7",
            False,
            (
                measured(
                    "P7",
                    f"h100 preset, {modes}, 3 paths + kernels, 3 + 10 steps",
                    240,
                    {"preset": "h100", "targets": modes, "paths": paths},
                ),
                measured(
                    "P7",
                    f"h100 preset, {modes}, 3 paths + kernels, 2 + 5 steps",
                    190,
                    {"preset": "h100", "targets": modes, "warmup": 2, "steps": 5, "paths": paths},
                ),
                measured(
                    "P7",
                    "h100 preset, online,hidden, platform + plain loop, 2 + 5 steps (the kernels: P7-head's)",
                    110,
                    {
                        "preset": "h100",
                        "targets": "online,hidden",
                        "warmup": 2,
                        "steps": 5,
                        "paths": "platform,reference",
                        "kernels": "",
                    },
                ),
            ),
            run_p7,
        ),
        Part(
            "run",
            False,
            tuple(
                measured("run", f"tiny.yaml, {g}, hidden targets", est, {"overrides": run + grid})
                for (g, grid), est in zip(RUN_GRIDS.items(), (320, 200))
            ),
            run_whole,
        ),
        Part(
            "tokens",
            False,
            (
                Variant("50 MB corpus, loop + ray4", 100, {"mb": 50, "shard_mb": 25, "modes": ["loop", "ray4"]}),
                Variant("25 MB corpus, loop + ray4", 60, {"mb": 25, "shard_mb": 25, "modes": ["loop", "ray4"]}),
            ),
            run_tokens,
        ),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/m2d-gpu-acceptance")
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="the call's seconds (default 540: 9 minutes on one H100 after the bundle is installed)",
    )
    p.add_argument(
        "--parts", help="comma-separated subset of P7-head,P7,run,tokens,memory,P5 (default: all, as the budget allows)"
    )
    p.add_argument("--cpu-smoke", action="store_true", help="every part on the CPU with tiny shapes (plumbing check)")
    p.add_argument(
        "--plan-only",
        type=int,
        metavar="GPUS",
        help="print the GPU call's parts and their plan at --budget-s for GPUS devices as one JSON line; run nothing",
    )
    p.add_argument("--child-calibrate", dest="mode", choices=["whole", "streamed"])
    p.add_argument("--teacher")
    p.add_argument("--out")
    p.add_argument("--tokens", type=int)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--json-out", help=argparse.SUPPRESS)  # --child-calibrate's figures, for the P5 part
    a = p.parse_args(argv)
    if a.mode:
        child_calibrate(a)
        return 0
    if a.plan_only is not None:
        todo = parts(cuda=True, gpus=a.plan_only)
        choice, lines = plan(todo, a.budget_s - RESERVE_S)
        print(
            json.dumps({"parts": [asdict(x) | {"run": x.run.__name__} for x in todo], "choice": choice, "lines": lines})
        )
        return 0
    t0 = time.monotonic()
    import torch

    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        raise SystemExit(
            "gpu_acceptance: no CUDA device (torch.cuda.is_available() is False); use --cpu-smoke for the CPU plumbing "
            "check"
        )
    todo = parts(cuda, torch.cuda.device_count() if cuda else 0)
    if a.parts:
        names = a.parts.split(",")
        unknown = set(names) - {x.name for x in todo}
        if unknown:
            raise SystemExit(
                f"gpu_acceptance: unknown part(s) {', '.join(sorted(unknown))}; choose from "
                f"{', '.join(x.name for x in todo)}"
            )
        todo = [x for x in todo if x.name in names]
    elif a.cpu_smoke:  # the optional parts have tests of their own (test_plan_measured.py, test_calibrate.py)
        print("cpu smoke: the required parts; name memory and P5 in --parts to run them too", flush=True)
        todo = [x for x in todo if x.required]
    ctx = Ctx(Path(a.work), cuda, a.cpu_smoke, t0 + a.budget_s)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    (ctx.work / "measured_gpu.json").unlink(missing_ok=True)
    env = f"torch {torch.__version__}, " + (
        gpu_name() + f" x {torch.cuda.device_count()}" if cuda else "CPU smoke (tiny shapes)"
    )
    rows, results, bad = [], {"env": env, "budget_s": a.budget_s, "parts": {}}, False
    while todo:
        left = ctx.deadline - time.monotonic() - RESERVE_S
        choice, lines = plan(todo, left)
        print(f"== plan, {left:.0f} s left ==\n  " + "\n  ".join(lines), flush=True)
        part, todo = todo[0], todo[1:]
        if part.name not in choice:
            rows.append((part.name, "-", "-", "-", "skipped", lines[0].split(": ", 1)[1]))
            results["parts"][part.name] = {"status": "skipped", "why": lines[0]}
            continue
        v = part.variants[choice[part.name]]
        later = sum(x.variants[-1].est_s for x in todo if x.required and x.name in choice)
        ctx.timeout_s, ctx.started = max(1.0, left - later), time.monotonic()
        print(f"== {part.name}: {v.label} (estimate ~{v.est_s:.0f} s, timeout {ctx.timeout_s:.0f} s) ==", flush=True)
        try:
            res = part.run(ctx, v)
            status = f"FAILED: {res['failed']}" if res.get("failed") else "ok"
        except TimedOut as exc:
            res, status = {"rows": [(part.name, "-")]}, f"TIMED OUT: {exc}"
        except Exception as exc:  # a part's failure is recorded; the call goes on with the next
            res, status = {"rows": [(part.name, "-")]}, f"FAILED: {type(exc).__name__}: {str(exc).strip()[:300]}"
        secs = time.monotonic() - ctx.started
        bad |= status != "ok"
        results["parts"][part.name] = {
            "variant": v.label,
            "estimate_s": v.est_s,
            "seconds": round(secs, 1),
            "status": status,
            **{k: x for k, x in res.items() if k != "rows"},
        }
        for i, (name, fig) in enumerate(res["rows"]):
            rows.append(
                (name, v.label, f"{v.est_s:.0f}", f"{secs:.0f}", status, fig) if i == 0 else (name, "", "", "", "", fig)
            )
        print(f"[{part.name}] {status} in {secs:.0f} s", flush=True)
    total = time.monotonic() - t0
    table = [
        f"# GPU acceptance ({env}); {total:.0f} s of a {a.budget_s:.0f}-s budget; logs in {ctx.logs}",
        "",
        "| part | variant | planned s | s | status | figures |",
        "|---|---|---:|---:|---|---|",
    ]
    table += [f"| {' | '.join(map(str, r))} |" for r in rows]
    (ctx.work / "table.md").write_text("\n".join(table) + "\n")
    (ctx.work / "results.json").write_text(json.dumps({**results, "seconds": total}, indent=1, default=str))
    if cuda:  # the figures the code reads, in its own form: copy over m2d_ray/measured_gpu.json
        when = time.strftime("%Y-%m-%d")
        file = measured_file(results, gpu_name(), when)
        (ctx.work / "measured_gpu.json").write_text(json.dumps(file, indent=1) + "\n")
        print(f"measured: {ctx.work / 'measured_gpu.json'} (copy it over m2d_ray/measured_gpu.json)", flush=True)
    print("\n" + "\n".join(table), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
