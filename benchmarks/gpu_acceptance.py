"""GPU acceptance run (driven by benchmarks/gpu_acceptance.sh): the whole platform on a bf16 random-weight
teacher with Qwen3-30B-A3B's full layer shapes (d 2048, expert width 768, E 128, k 8; a few layers).

    stage          what runs                                                    measured
    teacher        benchmarks/make_teacher.py (bf16, sharded, per-expert keys)  seconds
    matmul         bf16 8192^3 products                                        the reference TFLOP/s (P5)
    calib-whole    calibrate() on the loaded teacher                            s, GPU peak, tokens/s, stats TFLOP/s
    calib-stream   calibrate() streamed layer by layer (compared with whole)    the same
    convert        m2d convert --stats (lazy teacher, export check)             s, GPU peak
    stage1         m2d sweep: Ray Data calibration on GPU actors, Tune trials on fractional GPUs
    distill        m2d distill: Ray Train, DeepSpeed ZeRO-2, bf16               s, GPU peak, tokens/s
    stage3         m2d eval --tasks local (lm-eval, offline)                    s, GPU peak
    distill-2gpu   m2d distill --workers 2 (one student on two GPUs, NCCL), when two GPUs are present
    run-1gpu       m2d run experiments/tiny.yaml (the demo, short budgets) on one GPU: fractional trials
    P7             benchmarks/p7_distill_throughput.py --preset h100, when that file exists

Statistics TFLOP/s counts what P1 counts (every expert on every token, 2*T*E*3*I*d, plus the Gram
2*E^2*T*d, per MoE layer) over the wall time of the whole collection (the model's own forward
included, so it is a lower bound); target (P5): >= 60% of the bf16 matmul rate measured here.
GPU peak = the most `nvidia-smi` memory.used seen during the stage, minus what was used before it.

`--cpu-smoke` runs every stage on the CPU with tiny shapes (no GPU numbers): a check of the plumbing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable
FULL = dict(d=2048, I=768, E=128, k=8, heads=32, kv_heads=4, head_dim=128, dtype="bfloat16")
TINY = dict(d=64, I=32, E=16, k=2, heads=4, kv_heads=2, head_dim=16, dtype="float32")


class GpuPeak:
    """Most GPU memory in use (MiB, all processes) while the block runs, minus the level before it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.peak, self._stop = enabled and shutil.which("nvidia-smi") is not None, 0, threading.Event()

    @staticmethod
    def used() -> int:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True)
        return sum(int(x) for x in out.stdout.split() if x.strip().isdigit())

    def __enter__(self):
        if self.enabled:
            self.base = self.peak = self.used()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self.used())

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.used()) - self.base

    def mib(self) -> str:
        return f"{self.peak / 1024:.1f} GiB" if self.enabled else "-"


def sh(cmd: list[str], log: Path) -> str:
    """Run a command, its output teed into `log`; the last line that parses as JSON is returned."""
    print("$ " + " ".join(map(str, cmd)), flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=f, text=True, cwd=REPO)
    f_out = proc.stdout
    Path(str(log) + ".out").write_text(f_out)
    if proc.returncode:
        tail = Path(log).read_text()[-4000:]
        raise SystemExit(f"gpu_acceptance: `{' '.join(map(str, cmd[:3]))} ...` failed (exit {proc.returncode}); log {log}:\n{tail}")
    return next((ln for ln in reversed(f_out.splitlines()) if ln.startswith("{")), "{}")


# ---- calibration timed in-process (P5) ----------------------------------------------------------
def child_calibrate(a) -> None:
    import torch

    from m2d_ray.calibrate import calibrate
    from m2d_ray.models import load_teacher
    from m2d_ray.calibrate.tokens import calibration_tokens
    from m2d_ray.weights import open_teacher

    device = "cuda" if torch.cuda.is_available() else "cpu"
    streamed = a.mode == "streamed"
    teacher = open_teacher(a.teacher, device=device) if streamed else load_teacher(a.teacher, device=device)
    spec, tokens = calibration_tokens(teacher.tokenizer, "synthetic:valid", a.teacher, a.seq_len, a.tokens)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    art, _ = calibrate(teacher, tokens, spec, out=a.out, batch_size=a.batch_size, device=device, stream=streamed, progress=False)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    cfg, adapter = teacher.config, teacher.adapter
    E, T, d, L = adapter.num_experts(cfg), tokens.n_tokens, cfg.hidden_size, len(art.layers)
    I = cfg.moe_intermediate_size
    flops = L * (2.0 * T * E * 3 * I * d + 2.0 * E * E * T * d)
    print(json.dumps({"seconds": seconds, "tokens": T, "tflops": flops / seconds / 1e12, "sha256": art.checksum,
                      "torch_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}), flush=True)


def matmul_tflops(cuda: bool) -> float:
    sys.path.insert(0, str(HERE))
    import torch
    from _common import matmul_gflops

    return matmul_gflops(8192, torch.bfloat16, "cuda", iters=20) / 1e3 if cuda else matmul_gflops(1024, torch.float32, "cpu") / 1e3


def stats_agree(a: Path, b: Path) -> float:
    """Largest relative difference of any statistic between two artifacts."""
    from m2d_ray.arch.base import rel_error
    from m2d_ray.calibrate.artifact import load_stats

    x, y = load_stats(a).layers, load_stats(b).layers
    return max(rel_error(v, y[i].to_tensors("")[n]) for i in x for n, v in x[i].to_tensors("").items())


def sweep_config(path: Path, teacher: Path, cuda: bool, tokens: int) -> None:
    gpu = {"data_gpus_per_actor": 0.5, "gpus_per_trial": 0.25, "max_concurrent_trials": 4, "num_cpus": 16} if cuda else {}
    cfg = {
        "name": "gpu-acceptance", "model": str(teacher),
        "calib": {"data": "synthetic:valid", "max_tokens": tokens, "seq_len": 512, "batch_size": 8},
        "eval": {"data": "synthetic:test", "max_chars": 100_000, "seq_len": 512, "batch_size": 8, "chunks": 2},
        "grid": {"scoring": ["sf", "do-acp"], "grouping": ["rr", "oc"], "scaling": ["uniform"], "K": "auto"},
        "ray": {"data_actors": 2, "threads_per_worker": 1, **gpu},
        "mlflow": {"experiment": "m2d-gpu-acceptance"},
    }
    import yaml

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/m2d-gpu-acceptance")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--calib-tokens", type=int, default=262144, help="calibration tokens of the P5 runs")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6, help="distillation steps")
    p.add_argument("--cpu-smoke", action="store_true", help="every stage on the CPU with tiny shapes (plumbing check)")
    p.add_argument("--child-calibrate", dest="mode", choices=["whole", "streamed"])
    p.add_argument("--teacher")
    p.add_argument("--out")
    p.add_argument("--tokens", type=int)
    p.add_argument("--batch-size", type=int, default=8)
    a = p.parse_args(argv)
    if a.mode:
        return child_calibrate(a)
    import torch

    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        raise SystemExit("gpu_acceptance: no CUDA device (torch.cuda.is_available() is False); use --cpu-smoke for the CPU plumbing check")
    shape = FULL if cuda else TINY
    if a.cpu_smoke:
        a.layers, a.calib_tokens, a.seq_len, a.steps = 2, 4096, 256, 2
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    env_note = f"torch {torch.__version__}, " + (torch.cuda.get_device_name(0) if cuda else "CPU smoke (tiny shapes)")
    rows: list[tuple] = []

    def stage(name: str, fn, tokens_per_s=None) -> dict:
        t = time.perf_counter()
        with GpuPeak(cuda) as peak:
            out = fn()
        secs = time.perf_counter() - t
        tps = tokens_per_s(out, secs) if tokens_per_s else None
        rows.append((name, secs, peak.mib(), f"{tps:,.0f}" if tps else "-", out.get("note", "")))
        print(f"[{name}] {secs:.1f} s, GPU peak {peak.mib()}", flush=True)
        return out

    teacher = work / "teacher"
    stage("teacher", lambda: json.loads(sh([PY, HERE / "make_teacher.py", "--out", teacher, "--layers", a.layers, "--E", shape["E"],
                                            "--k", shape["k"], "--d", shape["d"], "--I", shape["I"], "--heads", shape["heads"],
                                            "--kv-heads", shape["kv_heads"], "--head-dim", shape["head_dim"], "--dtype", shape["dtype"]],
                                           logs / "teacher.log")) | {"note": f"{a.layers} layers, {shape}"})
    mm = matmul_tflops(cuda)
    rows.append(("matmul", 0.0, "-", "-", f"{'bf16 8192^3' if cuda else 'fp32 1024^3 (CPU)'}: {mm:,.1f} TFLOP/s"))
    calib = {}
    for mode in ("whole", "streamed"):
        out = work / f"stats-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        res = stage(f"calib-{mode}", lambda out=out, mode=mode: json.loads(sh(
            [PY, HERE / "gpu_acceptance.py", "--child-calibrate", mode, "--teacher", teacher, "--out", out, "--tokens", a.calib_tokens,
             "--seq-len", a.seq_len], logs / f"calib-{mode}.log")), lambda r, s: r["tokens"] / r["seconds"])
        res["note"] = f"stats {res['tflops']:.1f} TFLOP/s = {res['tflops'] / mm:.0%} of matmul (P5 target >= 60%)"
        rows[-1] = rows[-1][:4] + (res["note"],)
        calib[mode] = res
    diff = stats_agree(work / "stats-whole", work / "stats-streamed")
    rows.append(("calib check", 0.0, "-", "-", f"streamed vs whole: max rel diff {diff:.1e}; streamed/whole time "
                 f"{calib['streamed']['seconds'] / calib['whole']['seconds']:.2f}x"))
    m2d = [PY, "-m", "m2d_ray.cli"]
    student = work / "student"
    shutil.rmtree(student, ignore_errors=True)
    stage("convert", lambda: json.loads(sh(m2d + ["convert", "--model", teacher, "--stats", work / "stats-whole", "--K", shape["k"],
                                                  "--out", student], logs / "convert.log")) | {"note": "K = k, do-acp/rr, export check"})
    cfg = work / "sweep.yaml"
    sweep_config(cfg, teacher, cuda, min(a.calib_tokens, 65536))
    run_dir = work / "stage1"
    shutil.rmtree(run_dir, ignore_errors=True)

    def stage1() -> dict:
        res = json.loads(sh(m2d + ["sweep", cfg, "--out", run_dir], logs / "stage1.log"))
        tokens = sum(json.loads(f.read_text()).get("tokens") or 0 for f in (run_dir / "trials").glob("*.json")
                     if not json.loads(f.read_text()).get("duplicate_of"))
        return res | {"eval_tokens": tokens, "note": f"{res['configs']} configs, {res['full_evaluations']} full evaluations, {res['status']}"}

    stage("stage1", stage1, lambda r, s: r["eval_tokens"] / s)
    dist = work / "distill"
    shutil.rmtree(dist, ignore_errors=True)
    gpu_kw = ["gpus_per_worker=1", f"seq_len={a.seq_len}", "batch_size=8"] if cuda else ["seq_len=128", "batch_size=4", "threads_per_worker=1"]
    gpu_kw.append("epochs=8")  # the embedded train split (38k tokens) read up to 8 times: a shorter corpus is refused
    stage("distill", lambda: json.loads(sh(m2d + ["distill", "--teacher", teacher, "--student", student, "--train-data", "synthetic:train",
                                                  "--eval-data", "synthetic:valid", "--steps", a.steps, "--workers", 1, "--deepspeed",
                                                  "--out", dist, f"eval_every={a.steps}", "eval_max_tokens=16384", *gpu_kw],
                                                 logs / "distill.log")) | {"note": "DeepSpeed ZeRO-2, " + ("bf16" if cuda else "fp32 (CPU)")},
          lambda r, s: r["tokens_per_s"])
    stage("stage3", lambda: json.loads(sh(m2d + ["eval", "--model", dist / "student", "--tasks", "local", "--limit", 100,
                                                 "--device", "cuda" if cuda else "cpu"], logs / "stage3.log")) | {"note": "lm-eval, local task"})
    # ---- issue 17: one student on two GPUs (collectives on CUDA tensors), the whole run on one GPU -----------
    if cuda and torch.cuda.device_count() >= 2:
        dist2 = work / "distill-2gpu"
        shutil.rmtree(dist2, ignore_errors=True)
        stage("distill-2gpu", lambda: json.loads(sh(m2d + ["distill", "--teacher", teacher, "--student", student, "--train-data",
                                                           "synthetic:train", "--eval-data", "synthetic:valid", "--steps", a.steps,
                                                           "--workers", 2, "--deepspeed", "--out", dist2, f"eval_every={a.steps}",
                                                           "eval_max_tokens=16384", *gpu_kw], logs / "distill-2gpu.log"))
              | {"note": "2 Ray Train workers x 1 GPU, DeepSpeed ZeRO-2, NCCL"}, lambda r, s: r["tokens_per_s"])
    elif cuda:
        rows.append(("distill-2gpu", 0.0, "-", "-", f"skipped: {torch.cuda.device_count()} GPU (needs 2)"))
    run = work / "run-1gpu"
    shutil.rmtree(run, ignore_errors=True)
    short = ["calib.max_tokens=8192", "grid.K=[2,4]", "distill.steps=20", "distill.eval_every=10", "stage3.limit=100"]
    if not cuda:  # the smoke: a few students
        short += ["grid.scoring=[sf,do-acp]", "grid.grouping=[rr]", "grid.scaling=[uniform]", "stage2.baselines=[random-init]"]
    stage("run-1gpu" if cuda else "run-cpu", lambda: json.loads(sh(m2d + ["run", REPO / "experiments" / "tiny.yaml", "--out", run, *short],
                                                                    logs / "run.log")) | {"note": "m2d run, the demo config, short budgets"})
    # ---- P7 (issue 17: stage-2 throughput): run when benchmarks/p7_distill_throughput.py exists -------------
    p7 = HERE / "p7_distill_throughput.py"
    if p7.exists() and cuda:
        res = stage("P7", lambda: json.loads(sh([PY, p7, "--preset", "h100"], logs / "p7.log").strip().splitlines()[-1]))
        _efficiency(res, work)
    elif p7.exists():
        rows.append(("P7", 0.0, "-", "-", "skipped on CPU (--preset h100 needs the GPU)"))
    print(f"\n# GPU acceptance ({env_note}); logs in {logs}\n")
    print("| stage | seconds | peak GPU memory | tokens/s | notes |\n|---|---|---|---|---|")
    for name, secs, peak, tps, note in rows:
        print(f"| {name} | {secs:.1f} | {peak} | {tps} | {note} |")
    if cuda and calib["whole"]["tflops"] / mm < 0.6:
        print(f"P5: calibration at {calib['whole']['tflops'] / mm:.0%} of the bf16 matmul rate: MISSED (target >= 60%)")


def _efficiency(p7: dict, work: Path) -> None:
    """The MFU the platform's stage-2 step reached against the GPU's data-sheet peak (accelerators.GPU_PEAK_BF16):
    what `plan.efficiency` (m2d plan's time and dollars) defaults to once a GPU has measured it. Written to
    WORK/efficiency.json and printed."""
    from m2d_ray.accelerators import GPU_PEAK_BF16

    name = next((k for k in sorted(GPU_PEAK_BF16, key=len, reverse=True) if k in p7["device"]), None)
    tps = max(filter(None, (p7.get("platform_tokens_per_s"), p7.get("platform_deepspeed_tokens_per_s"))), default=None)
    if name is None or tps is None:
        print(f"plan.efficiency: not measured ({p7['device']} has no data-sheet peak in accelerators.GPU_PEAK_BF16)")
        return
    eff = tps * p7["flops_per_token"] / GPU_PEAK_BF16[name]
    out = {"device": p7["device"], "accelerator": name, "tokens_per_s": tps, "flops_per_token": p7["flops_per_token"],
           "peak_flops": GPU_PEAK_BF16[name], "efficiency": eff, "mfu_vs_measured_matmul": p7.get("mfu")}
    (work / "efficiency.json").write_text(json.dumps(out, indent=1))
    print(f"plan.efficiency measured on {name}: {eff:.3f} (P7's step against the data-sheet peak; {work / 'efficiency.json'}): "
          "the default of PlanConfig.efficiency in m2d_ray/config.py")


if __name__ == "__main__":
    main()
