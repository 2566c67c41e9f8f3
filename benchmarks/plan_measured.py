"""The memory plan against measurement: `m2d plan`'s per-device estimate of a stage vs the peak it reaches.

Each case runs in a fresh process that builds (or loads) the models the way the stage's code does; the
measured figure is the peak growth of its anonymous resident memory from after the imports to the end, read
from the kernel's own high-water mark so that no peak is missed however busy the machine is: VmHWM (reset
when the case starts) minus the resident set then, minus the growth of its file-mapped and shared pages
(RssFile, RssShmem) by the end. Anonymous memory, not VmRSS: transformers maps a checkpoint's file while it
loads it, and those clean file pages are page cache the kernel drops under pressure (they would count the
weights twice on CPU). A 2 ms sampler of RssAnon runs alongside as a check of that accounting ("sampled": it
may miss a peak on a busy machine, but never sees more than the high-water mark). The estimate is
`m2d_ray.plan.memory`'s, on CPU (fp32).

    train     one student's DistillStep (plain torch, one rank): online teacher, cached topk:64 targets (with and
              without gradient checkpointing) or cached hidden states with the teacher's head read alone
    calibrate collect_stats of a Qwen3-MoE teacher loaded by models.load_teacher
    eval      lm-eval's HFLM on loglikelihood requests longer than max_length (every sequence is full)

    python benchmarks/plan_measured.py [--small] [--device cuda] [--repeat N] [--cases 1,2,4,6]
        --small: the sizes tests/unit/test_plan_measured.py uses; --device cuda (benchmarks/gpu_acceptance.sh): bf16
        on the GPU, measured = torch.cuda.max_memory_allocated above the allocations before the case, against the
        plan's GPU arithmetic without its CUDA-context reserve (allocations do not include the context)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (hidden, layers, ffn, vocab): a mid-size student / teacher on this 2-core machine, and a small one for the test
SIZES = {"mid": (512, 8, 1536, 32000), "small": (256, 4, 768, 16000)}
CASES = [
    ("train", {"targets": "online", "ckpt": False, "batch": 4, "seq": 512}),
    ("train", {"targets": "online", "ckpt": True, "batch": 8, "seq": 512}),
    ("train", {"targets": "topk:64", "ckpt": False, "batch": 4, "seq": 512}),
    ("train", {"targets": "topk:64", "ckpt": True, "batch": 16, "seq": 256}),
    ("calibrate", {"experts": 32, "batch": 4, "seq": 512}),
    ("calibrate", {"experts": 128, "batch": 2, "seq": 1024}),
    ("eval", {"batch": 8, "seq": 512}),
    ("eval", {"batch": 32, "seq": 256}),
    ("train", {"targets": "hidden", "ckpt": False, "batch": 4, "seq": 512}),
]


class CudaPeak:
    """AnonPeak's interface for the GPU: the peak of torch's allocations above those at start."""

    def __init__(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()

    def stop(self) -> int:
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base


class AnonPeak:
    """The peak of this process's anonymous resident memory above its value at start: the kernel's VmHWM
    (reset here) less the file-mapped and shared pages the process gained by the end, and a 2 ms sampler of
    RssAnon beside it (`sampled`, the check that the file pages were accounted for, not a figure to use)."""

    FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")

    def __init__(self, every: float = 0.002) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the resident set now (Linux >= 4.0)
        self.start = self.read()
        self.sampled = self.start["RssAnon"]
        self.every, self.done = every, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @classmethod
    def read(cls) -> dict[str, int]:
        from m2d_ray.peaks import proc_kib

        out = {k: proc_kib("/proc/self/status", k) for k in cls.FIELDS}
        if None in out.values():
            raise RuntimeError(f"no {', '.join(k for k, v in out.items() if v is None)} in /proc/self/status (Linux only)")
        return out

    def _run(self) -> None:
        while not self.done:
            self.sampled = max(self.sampled, self.read()["RssAnon"])
            time.sleep(self.every)

    def stop(self) -> int:
        self.done = True
        self.thread.join()
        a, b = self.start, self.read()
        self.sampled = max(self.sampled, b["RssAnon"]) - a["RssAnon"]
        return b["VmHWM"] - a["VmRSS"] - (b["RssFile"] - a["RssFile"]) - (b["RssShmem"] - a["RssShmem"])


def _configs(size: str, experts: int = 32):
    from transformers import Qwen3Config, Qwen3MoeConfig

    h, n, f, v = SIZES[size]
    common = dict(vocab_size=v, hidden_size=h, num_hidden_layers=n, num_attention_heads=h // 64, num_key_value_heads=max(1, h // 128),
                  head_dim=64, tie_word_embeddings=False, dtype="float32")
    return (Qwen3Config(intermediate_size=f, **common),
            Qwen3MoeConfig(intermediate_size=f, moe_intermediate_size=f // 8, num_experts=experts, num_experts_per_tok=8, **common))


def _save(config, path: Path) -> str:
    """A random-weight model with the embedded teacher's tokenizer (its ids fit any vocabulary here)."""
    import torch
    from transformers import AutoModelForCausalLM

    from m2d_ray.models import default_teacher, load_tokenizer

    if not (path / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        load_tokenizer(default_teacher()).save_pretrained(path)
    return str(path)


def child(case: str, size: str, kw: dict, work: Path, device: str = "cpu") -> dict:
    """Build the case's models on disk (unmeasured), then load and run them as the stage does."""
    import torch

    torch.set_num_threads(1)
    gpu = device == "cuda"
    dtype, b, Peak = (torch.bfloat16, 2, CudaPeak) if gpu else (torch.float32, 4, AnonPeak)
    from m2d_ray.plan import memory
    from m2d_ray.plan.shapes import shape_of

    dense, moe = _configs(size, kw.get("experts", 32))
    student = _save(dense, work / f"dense-{size}")
    teacher = _save(moe, work / f"moe{kw.get('experts', 32)}-{size}")
    if case == "train":
        from transformers import AutoModelForCausalLM

        from m2d_ray.distill.config import DistillConfig
        from m2d_ray.distill.step import DistillStep
        from m2d_ray.distill.targets import bytes_per_token, parse_targets, state_bytes
        from m2d_ray.models import load_distill_teacher
        from m2d_ray.weights import read_output_head

        B, L, online = kw["batch"], kw["seq"], kw["targets"] == "online"
        spec = None if online else parse_targets(kw["targets"])
        cfg = DistillConfig(deepspeed=False, batch_size=B, seq_len=L, gradient_checkpointing=kw["ckpt"])
        V, d = dense.vocab_size, moe.hidden_size
        ids = lambda: torch.randint(0, V, (B, L), device=device)  # noqa: E731
        if online:
            batch = ids
        elif spec.exact:
            batch = lambda: {"tokens": ids(), "hidden": torch.randn(B, L, d, dtype=dtype, device=device)}  # noqa: E731
        else:
            batch = lambda: {"tokens": ids(), "ids": torch.randint(0, V, (B, L, spec.k), dtype=torch.int32, device=device),  # noqa: E731
                             "logp": torch.log_softmax(torch.randn(B, L, spec.k, device=device), -1).half(), "tail": torch.full((B, L), -5.0, device=device)}
        peak = Peak()
        t = load_distill_teacher(teacher, dtype=dtype, device=device).model if online else None
        head = read_output_head(teacher, dtype).to(device) if spec is not None and spec.exact else None
        s = AutoModelForCausalLM.from_pretrained(student, dtype=dtype).to(device).train()
        if kw["ckpt"]:
            s.gradient_checkpointing_enable()
        s.config.use_cache = False
        step = DistillStep(s, t, cfg, device, 1, dtype, spec, head)
        for _ in range(2):
            step.step([batch()])
        measured = peak.stop()
        per_token = bytes_per_token(spec, state_bytes(d, gpu)) if spec else 0
        parts = memory.student_rank(shape_of(dense), shape_of(moe), B * L, b, 1, False, 2, kw["ckpt"], cfg.loss_chunk,
                                    spec.mode if spec else "online", per_token)
    elif case == "calibrate":
        from m2d_ray.calibrate.collect import collect_stats
        from m2d_ray.models import load_teacher

        B, L = kw["batch"], kw["seq"]
        ids = torch.randint(0, moe.vocab_size, (2 * B, L))
        peak = Peak()
        t = load_teacher(teacher, dtype=dtype, device=device)
        collect_stats(t.model, t.adapter, ids, torch.ones_like(ids), batch_size=B, progress=False)
        measured = peak.stop()
        parts = memory.calibration(shape_of(moe), B, L, b, streamed=False, gpu=gpu)
    else:
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM

        from m2d_ray.evaluate.placement import plan_eval
        from m2d_ray.models import load_model, load_tokenizer

        B, L = kw["batch"], kw["seq"]
        # random contexts longer than max_length (every sequence is truncated to it; lm-eval merges equal ones), three
        # full batches (lm-eval keeps a batch's log-probs while the next one runs)
        tok, g = load_tokenizer(student), torch.Generator().manual_seed(0)
        reqs = [Instance("loglikelihood", {}, (tok.decode(torch.randint(0, len(tok), (2 * L,), generator=g).tolist()), " end"), i)
                for i in range(3 * B)]
        peak = Peak()
        model, tok = load_model(student, device=device, dtype=dtype)
        HFLM(pretrained=model, tokenizer=tok, batch_size=B, max_length=L, device=device).loglikelihood(reqs, disable_tqdm=True)
        measured = peak.stop()
        p = plan_eval(_eval_size(dense, b), None, 0, B, max_length=L)
        parts = {"weights": p.weights, "batch": p.batch_size * p.sequence}
    est = memory.total(parts)
    return {"case": case, **kw, "size": size, "device": device, "measured": measured, "sampled": getattr(peak, "sampled", None),
            "estimate": est, "ratio": round(est / measured, 3),
            "parts_mib": {k: round(v / 2**20) for k, v in parts.items()}}


def _eval_size(config, b: int):
    from m2d_ray.evaluate.placement import model_size

    return model_size(config, b)


def measure(case: str, kw: dict, size: str = "mid", work: Path | None = None, device: str = "cpu") -> dict:
    """One case in a fresh Python (its own peak), models cached under `work`."""
    work = work or Path(tempfile.gettempdir()) / "m2d-plan-measured"
    work.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps([case, size, kw, str(work), device])], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)}, check=False)
    if out.returncode:
        raise RuntimeError(f"{case} {kw}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case: the table shows the spread (min-max) over them")
    ap.add_argument("--cases", help="indices into CASES, comma-separated (default: all)")
    ap.add_argument("--child")
    a = ap.parse_args(argv)
    if a.child:
        case, size, kw, work, device = json.loads(a.child)
        print(json.dumps(child(case, size, kw, Path(work), device)))
        return
    size = "small" if a.small else "mid"
    cases = [CASES[int(i)] for i in a.cases.split(",")] if a.cases else CASES
    mib = lambda xs: f"{min(xs) / 2**20:.0f}" + (f"-{max(xs) / 2**20:.0f}" if len(xs) > 1 else "") + " MiB"  # noqa: E731
    print("| case | settings | estimate | measured (high-water mark) | sampled every 2 ms | estimate / measured |\n|---|---|---|---|---|---|")
    worst = 0.0
    for case, kw in cases:
        rs = [measure(case, kw, size, device=a.device) for _ in range(a.repeat)]
        ratios = [r["ratio"] for r in rs]
        worst = max([worst] + [abs(x - 1) for x in ratios])
        settings = ", ".join(f"{k} {v}" for k, v in kw.items())
        sampled = (mib([r["sampled"] for r in rs]) + f" (lowest {min(r['sampled'] / r['measured'] for r in rs):.0%} of measured)"
                   if rs[0]["sampled"] is not None else "-")
        print(f"| {case} | {settings} | {rs[0]['estimate'] / 2**20:.0f} MiB | {mib([r['measured'] for r in rs])} | {sampled} | "
              f"{min(ratios):.2f}" + (f"-{max(ratios):.2f}" if len(rs) > 1 else "") + " |", flush=True)
    print(f"\nlargest deviation: {worst:.0%} (bound: 25%)")


if __name__ == "__main__":
    main()
