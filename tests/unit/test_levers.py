"""Every lever of a fast stage-2 step changes nothing in the loss trajectory beyond bf16-mixed's own spread (the same
step in float32 against bf16-mixed, on the same student and batches): activation checkpointing selective (per op)
and full against none, and the decoder layers compiled one by one (AOT autograd's capture, without inductor's code
generation: minutes on two cores) against eager. Each is shown at work too: a lever that silently did nothing would
pass a trajectory test."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from m2d_ray.config import DistillConfig
from m2d_ray.distill import checkpointing
from m2d_ray.distill.precision import PRECISIONS
from m2d_ray.distill.step import DistillStep
from workshop.random_models import STEP_PRESETS, teacher_and_student

P = STEP_PRESETS["smoke"]
STEPS = 6


def _trajectory(policy: str = "none", precision: str = "bf16-mixed", compile: bool = False) -> list[float]:
    """Six steps of the platform's plain one-rank step from the same random student on the same batches."""
    torch.manual_seed(0)
    pr = PRECISIONS[precision]
    teacher, student = teacher_and_student(P, pr.dtype)
    checkpointing.apply(student, policy)
    student.train()
    cfg = DistillConfig(
        steps=STEPS, warmup_steps=2, batch_size=P["batch"], seq_len=P["seq_len"], lr=1e-3, deepspeed=False
    )
    trainer = DistillStep(
        student, teacher.model, dataclasses.replace(cfg, checkpointing=policy, compile=compile), "cpu", precision=pr
    )
    g, out = torch.Generator().manual_seed(1), []
    for _ in range(STEPS):
        trainer.step([torch.randint(0, P["vocab"], (P["batch"], P["seq_len"]), generator=g)])
        out.append(trainer.take_loss())
    return out


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) / (sum(map(abs, b)) / len(b))


@pytest.fixture(scope="module")
def base() -> list[float]:
    return _trajectory()


@pytest.fixture(scope="module")
def spread(base) -> float:
    """bf16-mixed's own spread: its trajectory against the same step in float32."""
    gap = _gap(_trajectory(precision="fp32"), base)
    assert gap > 0
    return gap


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_checkpointing_trains_the_same_numbers(policy, base, spread, monkeypatch):
    calls = []
    policy_fn = checkpointing.sac_policy

    def counted(ctx, op, *args, **kwargs):
        calls.append(policy_fn(ctx, op, *args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(checkpointing, "sac_policy", counted)
    assert _gap(_trajectory(policy), base) <= spread
    if policy == "selective":  # the per-op policy decided: matmul outputs kept, the rest recomputed
        assert CheckpointPolicy.MUST_SAVE in calls and CheckpointPolicy.PREFER_RECOMPUTE in calls
    else:
        assert not calls


def test_checkpointing_marks_every_decoder_layer_and_none_marks_none():
    _, student = teacher_and_student(P, torch.float32)
    layers = checkpointing.decoder_layers(student)
    assert len(layers) == P["layers"] and not any(layer.gradient_checkpointing for layer in layers)
    checkpointing.apply(student, "full")
    assert all(layer.gradient_checkpointing for layer in layers)
    _, cpu = teacher_and_student(P, torch.float32)  # auto where no plan decided it: none on a CPU, full on a GPU
    assert checkpointing.apply(cpu, "auto", "cpu") == "none" and checkpointing.without_plan("cuda") == "full"
    assert not any(layer.gradient_checkpointing for layer in checkpointing.decoder_layers(cpu))


@pytest.mark.parametrize("policy", ["none", "selective"])
def test_layers_compiled_one_by_one_train_the_same_numbers(policy, base, spread, compiled_graphs):
    """distill.compile compiles each decoder layer (one graph, reused by the others) with its checkpoint inside,
    and leaves the head and the KL eager (their matmuls are in no graph)."""
    assert _gap(_trajectory(policy, compile=True), base) <= spread
    assert compiled_graphs, "nothing was compiled"
    vocab_sized = [
        n
        for gm in compiled_graphs
        for n in gm.graph.nodes
        if "example_value" in n.meta
        and isinstance(n.meta["example_value"], torch.Tensor)
        and P["vocab"] in n.meta["example_value"].shape
    ]
    assert not vocab_sized, vocab_sized  # no [tokens x vocabulary] tensor inside a compiled layer: the head is eager


def test_adamw_steps_the_float32_masters_fused_and_one_foreach_pass_writes_them_back(monkeypatch):
    """bf16-mixed on the plain path: AdamW's fused implementation (one kernel over every tensor) steps the float32
    masters, and the masters are rounded into the bfloat16 model in one foreach pass a step."""
    pr = PRECISIONS["bf16-mixed"]
    teacher, student = teacher_and_student(P, pr.dtype)
    cfg = DistillConfig(steps=2, warmup_steps=1, batch_size=P["batch"], seq_len=P["seq_len"], deepspeed=False)
    trainer = DistillStep(student, teacher.model, dataclasses.replace(cfg, checkpointing="none"), "cpu", precision=pr)
    assert trainer.opt.defaults["fused"] is True
    stepped = [p for g in trainer.opt.param_groups for p in g["params"]]
    assert stepped and all(p.dtype == torch.float32 for p in stepped)
    assert {p.dtype for p in student.parameters()} == {torch.bfloat16}
    copies = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: copies.append(len(dst)) or real(dst, src))
    trainer.step([torch.randint(0, P["vocab"], (P["batch"], P["seq_len"]))])
    assert copies == [len(stepped)]


def test_the_attention_implementation_trains_the_same_numbers(base, spread, monkeypatch):
    """The attention lever on the CPU: transformers' eager attention against SDPA (the default) on the same student;
    a GPU adds FlashAttention-2 where flash-attn is installed (the acceptance call's paper part)."""
    real = teacher_and_student

    def eager(p, dtype, device=None):
        teacher, student = real(p, dtype, device)
        student.set_attn_implementation("eager")
        return teacher, student

    monkeypatch.setattr(sys.modules[__name__], "teacher_and_student", eager)
    assert _gap(_trajectory(), base) <= spread


def test_the_student_s_attention_is_the_one_measured_fastest_on_the_same_card(monkeypatch):
    """distill/gpu.py: the measured implementation on the card it was measured on, where it can run; else
    FlashAttention-2 when flash-attn is installed, else SDPA."""
    import importlib.util

    from m2d_ray import measured
    from m2d_ray.distill import gpu

    def with_entry(entry: dict, card: str, flash: bool) -> str:
        monkeypatch.setattr(measured, "gpu", lambda: dataclasses.replace(real(), attention=entry))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: card)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if flash else None)
        return gpu.attention_implementation()

    real = measured.gpu
    sdpa = {"implementation": "sdpa", "device": "NVIDIA H200"}
    assert with_entry(sdpa, "NVIDIA H200", flash=True) == "sdpa"  # measured faster there, though flash-attn is here
    assert with_entry(sdpa, "NVIDIA H100 80GB HBM3", flash=True) == "flash_attention_2"  # another card
    fa2 = {"implementation": "flash_attention_2", "device": "NVIDIA H200"}
    assert with_entry(fa2, "NVIDIA H200", flash=False) == "sdpa"  # cannot run here
    assert with_entry({}, "NVIDIA H200", flash=False) == "sdpa"


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_a_compiled_checkpointed_layer_is_one_graph_with_the_checkpoint_inside(policy):
    """Compile and checkpoint compose as torchtitan's do (distill.checkpointing.compile_layers): the checkpoint inside,
    the compile outside. On a 2-layer Qwen3 (AOT autograd's capture, aot_eager: inductor's code generation takes
    minutes on two cores) Dynamo breaks no graph in a decoder layer (transformers 5.25's forward side effect broke it
    at the checkpoint: the layer ran eagerly), the checkpoint is traced as its operator, SAC's policy is applied at
    trace time (the forward graph saves fewer tensors under selective than none, more than under full), and the
    loss and gradients are eager's within 1e-4 / 1e-3 in float32."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(1)
    saved = {}
    for pol in ("none", "selective", "full") if policy == "selective" else (policy,):
        cfg = Qwen3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        torch.manual_seed(0)
        eager = Qwen3ForCausalLM(cfg).float().train()
        checkpointing.apply(eager, pol)
        compiled = Qwen3ForCausalLM(cfg).float().train()
        compiled.load_state_dict(eager.state_dict())
        checkpointing.apply(compiled, pol)
        graphs, forwards = [], []

        def fw(gm, example_inputs):
            forwards.append(gm)
            return make_boxed_func(gm.forward)

        aot = aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, ex: make_boxed_func(gm.forward))

        def backend(gm, example_inputs):
            graphs.append(gm)
            return aot(gm, example_inputs)

        torch._dynamo.reset()
        counters.clear()
        assert checkpointing.compile_layers(compiled, backend) == 2
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        losses = []
        for model in (eager, compiled):
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            losses.append(out.loss.detach())
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert graphs and all(len(forwards) >= 1 for _ in graphs)
        hops = {str(n.target) for g in graphs for n in g.graph.nodes if "checkpoint" in str(n.target)}
        assert hops == (set() if pol == "none" else {"tag_activation_checkpoint"}), hops
        assert (losses[0] - losses[1]).abs() <= 1e-4 * losses[0].abs()
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            assert (a.grad - b.grad).abs().max() <= 1e-3 * a.grad.abs().max() + 1e-12, name
        saved[pol] = len(list(forwards[0].graph.nodes)[-1].args[0])  # the forward's outputs: what backward keeps
    if policy == "selective":
        assert saved["none"] > saved["selective"] > saved["full"], saved


def test_a_torch_that_cannot_compose_compile_and_checkpoint_says_so_and_the_table_marks_it(monkeypatch):
    """Without Dynamo's setting for a checkpointed forward's side effects (torch < 2.10) a checkpointed layer would
    break its graph and run eagerly: the lever says so in one line, and the GPU call's table marks the row."""
    from workshop.step_paths import compile_note, lever_figures

    assert checkpointing.compose_problem() is None and compile_note(["lever:compile"], "selective") is None
    monkeypatch.setattr(checkpointing, "SIDE_EFFECTS", "a_setting_this_torch_lacks")
    line = checkpointing.compose_problem()
    assert "lacks torch._dynamo.config.a_setting_this_torch_lacks" in line and "\n" not in line
    assert compile_note(["lever:compile"], "none") is None  # nothing checkpointed: nothing to compose
    note = compile_note(["platform", "lever:compile"], "full")
    assert note == line
    row = lever_figures({"platform_tokens_per_s": 1.0, "tokens_per_s": {}, "compile_note": note})
    assert row == f"COMPILE DID NOT COMPOSE WITH CHECKPOINTING: {line}"
