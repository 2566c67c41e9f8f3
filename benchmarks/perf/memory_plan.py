"""The memory plan against measurement: `m2d plan`'s per-device estimate of a stage vs the peak it reaches.

Each case's models are saved by one fresh process, then loaded and run the way the stage's code does by another,
on seeded inputs, so that the figure is the work's and not what ran before it. The measured figure is the peak
growth of the process's anonymous resident memory from after the imports to the end, read from the kernel's own
high-water mark so that no peak is missed however busy the machine is: VmHWM, reset every 2 ms, less the
file-mapped and shared pages (RssFile, RssShmem) at the window's ends (AnonPeak). Anonymous memory, not VmRSS:
transformers keeps a loaded checkpoint's file mapped, and those clean file pages are page cache the kernel drops
under pressure (they would count the weights twice on CPU), resident or not as the page cache was warm or cold.
The largest RssAnon read at the window ends is kept as a check ("sampled": it may miss a peak on a busy machine,
but never sees more than the high-water mark). The estimate is `m2d_ray.plan.memory`'s, on CPU (fp32).

    train     one student's DistillStep (plain torch, one rank): online teacher, cached topk:64 targets (with and
              without gradient checkpointing) or cached hidden states with the teacher's head read alone
    calibrate collect_stats of a Qwen3-MoE teacher loaded by models.load_teacher
    eval      lm-eval's HFLM on loglikelihood requests longer than max_length (every sequence is full)

    python -m benchmarks.perf.memory_plan [--small] [--device cuda] [--repeat N] [--cases 1,2,4,6]
        --small: the sizes tests/unit/test_plan_measured.py uses; --device cuda (benchmarks/gpu_acceptance.sh): bf16
        on the GPU, measured = torch.cuda.max_memory_allocated above the allocations before the case, against the
        plan's GPU arithmetic without its CUDA-context reserve (allocations do not include the context)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import python_m

REPO = Path(__file__).resolve().parents[2]

# (hidden, layers, ffn, vocab): a mid-size student / teacher on this 2-core machine, and a small one for the test
SIZES = {"mid": (512, 8, 1536, 32000), "small": (256, 4, 768, 16000)}
CASES = [
    ("train", {"targets": "online", "ckpt": "none", "batch": 4, "seq": 512}),
    ("train", {"targets": "online", "ckpt": "full", "batch": 8, "seq": 512}),
    ("train", {"targets": "topk:64", "ckpt": "none", "batch": 4, "seq": 512}),
    ("train", {"targets": "topk:64", "ckpt": "full", "batch": 16, "seq": 256}),
    ("calibrate", {"experts": 32, "batch": 4, "seq": 512}),
    ("calibrate", {"experts": 128, "batch": 2, "seq": 1024}),
    ("eval", {"batch": 8, "seq": 512}),
    ("eval", {"batch": 32, "seq": 256}),
    ("train", {"targets": "hidden", "ckpt": "none", "batch": 4, "seq": 512}),
    ("train", {"targets": "online", "ckpt": "selective", "batch": 8, "seq": 512}),
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
    """The peak of this process's anonymous resident memory above its value at start, from the kernel's
    high-water mark taken in 2 ms windows: a thread reads VmHWM (the largest resident set since the window
    began, however briefly held) and starts the next window (resets it through /proc/self/clear_refs, Linux >=
    4.0); a window's anonymous peak is its VmHWM less the file-mapped and shared pages at the lower of its two
    ends. So file pages count only as far as they were mapped or dropped inside one window: a checkpoint's
    mapped pages, more or fewer of them resident by the end as the page cache was warm or cold, move nothing.
    `sampled`: the largest RssAnon read at the window ends (a lower bound, the check of the upper one)."""

    FIELDS = ("VmHWM", "RssAnon", "RssFile", "RssShmem")

    def __init__(self, every: float = 0.002) -> None:
        self.every, self.done = every, False
        self.start = self.last = self._window()
        self.peak = self.sampled = self.start["RssAnon"]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @classmethod
    def read(cls) -> dict[str, int]:
        """The fields of one read of /proc/self/status (one moment), in bytes."""
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in cls.FIELDS:
                out[key] = int(value.split()[0]) * 1024
        if len(out) < len(cls.FIELDS):
            raise RuntimeError(
                f"no {', '.join(k for k in cls.FIELDS if k not in out)} in /proc/self/status (Linux only)"
            )
        return out

    def _window(self) -> dict[str, int]:
        """The figures of the window now ending; the next one starts (VmHWM = the resident set now)."""
        s = self.read()
        Path("/proc/self/clear_refs").write_text("5")
        return s

    def _tick(self) -> None:
        s = self._window()
        mapped = min(self.last["RssFile"] + self.last["RssShmem"], s["RssFile"] + s["RssShmem"])
        self.peak = max(self.peak, s["VmHWM"] - mapped)
        self.sampled = max(self.sampled, s["RssAnon"])
        self.last = s

    def _run(self) -> None:
        while not self.done:
            time.sleep(self.every)
            self._tick()

    def stop(self) -> int:
        self.done = True
        self.thread.join()
        self._tick()
        self.sampled -= self.start["RssAnon"]
        return self.peak - self.start["RssAnon"]


def _configs(size: str, experts: int = 32):
    """(dense, MoE) of one size: the MoE (top-8 of `experts` experts of width f / 8) and the dense model of the same
    attention and embeddings with FFN width f, as the conversion builds it (the adapter's student config)."""
    from m2d_ray.arch.qwen3_moe import Qwen3MoeAdapter, moe_config

    h, n, f, v = SIZES[size]
    moe = moe_config(
        vocab=v,
        hidden=h,
        layers=n,
        heads=h // 64,
        kv_heads=max(1, h // 128),
        head_dim=64,
        ffn=f,
        expert_width=f // 8,
        experts=experts,
        top_k=8,
        max_positions=32768,  # transformers' default, as the dense one's
        norm_topk_prob=False,
        dtype="float32",
    )
    return Qwen3MoeAdapter().student_config(moe, f), moe


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


def _models(size: str, experts: int, work: Path) -> tuple[Path, Path]:
    """Where a case's student and teacher are saved."""
    return work / f"dense-{size}", work / f"moe{experts}-{size}"


def build(size: str, experts: int, work: Path) -> None:
    """Save a case's models, in a process of its own: the memory building leaves in the allocator was reused by
    the measured work when it ran in the same process and hid part of its peak (one run in three measured the
    online case at 567 MiB, 1.29 of the estimate; benchmarks/RESULTS.md, issue 43)."""
    for config, path in zip(_configs(size, experts), _models(size, experts, work)):
        _save(config, path)


def child(case: str, size: str, kw: dict, work: Path, device: str = "cpu") -> dict:
    """Load the case's models (saved by `build`) and run them as the stage does, on seeded inputs: the tokens
    decide the teacher's routing, and with it the sizes the allocator is asked for (the online case's peak was
    660-769 MiB over five seeds)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpu = device == "cuda"
    dtype, b, Peak = (torch.bfloat16, 2, CudaPeak) if gpu else (torch.float32, 4, AnonPeak)
    import transformers.modeling_utils  # noqa: F401  (code, not the stage's working memory: loaded before any window)

    from m2d_ray.plan import memory
    from m2d_ray.plan.shapes import shape_of

    dense, moe = _configs(size, kw.get("experts", 32))
    student, teacher = map(str, _models(size, kw.get("experts", 32), work))
    if case == "train":
        from transformers import AutoModelForCausalLM

        from m2d_ray.config import DistillConfig
        from m2d_ray.distill import checkpointing
        from m2d_ray.distill.precision import resolve
        from m2d_ray.distill.step import DistillStep
        from m2d_ray.distill.targets import bytes_per_token, parse_targets, state_bytes
        from m2d_ray.models import load_distill_teacher
        from m2d_ray.weights import read_output_head

        B, L, online = kw["batch"], kw["seq"], kw["targets"] == "online"
        spec = None if online else parse_targets(kw["targets"])
        cfg = DistillConfig(deepspeed=False, batch_size=B, seq_len=L, checkpointing=kw["ckpt"])
        V, d = dense.vocab_size, moe.hidden_size

        def ids():
            return torch.randint(0, V, (B, L), device=device)

        if online:
            batch = ids
        elif spec.exact:

            def batch():
                return {"tokens": ids(), "hidden": torch.randn(B, L, d, dtype=dtype, device=device)}
        else:

            def batch():
                return {
                    "tokens": ids(),
                    "ids": torch.randint(0, V, (B, L, spec.k), dtype=torch.int32, device=device),
                    "logp": torch.log_softmax(torch.randn(B, L, spec.k, device=device), -1).half(),
                    "tail": torch.full((B, L), -5.0, device=device),
                }

        peak = Peak()
        t = load_distill_teacher(teacher, dtype=dtype, device=device).model if online else None
        head = read_output_head(teacher, dtype).to(device) if spec is not None and spec.exact else None
        s = AutoModelForCausalLM.from_pretrained(student, dtype=dtype).to(device).train()
        checkpointing.apply(s, kw["ckpt"])
        s.config.use_cache = False
        precision = resolve("auto", gpu)  # what stage 2 trains in: bf16-mixed on a GPU, fp32 on CPU
        step = DistillStep(s, t, cfg, device, 1, precision, spec, head)
        for _ in range(2):
            step.step([batch()])
        measured = peak.stop()
        per_token = bytes_per_token(spec, state_bytes(d, gpu)) if spec else 0
        parts = memory.student_rank(
            shape_of(dense),
            shape_of(moe),
            B * L,
            b,
            1,
            False,
            2,
            kw["ckpt"],
            cfg.loss_chunk,
            spec.mode if spec else "online",
            per_token,
            masters=precision.masters,
        )
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
        reqs = [
            Instance(
                "loglikelihood", {}, (tok.decode(torch.randint(0, len(tok), (2 * L,), generator=g).tolist()), " end"), i
            )
            for i in range(3 * B)
        ]
        peak = Peak()
        model, tok = load_model(student, device=device, dtype=dtype)
        HFLM(pretrained=model, tokenizer=tok, batch_size=B, max_length=L, device=device).loglikelihood(
            reqs, disable_tqdm=True
        )
        measured = peak.stop()
        p = plan_eval(_eval_size(dense, b), None, 0, B, max_length=L)
        parts = {"weights": p.weights, "batch": p.batch_size * p.sequence}
    est = memory.total(parts)
    return {
        "case": case,
        **kw,
        "size": size,
        "device": device,
        "measured": measured,
        "sampled": getattr(peak, "sampled", None),
        "estimate": est,
        "ratio": round(est / measured, 3),
        "parts_mib": {k: round(v / 2**20) for k, v in parts.items()},
    }


def _eval_size(config, b: int):
    from m2d_ray.evaluate.placement import model_size

    return model_size(config, b)


def _python(what: str, flag: str, args: list) -> str:
    """The standard output of this script run with `flag` in a fresh Python."""
    out = subprocess.run(
        [*python_m(__spec__.name), flag, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"{what}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return out.stdout


def measure(case: str, kw: dict, size: str = "mid", work: Path | None = None, device: str = "cpu") -> dict:
    """One case in a fresh Python (its own peak), models saved under `work` first by another."""
    work = work or Path(tempfile.gettempdir()) / "m2d-plan-measured"
    work.mkdir(parents=True, exist_ok=True)
    if not all((p / "config.json").exists() for p in _models(size, kw.get("experts", 32), work)):
        _python(f"building {size} models", "--build", [size, kw.get("experts", 32), str(work)])
    return json.loads(_python(f"{case} {kw}", "--child", [case, size, kw, str(work), device]).strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs of each case: the table shows the spread (min-max) over them"
    )
    ap.add_argument("--cases", help="indices into CASES, comma-separated (default: all)")
    ap.add_argument("--work", type=Path, help="where the models are saved (default: under the temp directory)")
    ap.add_argument("--json", action="store_true", help="each run's figures as a JSON line instead of the table")
    ap.add_argument("--child")
    ap.add_argument("--build")
    a = ap.parse_args(argv)
    if a.build:
        size, experts, work = json.loads(a.build)
        build(size, experts, Path(work))
        return
    if a.child:
        case, size, kw, work, device = json.loads(a.child)
        print(json.dumps(child(case, size, kw, Path(work), device)))
        return
    size = "small" if a.small else "mid"
    cases = [CASES[int(i)] for i in a.cases.split(",")] if a.cases else CASES
    if a.json:
        for case, kw in cases:
            for _ in range(a.repeat):
                print(
                    json.dumps({"case": case, "settings": kw, **measure(case, kw, size, a.work, a.device)}), flush=True
                )
        return

    def mib(xs):
        return f"{min(xs) / 2**20:.0f}" + (f"-{max(xs) / 2**20:.0f}" if len(xs) > 1 else "") + " MiB"

    print(
        "| case | settings | estimate | measured (high-water mark) | sampled every 2 ms | estimate / measured "
        "|\n|---|---|---|---|---|---|"
    )
    worst = 0.0
    for case, kw in cases:
        rs = [measure(case, kw, size, a.work, a.device) for _ in range(a.repeat)]
        ratios = [r["ratio"] for r in rs]
        worst = max([worst] + [abs(x - 1) for x in ratios])
        settings = ", ".join(f"{k} {v}" for k, v in kw.items())
        sampled = (
            mib([r["sampled"] for r in rs])
            + f" (lowest {min(r['sampled'] / r['measured'] for r in rs):.0%} of measured)"
            if rs[0]["sampled"] is not None
            else "-"
        )
        print(
            f"| {case} | {settings} | {rs[0]['estimate'] / 2**20:.0f} MiB | {mib([r['measured'] for r in rs])} | "
            f"{sampled} | "
            f"{min(ratios):.2f}" + (f"-{max(ratios):.2f}" if len(rs) > 1 else "") + " |",
            flush=True,
        )
    print(f"\nlargest deviation: {worst:.0%} (bound: 25%)")


if __name__ == "__main__":
    main()
