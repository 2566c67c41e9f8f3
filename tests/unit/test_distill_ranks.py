"""Stage 2 on several ranks without Ray: two gloo processes (DDP, then DeepSpeed ZeRO-2) against one rank
with the same global batch; collectives on the training device; no host read-back inside a step."""

from __future__ import annotations

import collections
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import SYNTHETIC_DISTILL
from transformers import AutoModelForCausalLM

from m2d_ray.config import DistillConfig
from m2d_ray.distill.loop import DistillJob, WorkerIO, run_distill, stop_requested, validate
from m2d_ray.distill.step import DistillStep
from m2d_ray.models import default_teacher, load_teacher
from workshop.local_group import join, spawn

CFG = replace(
    SYNTHETIC_DISTILL, steps=4, eval_every=2, warmup_steps=1, seq_len=64, eval_max_tokens=1024, eval_batch_size=2
)


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory) -> Path:
    from m2d_ray.convert.initial import materialize

    return materialize(load_teacher(), tmp_path_factory.mktemp("init") / "random-ffn", baseline="random-ffn")


def _rank_main(rank: int, world: int, port: int, student: str, out: str, runs: dict[str, DistillConfig]) -> None:
    """One rank: a gloo group as Ray Train makes it, every all_reduce the Python side issues recorded."""
    join(rank, world, port)
    calls: list[str] = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append(str(tensor.device))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        for name, cfg in runs.items():
            calls.clear()
            reports: list[dict] = []
            job = DistillJob(default_teacher(), student, cfg, "synthetic:valid", out=f"{out}/{name}")
            run_distill(job, WorkerIO(rank=rank, world=world, report=lambda m, ckpt: reports.append(m)))
            Path(f"{out}/{name}-rank{rank}.json").write_text(json.dumps({"reports": reports, "all_reduce": calls}))
    finally:
        dist.all_reduce = real
        dist.destroy_process_group()


def _weights(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_two_gloo_ranks_with_ddp_and_deepspeed_match_one_rank(student_dir, ds_env, tmp_path):
    """2 ranks x batch 2 see the blocks 1 rank x batch 4 sees (block g goes to rank g % world): same losses, same
    student."""
    runs = {
        "ddp": DistillConfig(**{**CFG.__dict__, "batch_size": 2}),
        "deepspeed": DistillConfig(**{**CFG.__dict__, "batch_size": 2, "deepspeed": True}),
    }
    spawn(_rank_main, 2, str(student_dir), str(tmp_path), runs)
    one: list[dict] = []
    run_distill(
        DistillJob(
            default_teacher(),
            str(student_dir),
            DistillConfig(**{**CFG.__dict__, "batch_size": 4}),
            "synthetic:valid",
            out=str(tmp_path / "one"),
        ),
        WorkerIO(report=lambda m, ckpt: one.append(m)),
    )
    ref = _weights(tmp_path / "one")
    init = _weights(student_dir)
    moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
    assert moved > 1e-3  # training changed the student, so agreeing below is not trivial
    n_params = len(ref)
    for name in runs:
        ranks = [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
        for r in ranks:  # every rank reports the same (rank-summed) figures
            assert [m["step"] for m in r["reports"]] == [2, 4]
            for a, b in zip(r["reports"], one):
                assert a["tokens"] == b["tokens"]
                assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5), name
                assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5) and a["val_tokens"] == b["val_tokens"], (
                    name
                )
            assert set(r["all_reduce"]) == {"cpu"}, name  # the training device
        got = _weights(tmp_path / name)
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert diff < 0.01 * moved, (
            name,
            diff,
            moved,
        )  # summation order differs; AdamW's early steps are ~ lr * sign(g)
    # DDP reduces gradients in buckets inside its reducer: the Python side issues only the loop's few
    # collectives (losses, validation), not one per parameter per step
    assert len(ranks_ddp := json.loads((tmp_path / "ddp-rank0.json").read_text())["all_reduce"]) < n_params, ranks_ddp


def _zero_main(rank: int, world: int, port: int, student: str, out: str, runs: dict[str, DistillConfig]) -> None:
    """One rank of ZeRO-2, ZeRO-3 and ZeRO-3 resumed from its step-2 checkpoint (every rank's files copied into one
    directory, as Ray Train's storage holds them)."""
    join(rank, world, port)
    try:
        for name, cfg in runs.items():
            reports: list[dict] = []

            def report(m: dict, ckpt: Path | None, name=name, reports=reports) -> None:
                reports.append(m)
                if ckpt is not None and m["step"] == 2:
                    shutil.copytree(ckpt, f"{out}/{name}-ckpt", dirs_exist_ok=True)

            restore = Path(f"{out}/zero3-ckpt") if name == "zero3-resumed" else None
            job = DistillJob(default_teacher(), student, cfg, "synthetic:valid", out=f"{out}/{name}")
            dist.barrier()  # every rank's checkpoint files are in place before a rank restores them
            run_distill(job, WorkerIO(rank=rank, world=world, report=report, restore=restore))
            Path(f"{out}/{name}-rank{rank}.json").write_text(json.dumps(reports))
    finally:
        dist.destroy_process_group()


def _zero_runs(student_dir: Path, tmp_path: Path, names: tuple[str, ...]) -> dict[str, list[dict]]:
    """The named runs of ZeRO-2, ZeRO-3 (full checkpointing under it) and ZeRO-3 resumed from its step-2 checkpoint,
    in float32 at 2 gloo ranks; rank 0's reports by name."""
    base = replace(CFG, batch_size=2, deepspeed=True, precision="fp32")
    runs = {
        "zero2": replace(base, zero_stage=2),
        "zero3": replace(base, zero_stage=3, checkpointing="full"),
        "zero3-resumed": replace(base, zero_stage=3),
    }
    spawn(_zero_main, 2, str(student_dir), str(tmp_path), {n: runs[n] for n in names})
    return {n: json.loads((tmp_path / f"{n}-rank0.json").read_text()) for n in names}


def test_zero3_trains_as_zero2_and_exports_the_same_student(student_dir, ds_env, tmp_path):
    """ZeRO-3 (the weights partitioned, the head gathered for the KL and validation) in float32 at 2 gloo ranks: the
    loss trajectory of ZeRO-2, with full checkpointing under it; the exported student has the same parameter names
    and values."""
    got = _zero_runs(student_dir, tmp_path, ("zero2", "zero3"))
    assert [m["step"] for m in got["zero3"]] == [2, 4]
    for a, b in zip(got["zero3"], got["zero2"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    init, two, three = _weights(student_dir), _weights(tmp_path / "zero2"), _weights(tmp_path / "zero3")
    assert set(three) == set(two) == set(init)
    moved = max((two[k] - init[k]).abs().max().item() for k in two)
    assert moved > 1e-3  # trained: agreeing is not trivial
    assert max((three[k] - two[k]).abs().max().item() for k in two) < 1e-3 * moved


@pytest.mark.slow
def test_zero3_resumed_from_its_checkpoint_continues_zero2_s_trajectory(student_dir, ds_env, tmp_path):
    """Every rank's ZeRO-3 partition files in one checkpoint directory (as Ray Train's storage holds them): a resume
    from step 2 reaches ZeRO-2's step-4 loss."""
    got = _zero_runs(student_dir, tmp_path, ("zero2", "zero3", "zero3-resumed"))
    assert [m["step"] for m in got["zero3-resumed"]] == [4]
    assert got["zero3-resumed"][0]["train_loss"] == pytest.approx(got["zero2"][1]["train_loss"], rel=1e-5)


class _Sentinel(Exception):
    pass


def test_every_collective_gets_a_tensor_on_the_training_device(tiny_teacher, monkeypatch, tmp_path):
    """NCCL takes CUDA tensors only: the loop's collectives must be built on the training device. A
    stand-in device ('meta') shows which device each collective got, on a CPU-only machine."""
    seen: list[torch.device] = []

    def record(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise _Sentinel

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", record)
    io = WorkerIO(rank=0, world=2)
    w = torch.randint(0, tiny_teacher.config.vocab_size, (2, 16))
    with pytest.raises(_Sentinel):
        validate(tiny_teacher.model, w, torch.ones_like(w), io, CFG, "meta")
    with pytest.raises(_Sentinel):
        stop_requested(DistillJob("t", "s", CFG, "e", device="meta", stop=lambda: True), io)
    student = AutoModelForCausalLM.from_config(tiny_teacher.config)
    trainer = DistillStep(student, tiny_teacher.model, CFG, "cpu")
    trainer.device, trainer.world = "meta", 2
    with pytest.raises(_Sentinel):
        trainer.take_loss()
    assert seen == [torch.device("meta")] * 3


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero")


def test_a_step_reads_nothing_back_to_the_host(tiny_teacher, student_dir, monkeypatch):
    """On a GPU every read-back stalls the queue: the platform's own code reads nothing during a step
    (transformers' mask checks and the CPU-only eager MoE of the teacher do, outside this package)."""
    student = AutoModelForCausalLM.from_pretrained(student_dir).train()
    trainer = DistillStep(
        student, tiny_teacher.model, DistillConfig(**{**CFG.__dict__, "grad_accum": 2, "batch_size": 2}), "cpu"
    )
    ids = torch.randint(0, tiny_teacher.config.vocab_size, (2, 2, 32))
    ours = Path(__import__("m2d_ray").__file__).parent
    reads: collections.Counter = collections.Counter()
    import sys

    def spy(name, orig):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if Path(caller).is_relative_to(ours):
                reads[(name, caller)] += 1
            return orig(self, *args, **kwargs)

        return read

    def index(self, key):
        if (
            isinstance(key, torch.Tensor)
            and key.dtype == torch.bool
            and Path(sys._getframe(1).f_code.co_filename).is_relative_to(ours)
        ):
            reads[("boolean index", sys._getframe(1).f_code.co_filename)] += 1  # a nonzero() inside
        return getitem(self, key)

    getitem = torch.Tensor.__getitem__
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.Tensor, "__getitem__", index)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    for _ in range(2):
        trainer.step(list(ids))
    monkeypatch.undo()
    assert not reads, reads
    assert any(not torch.equal(before[k], v) for k, v in student.state_dict().items())  # it did train
    assert trainer.take_loss() > 0
