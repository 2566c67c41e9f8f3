"""Quality guard of cached teacher targets: the same student, data and budget distilled from the online
teacher and from its cached top-K / sampled targets; final validation perplexity of each against online.

    python -m benchmarks.science.cached_targets --teacher embedded [--steps 100] [--modes online topk:16 topk:64
        sampled:16
    sampled:64]
    python -m benchmarks.science.cached_targets --teacher wiki4          (../shared/teachers/qwen3moe-wiki4, WikiText-2)

The student is the DO-ACP K = k conversion of the teacher (the paper's best recipe). Tokens are written once
(distill/tokens.py), the targets by the targets pass's actor (runtime/shards.TargetsActor, here without
Ray), and every student runs the plain loop (distill/loop.run_distill) on one thread; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import TEACHER_DIR, WIKI_TEST, WIKI_VALID, machine_line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", choices=("embedded", "wiki4"), default="embedded")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["online", "topk:16", "topk:64", "sampled:16", "sampled:64"])
    args = ap.parse_args()
    torch.set_num_threads(1)

    from m2d_ray.commands.convert import convert_one
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.loop import DistillJob, WorkerIO, run_distill
    from m2d_ray.distill.targets import bytes_per_token, parse_targets, state_bytes
    from m2d_ray.distill.tokens import write_tokens
    from m2d_ray.models import default_teacher, load_tokenizer, model_config
    from m2d_ray.runtime.shards import targets_here

    if args.teacher == "wiki4":
        teacher, train, valid, calib = str(TEACHER_DIR), str(WIKI_VALID), str(WIKI_TEST), str(WIKI_VALID)
    else:
        teacher, train, valid, calib = default_teacher(), "synthetic:train", "synthetic:valid", "synthetic:valid"
    cfg = DistillConfig(
        train_data=train,
        steps=args.steps,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=5,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        eval_every=max(1, args.steps // 4),
        eval_max_tokens=16384,
        deepspeed=False,
    )
    blocks = cfg.steps * cfg.batch_size
    work = Path(tempfile.mkdtemp(prefix="m2d-s3-"))
    student = work / "student"
    convert_one(
        teacher,
        "do-acp",
        "rr",
        "uniform",
        None,
        student,
        calib_data=calib,
        calib_kwargs={"max_tokens": 16384, "seq_len": 128},
    )
    t0 = time.perf_counter()
    write_tokens(work / "tokens", load_tokenizer(teacher), train, cfg.seq_len, blocks, valid, cfg.eval_max_tokens)
    tok_s = time.perf_counter() - t0
    rows = []
    for mode in args.modes:
        spec = parse_targets(mode)
        targets, pass_s = None, 0.0
        if spec is not None:
            targets = work / f"targets-{mode.replace(':', '-')}"
            t0 = time.perf_counter()
            targets_here(teacher, str(work / "tokens"), str(targets), spec)
            pass_s = time.perf_counter() - t0
        reports = []
        t0 = time.perf_counter()
        job = DistillJob(
            teacher,
            str(student),
            cfg,
            valid,
            tokens=str(work / "tokens"),
            targets=str(targets) if targets else None,
            target_spec=spec,
        )
        run_distill(job, WorkerIO(report=lambda m, ckpt: reports.append(m)))
        rows.append(
            {
                "mode": mode,
                "ppl": reports[-1]["val_ppl"],
                "initial": reports[-1]["val_ppl_initial"],
                "train_s": time.perf_counter() - t0,
                "pass_s": pass_s,
                "bytes": bytes_per_token(spec, state_bytes(model_config(teacher).hidden_size, False)) if spec else None,
                "rss": reports[-1]["peak_rss_bytes"],
            }
        )
        print(f"{mode}: final val ppl {rows[-1]['ppl']:.3f} ({rows[-1]['train_s']:.0f} s)", flush=True)
    base = next((r["ppl"] for r in rows if r["mode"] == "online"), None)
    print(
        f"\n{args.teacher} teacher, DO-ACP K=k student, {args.steps} steps x {args.batch_size} x {args.seq_len} tokens "
        f"({blocks * args.seq_len:,} tokens), validation {Path(valid).name}; tokenised once in {tok_s:.1f} s; "
        f"{machine_line()}\n"
    )
    print("| targets | B/token | targets pass (s) | student (s) | val ppl at start | final val ppl | vs online |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rel = f"{(r['ppl'] / base - 1) * 100:+.2f}%" if base else ""
        print(
            f"| {r['mode']} | {r['bytes'] or ''} | {r['pass_s']:.1f} | {r['train_s']:.1f} | {r['initial']:.3f} | "
            f"{r['ppl']:.3f} | {rel} |"
        )


if __name__ == "__main__":
    main()
