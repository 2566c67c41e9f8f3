"""The teacher sharded over a student's ranks (distill/sharded_teacher.py) on two gloo processes: the same loss as the
unsharded online teacher for every family and the d2d baseline's dense teacher (streamed from the checkpoint and
sharded from memory), with every loss, a temperature and expanded routing among the cases; no rank ever holds the
whole teacher, even while loading; a whole distillation reports what the unsharded one reports and resumes after a
kill at its checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from families import COMMON, FAMILIES, VOCAB, reinit_, tiny_model
from test_distill_ranks import CFG
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen3Config

from m2d_ray.config import DistillConfig
from m2d_ray.distill import sharded_teacher
from m2d_ray.distill.loop import DistillJob, WorkerIO, run_distill
from m2d_ray.distill.step import DistillStep
from m2d_ray.models import default_dense_teacher, default_teacher, load_distill_teacher
from workshop.local_group import join, spawn

#: per teacher, the loss settings its case runs (together: every loss, a temperature, expanded routing k')
SETTINGS = {
    "qwen3_moe": {"loss": "fkl"},
    "qwen2_moe": {"loss": "rkl", "temperature": 2.0},
    "mixtral": {"loss": "fkl+mse"},
    "olmoe": {"loss": "fkl", "teacher_topk": 4},
    "deepseek_v2": {"loss": "rkl", "teacher_topk": 3},
    "deepseek_v3": {"loss": "fkl", "temperature": 0.5},
    "gpt_oss": {"loss": "fkl+mse", "teacher_topk": 8},
    "dense": {"loss": "fkl", "temperature": 2.0},
}
STEP = DistillConfig(lr=3e-3, warmup_steps=1, steps=2, seq_len=16, loss_chunk=8, deepspeed=False)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory) -> Path:
    """Every family's tiny teacher and a tiny dense one (the d2d baseline's kind), saved with a tokenizer, and one
    dense student of the families' hidden size and vocabulary."""
    from m2d_ray.data.synthetic import build_tokenizer

    root, tok = tmp_path_factory.mktemp("sharded"), build_tokenizer()
    dense = Qwen3Config(**COMMON, intermediate_size=96, num_hidden_layers=2, head_dim=16)
    models = {f.id: tiny_model(f) for f in FAMILIES}
    models["dense"] = AutoModelForCausalLM.from_config(dense)
    reinit_(models["dense"], 1)
    for name, model in models.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    student = AutoModelForCausalLM.from_config(Qwen3Config(**{**dense.to_dict(), "intermediate_size": 32}))
    reinit_(student, 2)
    student.save_pretrained(root / "student")
    return root


def _losses(rank: int, teacher, head, settings: dict, root: Path) -> list[float]:
    """Two DDP steps of the saved student against `teacher` on this rank's half of a fixed batch: each step's loss
    (averaged over ranks)."""
    cfg = DistillConfig(**{**STEP.__dict__, **settings})
    if cfg.teacher_topk is not None and teacher.adapter is not None:
        teacher.adapter.set_top_k(teacher.model, cfg.teacher_topk)
    student = AutoModelForCausalLM.from_pretrained(root / "student").train()
    trainer = DistillStep(student, teacher.model, cfg, "cpu", 2, head=head)
    ids = torch.randint(0, VOCAB, (2, 4, cfg.seq_len), generator=torch.Generator().manual_seed(7))
    out = []
    for step in range(2):
        trainer.step([ids[step, 2 * rank : 2 * rank + 2]])
        out.append(trainer.take_loss())
    return out


def _families_main(rank: int, world: int, port: int, root: str, out: str) -> None:
    """Per teacher: the unsharded online losses, then streamed and sharded, then loaded whole and sharded; and the
    most teacher bytes held at once while the streamed one loaded (every fully_shard call looked at)."""
    join(rank, world, port)
    root, held, shards = Path(root), [], {}
    real = sharded_teacher.fully_shard

    def spy(module, **kwargs):  # the unit about to be sharded is whole; every unit before it holds its shards
        whole = sum(p.numel() * p.element_size() for p in module.parameters() if not isinstance(p, DTensor))
        held.append(whole + sum(shards.values()))
        out = real(module, **kwargs)
        shards.update({id(p): p.to_local().numel() * p.element_size() for p in module.parameters()})
        return out

    sharded_teacher.fully_shard = spy
    result = {}
    try:
        for name, settings in SETTINGS.items():
            path = str(root / name)
            whole = load_distill_teacher(path)
            total = sum(p.numel() * p.element_size() for p in whole.model.parameters())
            ref = _losses(rank, whole, None, settings, root)
            held.clear()
            shards.clear()
            teacher, head = sharded_teacher.load_sharded(path, torch.float32, "cpu")
            streamed = _losses(rank, teacher, head, settings, root)
            loading_peak = max(held)
            local = sum(
                p.to_local().numel() * p.element_size() for p in teacher.model.parameters() if isinstance(p, DTensor)
            )
            whole = load_distill_teacher(path)
            head = whole.model.get_output_embeddings().weight.detach().clone()
            sharded_teacher.shard_loaded(whole.model, whole.model.base_model.layers, "cpu")
            loaded = _losses(rank, whole, head, settings, root)
            result[name] = {
                "ref": ref,
                "streamed": streamed,
                "loaded": loaded,
                "total": total,
                "local": local,
                "loading_peak": loading_peak,
            }
    finally:
        sharded_teacher.fully_shard = real
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_sharded_loss_equals_unsharded_for_every_family_and_the_dense_teacher(teachers, tmp_path):
    spawn(_families_main, 2, str(teachers), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert set(ranks[0]) == {f.id for f in FAMILIES} | {"dense"}
    for name in SETTINGS:
        for r in ranks:
            case = r[name]
            assert case["ref"][1] != pytest.approx(case["ref"][0], rel=1e-3), name  # the student moved: not trivial
            for how in ("streamed", "loaded"):
                assert case[how] == pytest.approx(case["ref"], rel=1e-5), (name, how)
            # half of every tensor (FSDP pads odd first dimensions: a few rows more)
            assert case["local"] <= 0.55 * case["total"], name
            assert case["loading_peak"] < case["total"], name  # never the whole teacher, even while loading
        assert ranks[0][name]["ref"] == ranks[1][name]["ref"]


# ---- a whole distillation: reports, resume -----------------------------------------------------------
RUN = DistillConfig(**{**CFG.__dict__, "batch_size": 2})  # test_distill_ranks' budget, 2 ranks x 2 sequences


def _run_main(rank: int, world: int, port: int, teacher: str, student: str, out: str) -> None:
    """Online unsharded, sharded, and sharded again from its step-2 checkpoint (a run killed after it)."""
    join(rank, world, port)
    out = Path(out)

    def job(name: str, shard: bool) -> DistillJob:
        return DistillJob(teacher, student, RUN, "synthetic:valid", out=str(out / name), shard_teacher=shard)

    try:
        runs = {}
        for name, shard in (("online", False), ("sharded", True)):
            reports: list[dict] = []

            def report(m, ckpt, name=name, reports=reports):
                reports.append(m)
                if name == "sharded" and m["step"] == 2 and rank == 0:
                    shutil.copytree(ckpt, out / "ckpt-2")

            run_distill(job(name, shard), WorkerIO(rank=rank, world=world, report=report))
            runs[name] = reports
        dist.barrier()
        resumed: list[dict] = []
        run_distill(
            job("resumed", True),
            WorkerIO(rank=rank, world=world, report=lambda m, c: resumed.append(m), restore=out / "ckpt-2"),
        )
        runs["resumed"] = resumed
    finally:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(runs))


@pytest.mark.parametrize("teacher", ["moe", "dense"])
def test_a_sharded_distillation_reports_as_online_and_resumes(teacher, tmp_path):
    """The embedded MoE teacher and its dense twin (the d2d baseline's kind): the same reports, step by step, and a
    run resumed from its step-2 checkpoint ends where the uninterrupted one did."""
    from m2d_ray.convert.initial import materialize
    from m2d_ray.weights import open_teacher

    name = default_teacher() if teacher == "moe" else default_dense_teacher()
    # the random-FFN student of the MoE teacher: the dense twin's vocabulary and width too
    student = materialize(open_teacher(default_teacher()), tmp_path / "init", baseline="random-ffn")
    spawn(_run_main, 2, name, str(student), str(tmp_path))
    for r in (0, 1):
        runs = json.loads((tmp_path / f"rank{r}.json").read_text())
        online, sharded, resumed = runs["online"], runs["sharded"], runs["resumed"]
        assert [m["step"] for m in sharded] == [2, 4] and [m["step"] for m in resumed] == [4]
        assert online[-1]["val_ppl"] < online[0]["val_ppl_initial"]  # it trained
        for a, b in zip(sharded, online):
            for key in ("train_loss", "val_loss"):
                assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a["step"])
        for key in ("train_loss", "val_loss", "val_ppl"):
            assert resumed[0][key] == pytest.approx(sharded[-1][key], rel=1e-5), key
        assert sharded[-1]["teacher_active_params"] == online[-1]["teacher_active_params"]
