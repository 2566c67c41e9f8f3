"""P10: the teacher sharded over a student's ranks (distill/sharded_teacher.py), on the CPU with gloo ranks.

Teacher: the random-weight E64 Qwen3-MoE of P6 (benchmarks/tools/make_teacher.py: d 512, expert width 256, k 4, 8
    layers,
fp32, ~800 MB, 5 safetensors shards); student: its random-FFN baseline (width k x 256). Each part runs its ranks as
fresh processes (torch.multiprocessing, one thread each); a rank's memory is its VmHWM above its VmRSS after the
imports, the maximum over ranks.

    choose    FSDP2 (`fully_shard`, the platform's) against DeepSpeed ZeRO-3 inference (`deepspeed.zero.Init` + an
              engine without optimizer) and the unsharded teacher, 2 ranks: each rank's memory holding the teacher and
              the seconds of a no-grad forward of one [1, 256] batch (best of 3)
    memory    2 and 4 ranks: a distillation step's rank (DDP student + the teacher online, 2 steps of [1, 256]), the
              teacher unsharded (`online`: loaded as the platform loads it, from_pretrained; `online-read`: read
              tensor by tensor, without from_pretrained's loading overhead) or sharded (streamed from the
              checkpoint): peak per rank, and how far the sharded one lies below each, in teacher bytes (the issue's
              bar: >= 0.4 at 2 ranks, >= 0.6 at 4)
    speed     2 ranks, one run: unsharded and sharded steps interleaved on the same processes (A B A B ...), their
              ratio, and where a step's time goes (the teacher's forward, gathers included, against the rest)
    quality   the wiki4 pair (../shared): the DO-ACP K = k student, 100 steps of 2 ranks x 4 x 128 tokens, distilled
              online, from the teacher sharded over the 2 ranks, and from its cached hidden states: final validation
              perplexity of each (same student, data and budget)

    python -m benchmarks.perf.sharded_teacher [--parts choose memory speed quality] [--work /tmp/m2d-p10] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from workshop.local_group import join, spawn

SEQ = 256


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _ids(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, 1, SEQ), generator=torch.Generator().manual_seed(seed))


def _spawn(fn, world: int, *args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="m2d-p10-") as out:
        spawn(fn, world, out, *args)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def _save(out: str, rank: int, d: dict) -> None:
    Path(out, f"{rank}.json").write_text(json.dumps(d))


# ---- choose: FSDP2 against ZeRO-3 -------------------------------------------------------------------------------
def _forward_s(model, ids: torch.Tensor) -> float:
    best = float("inf")
    with torch.no_grad():
        for i in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            model.base_model(input_ids=ids[i], use_cache=False)
            best = min(best, time.perf_counter() - t0)
    return best


def _choose_main(rank: int, world: int, port: int, out: str, teacher: str, impl: str) -> None:
    join(rank, world, port)
    from m2d_ray.models import load_distill_teacher

    base = _vm("VmRSS")
    _reset_hwm()
    t0 = time.perf_counter()
    if impl == "fsdp2":
        from m2d_ray.distill.sharded_teacher import load_sharded

        model = load_sharded(teacher, torch.float32, "cpu")[0].model
    elif impl == "zero3":
        model = _zero3(teacher)
    else:
        model = load_distill_teacher(teacher, dtype=torch.float32).model
    load_s = time.perf_counter() - t0
    loaded = _vm("VmHWM") - base
    fwd = _forward_s(model, _ids(model.config.vocab_size, 3))
    _save(out, rank, {"load_s": load_s, "loading_peak": loaded, "peak": _vm("VmHWM") - base, "forward_s": fwd})
    dist.destroy_process_group()


def _zero3(teacher: str):
    """DeepSpeed ZeRO-3 inference as transformers documents it outside its Trainer: a live `HfDeepSpeedConfig` of
    stage 3 makes `from_pretrained` construct the model partitioned (`deepspeed.zero.Init`) and load the checkpoint
    into the partitions, then an engine without optimizer runs it (its hooks gather each module's parameters)."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}
    keep = HfDeepSpeedConfig(ds)  # noqa: F841 (transformers reads it while it is alive)
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32, experts_implementation="eager")
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    _zero3.keep = keep
    return engine.module.eval()


# ---- memory: a distillation step's rank -------------------------------------------------------------------------
def _step_main(rank: int, world: int, port: int, out: str, teacher: str, student: str, mode: str, steps: int) -> None:
    join(rank, world, port)
    from transformers import AutoModelForCausalLM

    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.sharded_teacher import load_sharded
    from m2d_ray.distill.step import DistillStep
    from m2d_ray.models import load_distill_teacher

    base = _vm("VmRSS")
    _reset_hwm()
    if mode == "sharded":
        t, head = load_sharded(teacher, torch.float32, "cpu")
    elif mode == "online-read":
        t, head = _read_whole(teacher), None
    else:
        t, head = load_distill_teacher(teacher, dtype=torch.float32), None
    loading = _vm("VmHWM") - base
    s = AutoModelForCausalLM.from_pretrained(student).train()
    cfg = DistillConfig(lr=1e-4, warmup_steps=1, steps=steps, seq_len=SEQ, loss_chunk=256, deepspeed=False)
    trainer = DistillStep(s, t.model, cfg, "cpu", world, head=head)
    ids = _ids(t.config.vocab_size, steps * world, seed=1)
    for i in range(steps):
        trainer.step([ids[i * world + rank]])
    _save(out, rank, {"loading_peak": loading, "peak": _vm("VmHWM") - base, "loss": trainer.take_loss()})
    dist.destroy_process_group()


def _read_whole(teacher: str):
    """The whole teacher read tensor by tensor from its checkpoint (weights.open_model), as a `models.Teacher`."""
    from m2d_ray.models import Teacher
    from m2d_ray.weights import open_model

    lazy = open_model(teacher, dtype=torch.float32)
    return Teacher(teacher, lazy.module("").eval(), lazy.tokenizer, lazy.adapter)


# ---- quality: the wiki4 pair, 2 ranks --------------------------------------------------------------------------
def _quality_main(rank: int, world: int, port: int, out: str, work: str, steps: int) -> None:
    join(rank, world, port)
    from benchmarks.common import TEACHER_DIR, WIKI_TEST, WIKI_VALID
    from m2d_ray.config import DistillConfig
    from m2d_ray.distill.loop import DistillJob, WorkerIO, run_distill
    from m2d_ray.distill.targets import parse_targets

    cfg = DistillConfig(
        train_data=str(WIKI_VALID), steps=steps, lr=3e-3, min_lr=3e-4, warmup_steps=5, batch_size=4, seq_len=128,
        eval_every=max(1, steps // 4), eval_max_tokens=16384, deepspeed=False,
    )  # fmt: skip
    rows = {}
    for mode in ("online", "sharded", "hidden"):
        reports, t0 = [], time.perf_counter()
        job = DistillJob(
            str(TEACHER_DIR), f"{work}/student", cfg, str(WIKI_TEST), tokens=f"{work}/tokens",
            targets=f"{work}/targets-hidden" if mode == "hidden" else None,
            target_spec=parse_targets("hidden") if mode == "hidden" else None, shard_teacher=mode == "sharded",
        )  # fmt: skip
        run_distill(job, WorkerIO(rank=rank, world=world, report=lambda m, c, r=reports: r.append(m)))
        rows[mode] = {
            "val_ppl": [m["val_ppl"] for m in reports],
            "initial": reports[-1]["val_ppl_initial"],
            "s": time.perf_counter() - t0,
            "peak_rss": reports[-1]["peak_rss_bytes"],
        }
    _save(out, rank, rows)
    dist.destroy_process_group()


def _quality(work: Path, steps: int) -> list[dict]:
    """The student, tokens and hidden-state targets of the wiki4 pair, made once here (as s3_targets.py makes them),
    then the three modes on 2 ranks."""
    from benchmarks.common import TEACHER_DIR, WIKI_TEST, WIKI_VALID
    from m2d_ray.commands.convert import convert_one
    from m2d_ray.distill.targets import parse_targets
    from m2d_ray.distill.tokens import write_tokens
    from m2d_ray.models import load_tokenizer
    from m2d_ray.runtime.shards import targets_here

    work = work / f"wiki4-{steps}"
    if not (work / "student" / "config.json").exists():
        convert_one(
            str(TEACHER_DIR), "do-acp", "rr", "uniform", None, work / "student", calib_data=str(WIKI_VALID),
            calib_kwargs={"max_tokens": 16384, "seq_len": 128},
        )  # fmt: skip
    if not (work / "tokens").exists():
        tok = load_tokenizer(str(TEACHER_DIR))
        write_tokens(work / "tokens", tok, str(WIKI_VALID), 128, steps * 4 * 2, str(WIKI_TEST), 16384)
    if not (work / "targets-hidden").exists():
        targets_here(str(TEACHER_DIR), str(work / "tokens"), str(work / "targets-hidden"), parse_targets("hidden"))
    return _spawn(_quality_main, 2, str(work), steps)


# ---- speed: both teachers in one run ---------------------------------------------------------------------------
def _speed_main(rank: int, world: int, port: int, out: str, teacher: str, student: str, steps: int) -> None:
    join(rank, world, port)
    from transformers import AutoModelForCausalLM

    from m2d_ray.config import DistillConfig
    from m2d_ray.distill import step as step_module
    from m2d_ray.distill.sharded_teacher import load_sharded
    from m2d_ray.distill.step import DistillStep
    from m2d_ray.models import load_distill_teacher

    cfg = DistillConfig(lr=1e-4, warmup_steps=1, steps=steps, seq_len=SEQ, loss_chunk=256, deepspeed=False)
    whole = load_distill_teacher(teacher, dtype=torch.float32)
    shard, head = load_sharded(teacher, torch.float32, "cpu")
    trainers = {
        "online": DistillStep(AutoModelForCausalLM.from_pretrained(student).train(), whole.model, cfg, "cpu", world),
        "sharded": DistillStep(
            AutoModelForCausalLM.from_pretrained(student).train(), shard.model, cfg, "cpu", world, head=head
        ),
    }
    spent = {"teacher": 0.0}
    real = step_module.teacher_outputs

    def timed(*args, **kwargs):  # the teacher's forward (its gathers included) inside the step
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent["teacher"] += time.perf_counter() - t0

    step_module.teacher_outputs = timed
    ids = _ids(whole.config.vocab_size, (steps + 1) * world, seed=2)
    times = {k: [] for k in trainers}
    teacher_s = {k: [] for k in trainers}
    for i in range(steps + 1):  # the first step of each warms up (not counted)
        for name, trainer in trainers.items():
            dist.barrier()
            spent["teacher"] = 0.0
            t0 = time.perf_counter()
            trainer.step([ids[i * world + rank]])
            if i:
                times[name].append(time.perf_counter() - t0)
                teacher_s[name].append(spent["teacher"])
    losses = {k: t.take_loss() for k, t in trainers.items()}
    _save(out, rank, {"step_s": times, "teacher_s": teacher_s, "loss": losses})
    dist.destroy_process_group()


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/m2d-p10")
    p.add_argument("--parts", nargs="+", default=["choose", "memory", "speed", "quality"])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quality-steps", type=int, default=100)
    a = p.parse_args(argv)
    from benchmarks.common import machine_line
    from benchmarks.tools.make_teacher import make_teacher
    from m2d_ray.convert.initial import materialize
    from m2d_ray.weights import open_teacher

    work = Path(a.work)
    teacher = make_teacher(work / "teacher-e64", E=64)
    student = materialize(open_teacher(str(teacher)), work / "student", baseline="random-ffn")
    t_bytes = open_teacher(str(teacher)).nbytes()
    print(json.dumps({"machine": machine_line(), "teacher_bytes": t_bytes}), flush=True)
    if "choose" in a.parts:
        for impl in ("unsharded", "fsdp2", "zero3"):
            try:
                ranks = _spawn(_choose_main, 2, str(teacher), impl)
            except Exception as exc:  # DeepSpeed's ZeRO-3 may not run here: that is a finding too
                print(json.dumps({"part": "choose", "impl": impl, "error": str(exc).splitlines()[-1][:300]}))
                continue
            row = {k: max(r[k] for r in ranks) for k in ranks[0]}
            print(json.dumps({"part": "choose", "impl": impl, "ranks": 2, **row, "of_teacher": row["peak"] / t_bytes}))
    if "memory" in a.parts:
        for world in a.ranks:
            peaks = {}
            for mode in ("online", "online-read", "sharded"):
                ranks = _spawn(_step_main, world, str(teacher), str(student), mode, 2)
                peaks[mode] = max(r["peak"] for r in ranks)
                loading = max(r["loading_peak"] for r in ranks)
                print(json.dumps({"part": "memory", "ranks": world, "mode": mode, "peak": peaks[mode],
                                  "loading_peak": loading, "loss": ranks[0]["loss"]}), flush=True)  # fmt: skip
            below = {k: (peaks[k] - peaks["sharded"]) / t_bytes for k in ("online", "online-read")}
            print(json.dumps({"part": "memory", "ranks": world, "sharded_below_in_teachers": below}), flush=True)
    if "speed" in a.parts:
        ranks = _spawn(_speed_main, 2, str(teacher), str(student), a.steps)
        step = {k: max(_median(r["step_s"][k]) for r in ranks) for k in ("online", "sharded")}
        fwd = {k: max(_median(r["teacher_s"][k]) for r in ranks) for k in ("online", "sharded")}
        print(
            json.dumps(
                {
                    "part": "speed",
                    "ranks": 2,
                    "step_s": step,
                    "teacher_forward_s": fwd,
                    "rest_s": {k: step[k] - fwd[k] for k in step},
                    "sharded_over_online": step["sharded"] / step["online"],
                    "loss": ranks[0]["loss"],
                }
            ),
            flush=True,
        )
    if "quality" in a.parts:
        ranks = _quality(work, a.quality_steps)
        for mode, row in ranks[0].items():
            print(json.dumps({"part": "quality", "ranks": 2, "steps": a.quality_steps, "mode": mode, **row}))


if __name__ == "__main__":
    main()
