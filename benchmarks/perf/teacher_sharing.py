"""P8 — the teacher once: N students on one token stream, online (the teacher beside every student) against
cached targets (one teacher pass, then students with no teacher weights).

    python -m benchmarks.perf.teacher_sharing [--E 64] [--steps 10] [--targets topk:64] [--work /tmp/m2d-p8]

Teacher: benchmarks/tools/make_teacher.py (random Qwen3-MoE shaped like a scaled-down Qwen3-30B-A3B: d 512,
expert width 256, k 4, 8 layers, fp32); student: its random-FFN baseline (the K = k student's shape).
Each measured piece runs in its own process on one thread (the targets pass, one online student, one
cached student), so its peak RSS is its own; the N-student figures are the targets pass plus N times a
student, the order in which this 2-core machine runs them. Teacher FLOPs are counted (distill/flops.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from benchmarks.common import REPO, machine_line, python_m

SEQ, BATCH = 128, 4


def vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(args) -> None:
    """One measured piece, in this process: `pass` (the targets) or a student (`online` / `cached`)."""
    import torch

    torch.set_num_threads(1)
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.loop import DistillJob, WorkerIO, run_distill
    from m2d_ray.distill.targets import parse_targets

    work, spec = Path(args.work), parse_targets(args.targets)
    base = vm("VmRSS")  # after the imports
    t0 = time.perf_counter()
    if args.piece == "pass":
        from m2d_ray.runtime.shards import targets_here

        targets_here(
            str(work / "teacher"), str(work / "tokens"), str(work / "targets"), spec, batch_size=BATCH, stream=False
        )
    else:
        cfg = DistillConfig(
            train_data="synthetic:train",
            steps=args.steps,
            lr=1e-3,
            warmup_steps=1,
            batch_size=BATCH,
            seq_len=SEQ,
            eval_every=args.steps,
            eval_max_tokens=1024,
            deepspeed=False,
        )
        cached = args.piece == "cached"
        job = DistillJob(
            str(work / "teacher"),
            str(work / "student"),
            cfg,
            "synthetic:valid",
            tokens=str(work / "tokens"),
            targets=str(work / "targets") if cached else None,
            target_spec=spec if cached else None,
        )
        run_distill(job, WorkerIO())
    peak = vm("VmHWM")  # this process's own peak (ru_maxrss would carry the parent's across exec)
    print(json.dumps({"wall_s": time.perf_counter() - t0, "peak_rss": peak, "import_rss": base}))


def run(piece: str, args) -> dict:
    cmd = [
        *python_m(__spec__.name),
        "--child",
        piece,
        "--work",
        args.work,
        "--steps",
        str(args.steps),
        "--targets",
        args.targets,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--targets", default="topk:64")
    ap.add_argument("--work", default="/tmp/m2d-p8")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        args.piece = args.child
        child(args)
        return
    import torch

    from benchmarks.tools.make_teacher import make_teacher
    from m2d_ray.commands.convert import convert_one
    from m2d_ray.distill.flops import active_params, attention_flops, matmul_params
    from m2d_ray.distill.targets import bytes_per_token, parse_targets, state_bytes
    from m2d_ray.distill.tokens import write_tokens
    from m2d_ray.models import load_tokenizer
    from m2d_ray.weights import open_teacher

    work = Path(args.work)
    teacher = make_teacher(work / "teacher", E=args.E)
    if not (work / "student" / "config.json").exists():
        convert_one(str(teacher), "sf", "rr", "uniform", None, work / "student", baseline="random-ffn")
    blocks = args.steps * BATCH
    if not (work / "tokens" / "manifest.json").exists():
        write_tokens(
            work / "tokens", load_tokenizer(str(teacher)), "synthetic:train", SEQ, blocks, "synthetic:valid", 1024
        )
    pas, online, cached = run("pass", args), run("online", args), run("cached", args)

    lazy = open_teacher(str(teacher))
    inactive = sum(p.numel() for p in lazy.skeleton.parameters()) - active_params(lazy.skeleton, lazy.adapter)
    teacher_flops = 2.0 * (matmul_params(lazy.skeleton) - inactive) + attention_flops(lazy.config, SEQ)  # per token
    tokens = blocks * SEQ
    teacher_bytes = sum(p.stat().st_size for p in Path(teacher).glob("*.safetensors"))
    stored = sum(p.stat().st_size for p in (work / "targets").glob("*.safetensors"))
    spec = parse_targets(args.targets)
    print(
        f"P8: teacher E {args.E} ({teacher_bytes / 2**20:,.0f} MiB fp32), {tokens:,} tokens per student ({args.steps} "
        f"steps x {BATCH} x {SEQ}), "
        f"{args.targets}; {machine_line()}; torch {torch.__version__}\n"
    )
    print(
        "| students N | teacher FLOPs / student, online | cached | ratio | wall, online (s) | cached (s) | cached / "
        "online |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (1, 4, 8):
        on, ca = n * online["wall_s"], pas["wall_s"] + n * cached["wall_s"]
        print(
            f"| {n} | {teacher_flops * tokens:.3g} | {teacher_flops * tokens / n:.3g} | 1/{n} | {on:,.1f} | {ca:,.1f} "
            f"| {ca / on:.2f} |"
        )

    def mib(b):
        return f"{b / 2**20:,.0f}"

    print("\n| process | wall (s) | peak RSS (MiB) | above its imports (MiB) |")
    print("|---|---:|---:|---:|")
    for name, r in (("targets pass (teacher)", pas), ("student, online", online), ("student, cached", cached)):
        print(f"| {name} | {r['wall_s']:.1f} | {mib(r['peak_rss'])} | {mib(r['peak_rss'] - r['import_rss'])} |")
    print(
        f"\nOnline student's peak RSS - cached student's: {mib(online['peak_rss'] - cached['peak_rss'])} MiB "
        f"(the teacher's weights: {mib(teacher_bytes)} MiB)."
    )
    print(
        f"Storage: {stored:,} bytes of targets for {tokens:,} tokens = {stored / tokens:.1f} B/token "
        f"(format: {bytes_per_token(spec, state_bytes(lazy.config.hidden_size, False))} B/token + one safetensors "
        "header per shard)."
    )


if __name__ == "__main__":
    main()
