"""P3: chunked vs naive forward KL at Qwen3's vocabulary (151,936): peak extra memory and time.

Each measurement runs in a fresh process: inputs are allocated (student/teacher hidden states [T, d],
output projections [V, d]), the peak RSS is recorded, then one forward + backward of the loss runs and
the growth of the peak RSS is the loss's extra memory. Naive = whole [T, V] float32 logits through
log_softmax + kl_div (what `F.kl_div` on model logits does); chunked = m2d_ray.distill.losses.chunked_kl.

    python -m benchmarks.perf.chunked_kl [--d 128] [--tokens 1024 2048 4096] [--chunk 1024] [--distill-steps 30]

Then distillation throughput on CPU for the embedded tiny teacher (DO-ACP student, plain-torch loop,
8 x 256-token sequences per step), the figure Ray Train / DeepSpeed add their overhead to.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import time

from benchmarks.common import python_m

V = 151_936


def measure(kind: str, T: int, d: int, chunk: int, threads: int) -> dict:
    import torch

    from m2d_ray.distill.losses import chunked_kl, naive_kl

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    h_s = torch.randn(T, d, generator=g).requires_grad_()
    w_s = (torch.randn(V, d, generator=g) * 0.05).requires_grad_()
    h_t, w_t = torch.randn(T, d, generator=g), torch.randn(V, d, generator=g) * 0.05
    w_s.grad = torch.zeros_like(w_s)  # the parameter's gradient buffer exists in training either way
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if kind == "naive":
        with torch.no_grad():
            zt = h_t @ w_t.T
        loss = naive_kl(h_s @ w_s.T, zt)
    else:
        loss = chunked_kl(h_s, w_s, h_t, w_t, chunk=chunk)
    loss.backward()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"kind": kind, "T": T, "loss": float(loss), "extra_mib": (peak - base) / 1024, "s": dt}


def distill_throughput(steps: int, threads: int) -> dict:
    import tempfile

    import torch

    from m2d_ray.commands.convert import convert_one
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.loop import DistillJob, WorkerIO, run_distill
    from m2d_ray.models import default_teacher

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        convert_one(None, "do-acp", "rr", "uniform", None, f"{tmp}/s", calib_kwargs={"max_tokens": 8192})
        cfg = DistillConfig(
            train_data="synthetic:train",
            steps=steps,
            lr=3e-3,
            warmup_steps=2,
            batch_size=8,
            seq_len=256,
            eval_every=steps,
            eval_max_tokens=2048,
            deepspeed=False,
        )
        return run_distill(DistillJob(default_teacher(), f"{tmp}/s", cfg, "synthetic:valid"), WorkerIO())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--distill-steps", type=int, default=30)
    ap.add_argument("--one", nargs=2, metavar=("KIND", "T"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one[0], int(a.one[1]), a.d, a.chunk, a.threads)))
        return
    print(
        f"vocab {V:,}, hidden {a.d}, chunk {a.chunk} tokens, {a.threads} threads; forward + backward, fresh process "
        "each"
    )
    print(
        "| tokens | naive extra MiB | chunked extra MiB | memory ratio | naive s | chunked s | speed ratio | |loss "
        "diff| |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T in a.tokens:
        r = {}
        for kind in ("naive", "chunked"):
            cmd = [
                *python_m(__spec__.name),
                "--one",
                kind,
                str(T),
                "--d",
                str(a.d),
                "--chunk",
                str(a.chunk),
                "--threads",
                str(a.threads),
            ]
            p = subprocess.run(cmd, capture_output=True, text=True)
            r[kind] = json.loads(p.stdout) if p.returncode == 0 else None
        n, c = r["naive"], r["chunked"]
        if n is None:
            print(f"| {T:,} | out of memory | {c['extra_mib']:,.0f} | | | {c['s']:.2f} | | |")
            continue
        print(
            f"| {T:,} | {n['extra_mib']:,.0f} | {c['extra_mib']:,.0f} | {n['extra_mib'] / max(c['extra_mib'], 1):.1f}x "
            "less | "
            f"{n['s']:.2f} | {c['s']:.2f} | {n['s'] / c['s']:.2f}x | {abs(n['loss'] - c['loss']):.1e} |"
        )
    if a.distill_steps:
        m = distill_throughput(a.distill_steps, a.threads)
        print(
            f"\ndistillation, embedded teacher (vocab 880, 4 layers, d 64), {a.threads} threads: "
            f"{m['tokens_per_s']:,.0f} tokens/s "
            f"over {m['tokens']:,} tokens (training time only); val ppl {m['val_ppl_initial']:.1f} -> "
            f"{m['val_ppl']:.1f}"
        )


if __name__ == "__main__":
    main()
