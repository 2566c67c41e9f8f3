"""The exact KL's kernels (distill.kl_kernel) held to chunked: the compiled student's trajectory on the CPU, Liger
Kernel's glue (its beta, temperature and mean) against a float64 reference of its documented loss, and auto's choice.
Liger's Triton kernels themselves run only on a GPU: the acceptance call compares their trajectories there."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from m2d_ray import measured
from m2d_ray.config import DistillConfig
from m2d_ray.distill import kernels
from m2d_ray.distill.losses import chunked_kl, naive_kl
from m2d_ray.distill.step import DistillStep
from m2d_ray.distill.targets import parse_targets
from m2d_ray.errors import M2DError
from workshop.random_models import STEP_PRESETS, teacher_and_student


def _trajectory(kernel: str, steps: int = 6, compile: bool = False) -> list[float]:
    p = STEP_PRESETS["smoke"]
    torch.manual_seed(0)
    teacher, student = teacher_and_student(p, torch.float32)
    cfg = DistillConfig(
        steps=steps, warmup_steps=2, batch_size=p["batch"], seq_len=p["seq_len"], lr=1e-3, deepspeed=False
    )
    trainer = DistillStep(student, teacher.model, dataclasses.replace(cfg, kl_kernel=kernel, compile=compile), "cpu")
    g, out = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        trainer.step([torch.randint(0, p["vocab"], (p["batch"], p["seq_len"]), generator=g)])
        out.append(trainer.take_loss())
    return out


def _gap(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) / (sum(map(abs, b)) / len(b))


def test_the_compiled_students_trajectory_is_chunkeds(compiled_graphs):
    """torch.compile's capture of the student's decoder layers (dynamo and AOT autograd, a layer at a time; the head
    and the chunked KL eager) trains the same numbers; the default suite skips inductor's code generation (minutes on
    two cores: the slow test below and the GPU acceptance call run it). AOT autograd runs the same ops, so the
    trajectory may agree to the bit: the recorded graphs show that the layers were compiled."""
    chunked = _trajectory("chunked")
    assert _gap(_trajectory("chunked", compile=True), chunked) < 1e-4 and compiled_graphs


@pytest.mark.slow
def test_the_inductor_compiled_students_trajectory_is_chunkeds():
    assert _gap(_trajectory("chunked", compile=True), _trajectory("chunked")) < 1e-4


def _liger_reference(h_s, w_s, h_t, w_t, labels, beta, ignore_index, t, accum_dtype=None):
    """Liger's fused linear JSD as its docs define it, in float64: the mean over tokens of KL(teacher || student)
    (beta 0) or KL(student || teacher) (beta 1) between softmax(h @ w.T / t)."""
    assert labels is None and ignore_index == -100 and accum_dtype == torch.float32
    ls = torch.log_softmax((h_s.double() @ w_s.double().T) / t, -1)
    lt = torch.log_softmax((h_t.double() @ w_t.double().T) / t, -1)
    p, lp, lq = (lt.exp(), lt, ls) if beta == 0.0 else (ls.exp(), ls, lt)
    return (p * (lp - lq)).sum(-1).mean().float()


@pytest.mark.parametrize("kind", ["fkl", "rkl"])
def test_the_liger_glue_is_chunkeds_loss_and_gradient(monkeypatch, kind):
    """Beta 0 / 1 for the forward / reverse KL, the t^2 chunked_kl applies, the arguments in Liger's order: with
    Liger's loss stood in by its definition, the kernel's value and gradients are chunked_kl's at t = 2."""
    fake = types.ModuleType("liger_kernel.transformers.functional")
    fake.liger_fused_linear_jsd = _liger_reference
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", fake)
    g = torch.Generator().manual_seed(0)
    h_s, w_s = torch.randn(9, 8, generator=g), torch.randn(33, 8, generator=g)
    h_t, w_t = torch.randn(9, 6, generator=g), torch.randn(33, 6, generator=g)
    grads = []
    for kl in (kernels.liger_kl, chunked_kl):
        a, b = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
        loss = kl(a, b, h_t, w_t, kind=kind, temperature=2.0, chunk=4)
        loss.backward()
        grads.append((loss.detach(), a.grad, b.grad))
    for x, y in zip(*grads):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)
    assert grads[1][0] == pytest.approx(float(naive_kl(h_s @ w_s.T, h_t @ w_t.T, kind, 2.0)), rel=1e-4)


def _measured(monkeypatch, kernel: str, **at) -> None:
    """measured_gpu.json's online kernel `kernel`, measured at `at` (default: forward KL, t = 1, one plain rank, 4096
    tokens a micro-batch (P7-head's), on the card the tests pretend to have); the card's name comes through the seam
    `kernels.device_name`."""
    m = measured.gpu()
    entry = {"kernel": kernel, "device": "NVIDIA H200", "loss": "fkl", "temperature": 1.0, "path": "plain"}
    entry = {k: v for k, v in {**entry, "tokens": 4096, **at}.items() if v is not None}  # None: not recorded
    monkeypatch.setattr(measured, "gpu", lambda: dataclasses.replace(m, kl_kernel={"online": entry}))
    monkeypatch.setattr(kernels, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))  # liger runs "here"
    monkeypatch.setattr(kernels, "installed_version", lambda dist: "0.8.5")


def test_auto_is_chunked_on_a_cpu_and_the_measured_choice_on_a_gpu(monkeypatch):
    assert kernels.kl_kernel("auto", "cpu").name == "chunked"
    _measured(monkeypatch, "liger")
    at = kernels.Where(tokens=4096)
    assert kernels.kl_kernel("auto", "cuda", where=at).name == "liger"
    assert kernels.kl_kernel("auto", "cuda", parse_targets("hidden"), at).name == "chunked"  # a mode not measured
    assert kernels.kl_kernel("auto", "cuda").name == "chunked"  # a caller that does not say its tokens
    _measured(monkeypatch, "compiled")  # an older file's choice: compiling is distill.compile's, not auto's
    assert kernels.kl_kernel("auto", "cuda", where=at).name == "chunked"


@pytest.mark.parametrize(
    "where, device, said",
    [
        (kernels.Where("rkl", tokens=4096), "NVIDIA H200", "loss fkl, this run is loss rkl"),
        (kernels.Where(temperature=2.0, tokens=4096), "NVIDIA H200", "temperature 1.0, this run is temperature 2.0"),
        (kernels.Where.of("fkl", 1.0, True, 8, 4096), "NVIDIA H200", "path plain, this run is path deepspeed"),
        (kernels.Where.of("fkl", 1.0, False, 2, 4096), "NVIDIA H200", "path plain, this run is path ddp"),
        (kernels.Where.of("fkl", 1.0, False, 1, 8 * 2048), "NVIDIA H200", "tokens 4096, this run is tokens 16384"),
        (kernels.Where(tokens=4096), "NVIDIA A100-SXM4-80GB", "device NVIDIA H200, this run is device NVIDIA A100"),
    ],
)
def test_auto_uses_the_measured_kernel_only_where_it_was_measured(monkeypatch, capsys, where, device, said):
    """A kernel's speed and its agreement with chunked were measured at one device, loss, temperature, path and
    micro-batch size (Liger sizes its chunk by the tokens it is given: 64 at Qwen3's head and 4096 tokens, 256 at
    the paper's 16,384): anywhere else auto is chunked, said in one line (the device's name through the seam: no
    CUDA here)."""
    _measured(monkeypatch, "liger")
    assert kernels.kl_kernel("auto", "cuda", where=kernels.Where(tokens=4096)).name == "liger"  # the same tokens
    monkeypatch.setattr(kernels, "device_name", lambda d: device)
    assert kernels.kl_kernel("auto", "cuda", where=where).name == "chunked"
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if "distill.kl_kernel=auto" in ln]
    assert len(lines) == 1 and said in lines[0] and lines[0].endswith("using chunked"), lines


def test_a_measurement_that_did_not_record_its_tokens_matches_no_run(monkeypatch, capsys):
    """measured_gpu.json from before tokens were recorded: auto is chunked, said in one line naming tokens."""
    _measured(monkeypatch, "liger", tokens=None)
    assert kernels.kl_kernel("auto", "cuda", where=kernels.Where(tokens=4096)).name == "chunked"
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if "distill.kl_kernel=auto" in ln]
    assert len(lines) == 1 and "tokens unrecorded, this run is tokens 4096" in lines[0], lines


def test_the_packaged_measurements_record_their_tokens():
    assert all(e.get("tokens") == 4096 for e in measured.gpu().kl_kernel.values())  # P7-head's micro-batch


def test_the_step_tells_auto_its_loss_temperature_and_path(monkeypatch, capsys):
    """DistillStep hands kl_kernel the run's loss, temperature and path (a DeepSpeed run is not the plain one P7
    measured)."""
    seen = []
    real = kernels.kl_kernel
    monkeypatch.setattr(
        "m2d_ray.distill.step.kl_kernel", lambda n, d, t=None, where=None: seen.append(where) or real(n, d, t, where)
    )
    teacher, student = teacher_and_student(STEP_PRESETS["smoke"], torch.float32)
    cfg = DistillConfig(steps=1, warmup_steps=1, batch_size=1, seq_len=8, loss="rkl", temperature=2.0, deepspeed=False)
    DistillStep(student, teacher.model, cfg, "cpu")
    assert seen == [kernels.Where("rkl", 2.0, "plain", 8)]  # batch_size x seq_len


def test_a_liger_older_than_the_glue_needs_is_one_line(monkeypatch):
    """liger_fused_linear_jsd's accum_dtype (the head's gradient summed in float32) came in liger-kernel 0.8.5."""
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setattr(kernels, "installed_version", lambda dist: "0.8.1")
    why = kernels.KL_KERNELS["liger"].unavailable("cuda")
    assert why == "needs liger-kernel >= 0.8.5 (found 0.8.1; pip install 'liger-kernel>=0.8.5')"
    with pytest.raises(M2DError, match=r"distill.kl_kernel=liger: needs liger-kernel >= 0\.8\.5 \(found 0\.8\.1"):
        kernels.kl_kernel("liger", "cuda")
    monkeypatch.setattr(kernels, "installed_version", lambda dist: "0.8.5")
    assert kernels.KL_KERNELS["liger"].unavailable("cuda") is None


def test_liger_on_a_torch_whose_cuda_addmm_refuses_its_float32_sum_is_one_line(monkeypatch):
    """Liger 0.8.5 sums its float32 grad_weight with addmm(out_dtype=, out=) from torch 2.8; CUDA takes that only from
    torch 2.10 (the crash numerics.py gates): below it liger is refused, and auto falls back to chunked."""
    from m2d_ray import numerics

    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setattr(kernels, "installed_version", lambda dist: "0.8.5")
    monkeypatch.setattr(numerics, "TORCH_VERSION", (2, 9))
    why = kernels.KL_KERNELS["liger"].unavailable("cuda")
    assert why.startswith("needs torch >= 2.10 (found ") and "crashes on CUDA" in why
    with pytest.raises(M2DError, match=r"distill.kl_kernel=liger: needs torch >= 2\.10"):
        kernels.kl_kernel("liger", "cuda")


def test_a_measured_kernel_that_cannot_run_here_falls_back_to_chunked_with_one_line(monkeypatch, capsys):
    _measured(monkeypatch, "liger")
    missing = dataclasses.replace(kernels.KL_KERNELS["liger"], needs="no_such_module_m2d (pip install it)")
    monkeypatch.setitem(kernels.KL_KERNELS._items, "liger", missing)
    assert kernels.kl_kernel("auto", "cuda", where=kernels.Where(tokens=4096)).name == "chunked"
    out = capsys.readouterr()
    assert "liger (the measured choice) needs no_such_module_m2d" in out.out + out.err


def test_a_kernel_asked_for_that_cannot_run_here_is_one_line():
    with pytest.raises(M2DError, match="distill.kl_kernel=liger: runs on CUDA devices only; use chunked"):
        kernels.kl_kernel("liger", "cpu")
    with pytest.raises(M2DError, match="unknown distill.kl_kernel 'ligr'; did you mean 'liger'"):
        kernels.kl_kernel("ligr", "cpu")


def test_every_kernel_is_a_registry_entry_with_its_own_description():
    assert list(kernels.KL_KERNELS) == ["chunked", "liger"]
    doc = kernels.__doc__
    assert all(f"    {name}" in doc for name in kernels.KL_KERNELS)


def test_compiling_the_student_is_a_setting_and_the_old_kernel_name_reads_as_it(tmp_path, capsys):
    """distill.compile is its own key (with any kernel); kl_kernel=compiled, the name of earlier versions, is read as
    chunked with compile on, said in one line, and a measured choice of it is chunked under auto."""
    from m2d_ray.config import load_config

    assert DistillConfig().compile is False
    old = DistillConfig(kl_kernel="compiled")
    assert (old.kl_kernel, old.compile) == ("chunked", True)
    assert dataclasses.replace(DistillConfig(), kl_kernel="compiled").compile
    cfg = load_config(None, ["distill.kl_kernel=compiled"])
    assert (cfg.distill.kl_kernel, cfg.distill.compile) == ("chunked", True)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "distill.kl_kernel=chunked distill.compile=true" in err
    assert "compiled" not in kernels.KL_KERNELS
