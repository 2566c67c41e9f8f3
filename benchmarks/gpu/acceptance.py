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

Paths. A P7 part's paths run one at a time where the card cannot hold them together (the paper student's, the head's:
its plain loop's logits alone are ~56 GiB); a path whose planned peak (`m2d plan`'s rank for it) is over the card is
left out and said with that peak, never attempted; a checkpointing lever asked `@fit` whose rank fits only at a
smaller micro-batch runs at the largest that fits, and its row says which (SAC on an H100: 1 x 2048); a path that
fails (the plain loop included) is said in one line and the part keeps the others' figures. `--plan-only` prints
every path per card (H100 80 GB, H200 141 GB) with its planned peak and seconds.

Nothing is lost to a kill: WORK/table.md and WORK/results.json are rewritten after every part and, while a P7 part
runs, after every path it finishes; the call's own alarm at --budget-s + 20 s (under the device's limit) or a SIGTERM
ends the running part's process group and writes what finished (exit 3).

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
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workshop.measured_write import accelerator_of, measured_file, prior
from workshop.step_paths import lever_figures
from workshop.time_budget import RUNNING, Part, Share, TimedOut, Variant, kill_group, plan, run_logged

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
M2D = [PY, "-m", "m2d_ray.cli"]
RESERVE_S = 15.0  # the table, results and efficiency files after the last part
CALL_GRACE_S = 20.0  # past --budget-s by this much the call kills its part and stops (SIGALRM): under the device limit
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
    progress: object = None  # (log) -> None: rewrites results.json and table.md with what the running part has so far
    log: str = ""  # the running command's log name

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
        self.log = log
        poll = (lambda: self.progress(log)) if self.progress else None
        return run_logged(cmd, self.logs / log, Share(self.timeout_s, self.started), REPO, check, poll)


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
    cmd += [f"--{k.replace('_', '-')}={a[k]}" for k in keys if k in a]  # `=`: an empty value (kernels "") stays one
    cmd += ["--one-path-at-a-time"] if a.get("one_path_at_a_time") else []
    cmd += ["--no-fp32-spread"] if a.get("no_fp32_spread") else []
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
    rows = p7_rows(name, got)
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
            if m in ("online", "hidden")
            and name != "P7-paper"
            and r.get("kl_kernel")  # the paper part runs chunked (kernels: P7-head)
        },
        "attention": next((r["attention"] for r in modes.values() if r.get("attention")), None),
    }


def p7_rows(name: str, got: dict) -> list[tuple[str, str]]:
    """The table's rows of a P7 child's figures (its --json-out): per finished mode its figures and its levers'; the
    paths the plan left out (never attempted); the paths of a mode still running (or killed) that finished."""
    final = got.get("final")
    modes = final["targets"] if final else got.get("modes", {})
    rows = [(f"{name} {m}", p7_figures(r)) for m, r in modes.items()]
    rows += [(f"{name} {m} levers", lever_figures(r)) for m, r in modes.items() if lever_figures(r)]
    running = got.get("running")
    if running and running.get("mode") not in modes:
        done = ", ".join(f"{n} {t:,.0f} tok/s" for n, t in running.get("tokens_per_s", {}).items())
        failed = "".join(f"; {n} FAILED ({why})" for n, why in (running.get("paths_failed") or {}).items())
        rows.append((f"{name} {running['mode']} (unfinished)", f"paths finished: {done or 'none'}{failed}"))
    left = got.get("paths_left_out") or {}
    if left and not modes:
        rows.append((f"{name} left out", "; ".join(f"{n}: {why}" for n, why in left.items())))
    return rows


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
        f"{n.partition(':')[2] or 'compiled student'} {t:,.0f} tok/s (gap {r['gap'].get(n, math.nan):.1e}"
        + (f", step peak {r['peak_step_bytes'][n] / 2**30:.1f} GiB" if r.get("peak_step_bytes") else "")
        + ")"
        for n, t in r.get("tokens_per_s", {}).items()
        if n.startswith("platform:") or n == "platform_compiled"
    )
    agree = "" if r.get("losses_agree", True) else "; LOSS TRAJECTORIES DIFFER"
    agree += "".join(f"; {n} FAILED ({why})" for n, why in (r.get("kernels_failed") or {}).items())
    agree += "".join(
        f"; {n} left out ({why})" for n, why in (r.get("paths_left_out") or {}).items() if "lever" not in n
    )
    share = ""
    if r.get("head_kl_s"):
        share = f"head + KL {r['head_kl_s'] * 1e3:.1f} ms = {r['head_kl_share']:.0%} of the step; "
    spread = f" (admitted within bf16-mixed's spread vs fp32, {r['bf16_spread']:.1e})" if r.get("bf16_spread") else ""
    at = f"micro-batch {r['micro_batch']['platform']}: " if (r.get("micro_batch") or {}).get("platform") else ""
    return (
        f"{at}tok/s platform {tps('platform_tokens_per_s')}, DeepSpeed {tps('platform_deepspeed_tokens_per_s')}, "
        f"plain loop {tps('reference_tokens_per_s')}: ratio {ratio(r.get('ratio'))}, DeepSpeed "
        f"{ratio(r.get('deepspeed_ratio'))}; MFU {pct(r.get('mfu'))} of the measured matmul rate, "
        f"{pct(r.get('mfu_datasheet'))} of the data sheet (loop {pct(r.get('reference_mfu'))}, "
        f"{pct(r.get('reference_mfu_datasheet'))}); {share}"
        f"kernels: {kernels or 'chunked only'} -> auto: {r.get('kl_kernel') or '-'}{spread}{agree}"
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
# the paper part rehearsed: one path at a time, bf16-mixed, a checkpointing lever beside the platform and the loop,
# at a smaller micro-batch than theirs (1 x 32 of 2 x 64: an H100 runs selective at the micro-batch the plan fits)
P7_PAPER_SMOKE = {
    "name": "P7-paper",
    "preset": "smoke",
    "targets": "hidden",
    "paths": "platform,reference",
    "levers": "ckpt:selective@1x32",
    "one_path_at_a_time": True,
    "no_fp32_spread": True,
    "kernels": "",
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
    "one_path_at_a_time": True,
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


#: the paper part's levers: each checkpointing (the platform's own and those the plan says do not fit are left out by
#: P7 itself; selective, at the largest micro-batch its rank fits where the paper's 4 x 4096 does not: an H100's
#: 1 x 2048, its row says so) and the compiled layers
PAPER_LEVERS = "ckpt:none,ckpt:selective@fit,ckpt:full,compile"
#: the head part's paths one after the other: the plain loop's [tokens x vocabulary] logits alone peak at ~56 GiB
ONE_AT_A_TIME = {"one_path_at_a_time": True}
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
    # the paper part runs the platform's own kernel (chunked: `kernels` empty; P7-head chooses among kernels) and
    # the levers that change something the platform does not already run (its attention is SDPA's: no attn lever)
    paper = {
        "name": "P7-paper",
        "preset": "paper",
        "targets": "hidden",
        "paths": "platform,reference",
        "kernels": "",
        "levers": PAPER_LEVERS,
    }
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
                    {"name": "P7-head", "preset": "head", "targets": head, "paths": head_paths, **ONE_AT_A_TIME},
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
                        **ONE_AT_A_TIME,
                    },
                ),
            ),
            run_p7,
        ),
        Part(
            "memory",
            True,
            (
                measured("memory", "all cases, mid sizes", 300, {"flags": []}),
                measured("memory", "all cases, --small", 125, {"flags": ["--small"]}),  # what it took (guessed 60)
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
        print(json.dumps(plan_only(a.plan_only, a.budget_s)))
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
    ctx = Ctx(Path(a.work), cuda, a.cpu_smoke, t0 + a.budget_s)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    for name in ("measured_gpu.json", "results.json", "table.md"):
        (ctx.work / name).unlink(missing_ok=True)
    env = f"torch {torch.__version__}, " + (
        gpu_name() + f" x {torch.cuda.device_count()}" if cuda else "CPU smoke (tiny shapes)"
    )
    rows, results, bad = [], {"env": env, "budget_s": a.budget_s, "parts": {}}, False
    running: dict = {}  # the part running now: name, variant, and the rows of what it has so far

    def write_out(note: str = "") -> list[str]:
        """table.md and results.json as they stand (after every part, while one runs, and when the call is killed)."""
        total = time.monotonic() - t0
        now = list(rows)
        if running:
            now += [(n, running["variant"], "", "", "running", fig) for n, fig in running.get("rows", [])]
        table = [
            f"# GPU acceptance ({env}); {total:.0f} s of a {a.budget_s:.0f}-s budget{note}; logs in {ctx.logs}",
            "",
            "| part | variant | planned s | s | status | figures |",
            "|---|---|---:|---:|---|---|",
        ]
        table += [f"| {' | '.join(map(str, r))} |" for r in now]
        out = {**results, "seconds": total}
        if running:
            out["running"] = {k: v for k, v in running.items() if k not in ("rows", "p7")}
        (ctx.work / "table.md.tmp").write_text("\n".join(table) + "\n")
        (ctx.work / "results.json.tmp").write_text(json.dumps(out, indent=1, default=str))
        (ctx.work / "table.md.tmp").replace(ctx.work / "table.md")
        (ctx.work / "results.json.tmp").replace(ctx.work / "results.json")
        return table

    def progress(log: str) -> None:  # a P7 child's figures so far, path by path
        got = ctx.figures(log) if ctx.json_out(log).exists() else {}
        if got and running.get("p7"):
            running["rows"], running["figures"] = p7_rows(running["name"], got), got
            write_out()

    def killed(signum, frame) -> None:  # the call's own deadline (SIGALRM) or a kill from outside (SIGTERM)
        for proc in list(RUNNING):
            kill_group(proc)
        if running and ctx.log:
            progress(ctx.log)  # what the child wrote last
        if running:
            results["parts"][running["name"]] = {
                "variant": running["variant"],
                "status": f"KILLED ({signal.Signals(signum).name})",
                "partial": running.get("figures"),
            }
        write_out(f"; KILLED by {signal.Signals(signum).name}")
        print(f"gpu_acceptance: killed by {signal.Signals(signum).name}; figures so far in {ctx.work}", flush=True)
        os._exit(3)

    signal.signal(signal.SIGTERM, killed)
    signal.signal(signal.SIGALRM, killed)
    signal.alarm(int(a.budget_s + CALL_GRACE_S))  # the call's own timeout, under the device's limit
    ctx.progress = progress
    while todo:
        left = ctx.deadline - time.monotonic() - RESERVE_S
        choice, lines = plan(todo, left)
        print(f"== plan, {left:.0f} s left ==\n  " + "\n  ".join(lines), flush=True)
        part, todo = todo[0], todo[1:]
        if part.name not in choice:
            rows.append((part.name, "-", "-", "-", "skipped", lines[0].split(": ", 1)[1]))
            results["parts"][part.name] = {"status": "skipped", "why": lines[0]}
            write_out()
            continue
        v = part.variants[choice[part.name]]
        later = sum(x.variants[-1].est_s for x in todo if x.required and x.name in choice)
        ctx.timeout_s, ctx.started = max(1.0, left - later), time.monotonic()
        running.clear()
        running.update(name=part.name, variant=v.label, p7=part.run is run_p7)
        ctx.log = ""
        print(f"== {part.name}: {v.label} (estimate ~{v.est_s:.0f} s, timeout {ctx.timeout_s:.0f} s) ==", flush=True)
        try:
            res = part.run(ctx, v)
            status = f"FAILED: {res['failed']}" if res.get("failed") else "ok"
        except TimedOut as exc:
            res, status = {"rows": [(part.name, "-")]}, f"TIMED OUT: {exc}"
        except Exception as exc:  # a part's failure is recorded; the call goes on with the next
            res, status = {"rows": [(part.name, "-")]}, f"FAILED: {type(exc).__name__}: {str(exc).strip()[:300]}"
        if res["rows"] == [(part.name, "-")] and running.get("rows"):
            res["rows"] = running["rows"]  # a part killed for its time keeps the paths it finished
        running.clear()
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
        write_out()
    signal.alarm(0)
    table = write_out()
    if cuda:  # the figures the code reads, in its own form: copy over m2d_ray/measured_gpu.json
        when = time.strftime("%Y-%m-%d")
        file = measured_file(results, gpu_name(), when)
        (ctx.work / "measured_gpu.json").write_text(json.dumps(file, indent=1) + "\n")
        print(f"measured: {ctx.work / 'measured_gpu.json'} (copy it over m2d_ray/measured_gpu.json)", flush=True)
    print("\n" + "\n".join(table), flush=True)
    return 1 if bad else 0


#: the cards the call is planned for (`--plan-only`): name -> memory in bytes
CARDS = {"H100 80 GB": 80 * 10**9, "H200 141 GB": 141 * 10**9}


def plan_only(gpus: int, budget_s: float) -> dict:
    """The GPU call's plan without running anything, for each card: the parts and the variants the budget keeps, and
    for every P7 part each path it would run with its planned peak (the paper student's from `m2d plan`; the head's
    plain loop from its logits) and time (the variant's estimate shared among its paths), and each path left out
    (never attempted) with its planned peak; whether the whole call fits the budget and no path exceeds its card."""
    todo = parts(cuda=True, gpus=gpus)
    choice, lines = plan(todo, budget_s - RESERVE_S)
    cards = {}
    for card, memory in CARDS.items():
        per = {}
        for part in todo:
            if part.name not in choice or part.run is not run_p7:
                continue
            v = part.variants[choice[part.name]]
            per[part.name] = {"variant": v.label, **p7_path_plan(v.args, memory, v.est_s)}
        planned = sum(x.variants[choice[x.name]].est_s for x in todo if x.name in choice)
        over = [f"{p} {n}" for p, x in per.items() for n, b in x["paths"].items() if b["peak_bytes"] > memory]
        cards[card] = {
            "memory_bytes": memory,
            "parts": per,
            "planned_s": planned,
            "fits_budget": planned <= budget_s - RESERVE_S,
            "paths_over_card": over,
        }
        print(f"== {card}: {planned:.0f} s planned of {budget_s - RESERVE_S:.0f} s ==", file=sys.stderr)
        for p, x in per.items():
            for n, b in x["paths"].items():
                print(f"  {p} {n}: peak {b['peak_bytes'] / 2**30:.1f} GiB, ~{b['seconds']:.0f} s", file=sys.stderr)
            for n, why in x["left_out"].items():
                print(f"  {p} {n}: left out ({why})", file=sys.stderr)
    return {
        "parts": [asdict(x) | {"run": x.run.__name__} for x in todo],
        "choice": choice,
        "lines": lines,
        "cards": cards,
    }


def p7_path_plan(args: dict, memory: int, est_s: float) -> dict:
    """A P7 variant's paths on a card of `memory` bytes: the paths it would run (planned peak, seconds: the variant's
    estimate shared among them) and those left out with why. The paper preset's from `m2d plan` (distill_step's own
    planning); the head preset's plain loop from its whole logits (REFERENCE_LOGITS float32 [tokens x vocabulary]
    buffers), its other paths from the chunked KL's buffers and the 2-layer student's training state."""
    from workshop.random_models import STEP_PRESETS
    from workshop.step_paths import (
        REFERENCE_LOGITS,
        checkpointing_of,
        fitting_paths,
        path_peaks,
        planned_levers,
    )

    p = STEP_PRESETS[args["preset"]]
    names = [n for n in args.get("paths", "").split(",") if n]
    policy, plans = checkpointing_of(p, "cuda", memory)
    levers, skipped = planned_levers([lv for lv in args.get("levers", "").split(",") if lv], policy, plans)
    every = names + [f"lever:{lv}" for lv in levers]
    kernels = [k for k in args.get("kernels", "").split(",") if k] if "kernels" in args else ["liger"]
    if plans:
        peaks = path_peaks(every, plans, p, policy)
        kept, left = fitting_paths(every, peaks, plans)
    else:  # no plan of the head preset: its [tokens x vocabulary] buffers, which dominate it
        every += ["platform_fp32"] + [f"platform:{k}" for k in kernels]
        nv = p["batch"] * p["seq_len"] * p["vocab"] * 4
        student = 16 * (2 * p["vocab"] * p["hidden"] + 12 * p["layers"] * p["hidden"] ** 2)  # weights + Adam
        peaks = {
            n: int((REFERENCE_LOGITS * nv if n == "reference" else 2 * 1024 * p["vocab"] * 4) + student) for n in every
        }
        kept, left = [n for n in every if peaks[n] <= memory], {}
        left = {n: f"planned peak {peaks[n] / 2**30:.1f} GiB over the card" for n in every if n not in kept}
    modes = len([t for t in args.get("targets", "").split(",") if t])
    share = est_s / max(1, len(kept) * max(1, modes))
    paths = {n: {"peak_bytes": peaks[n], "seconds": share} for n in kept}
    return {"checkpointing": policy, "paths": paths, "left_out": {**skipped, **left}}


if __name__ == "__main__":
    sys.exit(main())
