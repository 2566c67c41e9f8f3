"""Stage 3 at real scale (issue 25): which models shard over how many GPUs, and which batch size, from
fake device sizes (CPU only; no GPU, no weights read: sizes come from configs on the meta device)."""

from __future__ import annotations

import pytest

from m2d_ray.errors import M2DError
from m2d_ray.evaluate.placement import GiB, ModelSize, hflm_kwargs, model_size, plan_eval
from m2d_ray.evaluate.runner import check_stage3, parse_batch
from m2d_ray.shipped import EXPERIMENTS

GB80 = 80 * 10**9  # an H100's 80 GB (79.6 GiB as CUDA reports it, near enough)


def qwen3_30b_a3b():
    """Qwen3-30B-A3B's published config (48 layers, d 2048, 128 experts x 768, top-8, vocab 151,936)."""
    from m2d_ray.models import model_config

    return model_config(str(EXPERIMENTS / "configs" / "Qwen--Qwen3-30B-A3B"))


def qwen3_student():
    """Its K = k dense student: a Qwen3 of FFN width 8 x 768 = 6,144, as the adapter shapes it."""
    from m2d_ray.arch.qwen3_moe import Qwen3MoeAdapter

    return Qwen3MoeAdapter().student_config(qwen3_30b_a3b(), 8 * 768)


@pytest.fixture(scope="module")
def teacher():
    return model_size(qwen3_30b_a3b())


@pytest.fixture(scope="module")
def student():
    return model_size(qwen3_student())


def test_sizes_from_the_config_alone(teacher, student):
    assert teacher.params == pytest.approx(30.53e9, rel=0.005)  # stack-notes: 30.53B, 56.9 GiB in bf16
    assert teacher.weights / GiB == pytest.approx(56.9, abs=0.1)
    assert student.params == pytest.approx(3.34e9, rel=0.01) and student.bytes_per_param == 2
    assert teacher.ffn == 8 * 768 and student.ffn == 6144
    # a 4096-token sequence of lm-eval: logits, log-softmax and the previous batch's (151,936 x 4,096 x 3 x 2 bytes =
    # 3.5 of 4.1 GiB)
    assert 4.0 < teacher.sequence_bytes(4096) / GiB < 4.2


def test_the_30b_teacher_is_sharded_over_two_80gb_gpus(teacher):
    p = plan_eval(teacher, GB80, gpus_per_node=8, batch_size=16)
    assert (p.gpus, p.shard) == (2, True)  # on one: 56.9 GiB leave room for one 4,096-token sequence only
    assert p.batch_size == p.max_batch_size == 8  # what fits beside half the weights (16 would not)
    one = plan_eval(teacher, GB80, gpus_per_node=1, batch_size=16)  # a node of one GPU: batch 1 there
    assert (one.gpus, one.shard, one.batch_size) == (1, False, 2)
    assert p.max_memory_per_gpu == pytest.approx(teacher.weights / 2 * 1.05, rel=1e-6)
    kw = hflm_kwargs(p)
    assert kw["parallelize"] is True and kw["max_memory_per_gpu"] == p.max_memory_per_gpu and kw["max_length"] == 4096


def test_the_30b_teacher_on_one_141gb_gpu_is_not_sharded(teacher):
    p = plan_eval(teacher, 141 * 10**9, gpus_per_node=8, batch_size="auto")
    assert (p.gpus, p.shard, p.batch_size) == (1, False, "auto") and p.max_batch_size >= 8
    assert "max_memory_per_gpu" not in hflm_kwargs(p) and hflm_kwargs(p)["max_batch_size"] == p.max_batch_size


def test_a_node_too_small_fails_with_one_line(teacher):
    with pytest.raises(
        M2DError,
        match=r"does not fit: 56\.9 GiB of weights .* 1 GPU\(s\) of 37 GiB.*use nodes with more or bigger GPUs",
    ):
        plan_eval(teacher, 40 * 10**9, gpus_per_node=1, what="teacher")
    p = plan_eval(teacher, 40 * 10**9, gpus_per_node=4)  # 4 x 40 GB: 4 GPUs hold the 4 sequences of MIN_BATCH
    assert (p.gpus, p.shard, p.batch_size) == (4, True, 4)
    assert (
        plan_eval(teacher, 40 * 10**9, gpus_per_node=3).batch_size == 3
    )  # with 3, the most sequences that fit (fewer than 4)
    assert plan_eval(teacher, 40 * 10**9, gpus_per_node=8).gpus == 4  # with 8, the fewest that hold 4 sequences


def test_the_student_fits_one_gpu_and_keeps_a_configured_fraction(student):
    p = plan_eval(student, GB80, gpus_per_node=8, batch_size=16)
    assert (p.gpus, p.shard, p.batch_size) == (1, False, 14)  # 16 asked, 14 fit beside 6.2 GiB at 4,096 tokens
    shared = plan_eval(student, GB80, gpus_per_node=8, batch_size=4, gpu_fraction=0.5)
    assert (shared.gpus, shared.shard, shared.batch_size) == (0.5, False, 4)  # 26 GiB left in half a GPU (6 sequences)
    whole = plan_eval(
        student, GB80, gpus_per_node=8, batch_size=4, gpu_fraction=0.25
    )  # a quarter holds 1 sequence, not 4
    assert (whole.gpus, whole.batch_size) == (1, 4)


def test_batch_from_a_budget_and_from_the_sequence_length(student):
    seq = student.sequence_bytes(4096)
    p = plan_eval(student, GB80, gpus_per_node=1, batch_size="auto", batch_memory=3 * seq)
    assert p.batch_size == "auto" and p.max_batch_size == 3
    short = plan_eval(student, GB80, gpus_per_node=1, batch_size=64, max_length=1024)
    assert short.batch_size == 58 > plan_eval(student, GB80, gpus_per_node=1, batch_size=64).batch_size


def test_cpu_never_shards_and_auto_uses_host_memory():
    tiny = ModelSize(
        params=4_400_000, bytes_per_param=4, vocab=4096, hidden=128, layers=4, kv_heads=2, head_dim=32, ffn=256
    )
    p = plan_eval(tiny, None, batch_size=16, max_length=1024)
    assert (p.gpus, p.shard, p.batch_size) == (0, False, 16)
    p = plan_eval(
        tiny, None, batch_size="auto", max_length=1024, host_bytes=tiny.weights + 5 * tiny.sequence_bytes(1024)
    )
    assert p.batch_size == 5


def test_the_wiki4_teacher_plan_from_its_directory():
    from m2d_ray.evaluate.runner import plan
    from tests.conftest import shared_path

    p = plan(str(shared_path("teachers", "qwen3moe-wiki4")), None, 0, 16)
    assert p.max_length == 1024 and p.batch_size == 16 and p.weights == pytest.approx(4.41e6 * 4, rel=0.01)


def test_stage3_settings_are_checked():
    from dataclasses import replace

    from m2d_ray.config import Stage3Config

    c = Stage3Config()
    check_stage3(replace(c, batch_size="auto", gpu_memory="80GB", batch_memory="20GiB"))
    assert parse_batch("auto") == "auto" and parse_batch(8) == 8
    for bad, frag in (
        (dict(batch_size=0), "positive integer or auto"),
        (dict(batch_size="big"), "positive integer or auto"),
        (dict(limit=0), "stage3.limit=0"),
        (dict(gpu_memory="lots"), "stage3.gpu_memory"),
    ):
        with pytest.raises(M2DError, match=frag):
            check_stage3(replace(c, **bad))


def test_stage3_placements_ask_ray_for_the_gpus_a_model_needs(monkeypatch, tmp_path):
    """Teacher and student directories (configs only): stage 3 gives the teacher two whole GPUs, sharded,
    and the student the configured share; a node too small fails before any task starts."""
    from dataclasses import replace

    from m2d_ray.config import Stage3Config
    from m2d_ray.evaluate import runner

    t, s = tmp_path / "teacher", tmp_path / "student"
    qwen3_30b_a3b().save_pretrained(t)
    qwen3_student().save_pretrained(s)
    c = replace(Stage3Config(), gpu_memory="80GB", gpus_per_node=8, batch_size="auto")
    monkeypatch.setattr(runner, "probe_gpus", lambda get=None: pytest.fail("sizes were configured: no probe"))
    places = runner.stage3_placements({"teacher": str(t), "do-acp-rr": str(s)}, c, 0.5)
    assert (places["teacher"].gpus, places["teacher"].shard) == (2, True)
    assert (places["do-acp-rr"].gpus, places["do-acp-rr"].shard, places["do-acp-rr"].batch_size) == (0.5, False, "auto")
    cpu = runner.stage3_placements({"do-acp-rr": str(s)}, replace(c, batch_size=16), 0)
    assert cpu["do-acp-rr"].gpus == 0 and not cpu["do-acp-rr"].shard
    monkeypatch.setattr(runner, "probe_gpus", lambda get=None: (40 * 10**9, 1))  # measured: one 40 GB GPU per node
    with pytest.raises(M2DError, match="stage-3 model teacher .* does not fit"):
        runner.stage3_placements({"teacher": str(t)}, replace(c, gpu_memory=None, gpus_per_node=None), 1)
