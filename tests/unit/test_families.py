"""Every MoE family read from its layer's structure (m2d_ray/arch/families.py), one tiny teacher each, built from the
family's own config class (tests/families.py: tiny_config):

(a) the routing the adapter reads (the block's own router, up to its experts call), the experts in their canonical
    layout with the module's own activation, and the shared expert reproduce the block's output;
(b) the whole conversion (calibration statistics, a plan at K = k, the student built, exported and checked against
    the method's float64 reference by export_student) gives a student that loads with AutoModelForCausalLM as the
    teacher's class;
(c) the lazy teacher reads every tensor of a saved checkpoint as from_pretrained loads it (the checkpoint names
    from transformers' conversion mapping);
(d) the families the method cannot express are refused in one line naming why; a config-only family is found by
    the class transformers builds for it.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from families import MULTIMODAL, TINY_EXTRA, tiny_config, tiny_multimodal, tiny_structured
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText

from m2d_ray.arch import auto_class, family_of, get_adapter
from m2d_ray.arch.base import expert_outputs, rel_error
from m2d_ray.arch.deepseek_v4 import FAMILY as DEEPSEEK_V4
from m2d_ray.arch.families import FAMILIES
from m2d_ray.arch.gemma4 import FAMILY as GEMMA4
from m2d_ray.arch.llama4 import FAMILY as LLAMA4
from m2d_ray.arch.meta import param_counts
from m2d_ray.arch.refused import CANNOT, older_release
from m2d_ray.calibrate.collect import collect_stats
from m2d_ray.calibrate.stream import collect_stats_streamed
from m2d_ray.checkpoint import Checkpoint
from m2d_ray.convert.build import build_from_plan
from m2d_ray.convert.export import export_student
from m2d_ray.convert.plan import make_plan
from m2d_ray.errors import M2DError
from m2d_ray.models import Teacher
from m2d_ray.plan.shapes import models_of
from m2d_ray.weights import LazyTeacher, skeleton

#: every family's tiny teacher, but the language models transformers builds only inside their vision-language model
INSIDE_VLM = {"qwen3_vl_moe_text"}
TYPES = [
    f.model_type
    for f in (*FAMILIES, LLAMA4, GEMMA4, DEEPSEEK_V4)
    if f.model_type in CONFIG_MAPPING and f.model_type not in INSIDE_VLM and older_release(f.model_type) is None
]
#: config-only families transformers builds with another family's class
BY_CLASS = {
    t: c
    for t, c in {"sarvam_mla": "deepseek_v3", "sarvam_moe": "glm4_moe", "param2moe": "glm4_moe"}.items()
    if t in CONFIG_MAPPING and older_release(c) is None  # the installed transformers' (5.25 has them all)
}


@pytest.fixture(scope="module", params=TYPES + sorted(BY_CLASS))
def teacher(request):
    torch.manual_seed(0)
    adapter = get_adapter(tiny_config(request.param, **TINY_EXTRA.get(request.param, {})))
    model = tiny_structured(request.param, dtype=adapter.exact_dtype)
    return request.param, Teacher(name=request.param, model=model, tokenizer=None, adapter=adapter)


@torch.no_grad()
def test_block_parity(teacher):
    """sum over the chosen experts of weight x f_e(h), plus the shared expert, is the block's own output."""
    name, t = teacher
    if t.adapter.approximation:
        pytest.skip(f"{name}'s student approximates its blocks: measured in the test below")
    adapter, model = t.adapter, t.model
    blocks = adapter.moe_blocks(model)
    assert blocks and all(adapter.experts(b).num_experts == adapter.num_experts(model.config) for b in blocks.values())
    d = model.config.hidden_size
    for i, block in blocks.items():
        gen = torch.Generator().manual_seed(i)
        h = torch.randn(2, 7, d, generator=gen, dtype=adapter.exact_dtype)
        ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=gen)  # read by a block that hashes them
        flat = h.reshape(-1, d)
        r = adapter.route(block, flat, ids.reshape(-1))
        assert r.index.shape[1] == adapter.top_k(model.config)
        torch.testing.assert_close(r.probs.sum(-1), torch.ones(flat.shape[0]), rtol=0, atol=1e-5)
        out = expert_outputs(adapter.experts(block), adapter.expert_input(block, flat))
        y = (r.weight[..., None].to(out.dtype) * out[r.index, torch.arange(flat.shape[0])[:, None]]).sum(1)
        shared = adapter.shared(block)
        if shared is not None:
            y = y + shared.scale(flat)[:, None] * expert_outputs(shared.weights, flat)[0]
        err = rel_error(y, adapter.block_output(block, h, ids).reshape(-1, d))
        assert err < adapter.exact_tol, f"layer {i}: {err:.2e}"


def test_conversion_is_exact_and_loads_as_the_teachers_class(teacher, tmp_path):
    """The method end to end at K = k: export_student checks every FFN against the float64 reference."""
    name, t = teacher
    ids = torch.randint(0, t.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    stats = collect_stats(t.model, t.adapter, ids, torch.ones_like(ids), progress=False)
    plan = make_plan(t, stats, "do-acp", "oc", "uniform", t.adapter.top_k(t.config))
    record = export_student(build_from_plan(t, plan), None, tmp_path / "s", teacher=t, plan=plan)
    assert record["max_rel_error"] < t.adapter.exact_tol
    student = auto_class(t.config).from_pretrained(tmp_path / "s", experts_implementation="eager")
    assert type(student).__name__ == type(t.model).__name__
    with torch.no_grad():
        assert torch.isfinite(student(ids).logits).all()


def test_lazy_reads_equal_the_loaded_model(teacher, tmp_path):
    name, t = teacher
    t.model.save_pretrained(tmp_path)
    lazy = LazyTeacher(
        name=str(tmp_path),
        config=t.config,
        tokenizer=None,
        adapter=t.adapter,
        skeleton=skeleton(t.config, t.dtype),
        checkpoint=Checkpoint(tmp_path),
    )
    state = t.model.state_dict()
    for n, v in state.items():
        assert torch.equal(lazy.tensor(n), v), n


@pytest.mark.parametrize("model_type", sorted(t for t in CANNOT if t in CONFIG_MAPPING))
def test_families_the_method_cannot_express_are_refused_by_name(model_type):
    with pytest.raises(M2DError) as err:
        get_adapter(CONFIG_MAPPING[model_type]())
    message = str(err.value)
    assert model_type in message and "cannot be converted" in message and "did you mean" not in message
    assert "\n" not in message


@pytest.mark.parametrize("model_type", sorted(BY_CLASS))
def test_a_config_only_family_is_found_by_its_class(model_type):
    assert family_of(CONFIG_MAPPING[model_type]()) == BY_CLASS[model_type]


def test_a_config_without_a_field_its_class_derives_converts(tmp_path):
    """A qwen3_moe config.json without head_dim (the modelling code derives hidden // heads) gives a student of the
    same attention, not one with Qwen3's default head_dim of 128 (a state-dict mismatch, exit 1, before)."""
    from transformers import Qwen3MoeConfig

    full = tiny_config("qwen3_moe", hidden_size=64, num_attention_heads=4, head_dim=16).to_dict()
    full.pop("head_dim")
    config = Qwen3MoeConfig(**{k: v for k, v in full.items() if k not in ("model_type", "transformers_version")})
    assert not hasattr(config, "head_dim") or config.head_dim in (None, 16)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager").eval()
    t = Teacher(name="no-head-dim", model=model, tokenizer=None, adapter=get_adapter(config))
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    plan = make_plan(
        t, collect_stats(model, t.adapter, ids, torch.ones_like(ids), progress=False), "sf", "rr", "uniform", 2
    )
    record = export_student(build_from_plan(t, plan), None, tmp_path / "s", teacher=t, plan=plan)
    assert record["max_rel_error"] < 1e-10


def test_the_plan_counts_the_family_and_its_student(teacher):
    """m2d plan --model DIR: the teacher counted as built (on the meta device where arch/counts.py has no arithmetic)
    and the student the conversion builds planned no larger than its teacher."""
    _, t = teacher
    assert param_counts(t.config).params == sum(p.numel() for p in t.model.parameters())
    models = models_of(t.config)
    assert 0 < models.student.params < models.teacher.params
    assert models.teacher.moe_layers == len(t.adapter.moe_blocks(t.model))


#: the streamed pass in the default run for one family of each kind (Mamba layers, linear attention, MLA, a one-expert
#: student, a refused one); every family with M2D_SLOW=1
STREAMED_DEFAULT = {"jamba", "qwen3_next", "glm4_moe_lite", "minimax", "nemotron_h"}


@pytest.mark.parametrize(
    "model_type",
    [pytest.param(t, marks=() if t in STREAMED_DEFAULT else pytest.mark.slow) for t in sorted(TYPES)],
)
def test_layer_streamed_calibration_equals_the_whole_pass(model_type, tmp_path):
    """calibrate.stream: one decoder layer at a time from the checkpoint gives the whole pass's statistics, or, for a
    family whose layers read another layer's state, one line before any work."""
    model = tiny_structured(model_type, dtype=torch.float32)
    adapter = get_adapter(model.config)
    model.save_pretrained(tmp_path)
    lazy = LazyTeacher(
        str(tmp_path), model.config, None, adapter, skeleton(model.config, torch.float32), Checkpoint(tmp_path)
    )
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    if adapter.unstreamable(model.config):
        with pytest.raises(M2DError, match="cannot be run a decoder layer at a time"):
            collect_stats_streamed(lazy, ids, mask, progress=False)
        return
    whole = collect_stats(model, adapter, ids, mask, progress=False)
    streamed = collect_stats_streamed(lazy, ids, mask, progress=False)
    for i, st in whole.items():
        torch.testing.assert_close(streamed[i].count, st.count, rtol=0, atol=0)
        torch.testing.assert_close(streamed[i].gram, st.gram, rtol=1e-6, atol=1e-9)


#: m2d convert from a checkpoint directory in the default run for one family of each kind (per-expert keys and a dense
#: knob, Mixtral's names and a one-expert student, two halves behind a group router and a block norm, gate-less
#: experts, an interleaved and vocabulary-padded checkpoint computing in float32); every family with M2D_SLOW=1
CONVERTED_DEFAULT = {"glm4_moe", "minimax", "axk1", "nemotron_h", "inkling2_text", "sarvam_moe"}


@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(t, marks=() if t in CONVERTED_DEFAULT else pytest.mark.slow)
        for t in sorted(TYPES) + sorted(BY_CLASS)
    ],
)
def test_m2d_convert_from_a_checkpoint(model_type, tmp_path):
    """What a user runs: the teacher saved as transformers saves it, calibrated on text, its student built from the
    tensors read lazily (only the merged experts), exported, checked against the float64 reference and loaded back
    with AutoModelForCausalLM as the teacher's class."""
    from m2d_ray.assets import TINY_TEACHER_DIR
    from m2d_ray.commands.convert import convert_one

    vocab = {"vocab_size": 880, "unpadded_vocab_size": 880} if "inkling2" in model_type else {"vocab_size": 880}
    model = tiny_structured(model_type, dtype=torch.float32, **vocab)
    model.save_pretrained(tmp_path / "teacher")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TEACHER_DIR / name, tmp_path / "teacher" / name)
    result = convert_one(
        str(tmp_path / "teacher"),
        "do-acp",
        "oc",
        "uniform",
        None,
        tmp_path / "student",
        calib_data="synthetic:valid",
        device="cpu",
        calib_kwargs={"max_tokens": 512, "seq_len": 32},
    )
    assert result["max_rel_error"] < get_adapter(model.config).exact_tol
    student = auto_class(model.config).from_pretrained(tmp_path / "student")
    assert type(student).__name__ == result["dense_class"] == type(model).__name__


@pytest.mark.parametrize(
    "model_type", sorted(t for t in MULTIMODAL if t in CONFIG_MAPPING and older_release(t) is None)
)
def test_a_vision_language_checkpoint_keeps_its_class_and_its_vision_tower(model_type, tmp_path):
    """Its language model converted exactly, everything else copied unchanged: the student is the teacher's own
    image-text-to-text class, read lazily from the saved checkpoint, and planned with its vision tower counted."""
    model = tiny_multimodal(model_type, dtype=torch.float32)
    adapter = get_adapter(model.config)
    model.save_pretrained(tmp_path / "teacher")
    teacher = LazyTeacher(
        str(tmp_path / "teacher"),
        model.config,
        None,
        adapter,
        skeleton(model.config, torch.float32),
        Checkpoint(tmp_path / "teacher"),
    )
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    stats = collect_stats(model, adapter, ids, torch.ones_like(ids), progress=False)
    plan = make_plan(teacher, stats, "do-acp", "oc", "uniform", adapter.top_k(model.config))
    record = export_student(build_from_plan(teacher, plan), None, tmp_path / "s", teacher=teacher, plan=plan)
    assert record["max_rel_error"] < adapter.exact_tol
    student = AutoModelForImageTextToText.from_pretrained(tmp_path / "s")
    assert type(student).__name__ == type(model).__name__
    theirs, ours = model.state_dict(), student.state_dict()
    towers = [k for k in theirs if ".language_model." not in k and not k.startswith("lm_head")]
    assert towers and all(torch.equal(ours[k], theirs[k]) for k in towers)
    assert param_counts(model.config).params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "model_type,differs", [(t, d) for t, d in (("ergo", "RMSNorm"), ("llama4_text", "input")) if t in CONFIG_MAPPING]
)
@torch.no_grad()
def test_an_approximated_family_says_what_differs_and_the_difference_is_measured(model_type, differs):
    """ergo normalises each expert's output (and the shared expert's) before the routing weight; Llama-4 scales each
    expert's input by its score: the method's FFN is an approximation of their blocks. The plan says so in one line,
    and the block's output differs from the method's sum of weighted expert FFNs by a measured, finite amount
    (printed: pytest -s)."""
    model = tiny_structured(model_type)
    adapter = get_adapter(model.config)
    assert differs in adapter.approximation
    assert any("approximates its MoE blocks" in n for n in models_of(model.config).notes)
    d = model.config.hidden_size
    for i, block in adapter.moe_blocks(model).items():
        h = torch.randn(2, 7, d, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        flat = h.reshape(-1, d)
        r = adapter.route(block, flat)
        out = expert_outputs(adapter.experts(block), adapter.expert_input(block, flat))
        y = (r.weight[..., None].to(out.dtype) * out[r.index, torch.arange(flat.shape[0])[:, None]]).sum(1)
        y = y + expert_outputs(adapter.shared(block).weights, flat)[0]
        err = rel_error(y, adapter.block_output(block, h).reshape(-1, d))
        print(f"{model_type} layer {i}: the method's FFN differs from the block by {err:.3f} (relative)")
        assert 1e-6 < err < float("inf")


def test_a_family_of_a_later_transformers_is_named_with_the_release_that_has_it(tmp_path, monkeypatch):
    """A checkpoint whose model type the installed transformers does not know, but a later release does: one line
    naming that release, not transformers' own error."""
    from m2d_ray.arch import refused
    from m2d_ray.models import model_config

    monkeypatch.setitem(refused.SINCE, "future_moe", "9.1")
    (tmp_path / "config.json").write_text('{"model_type": "future_moe", "hidden_size": 64}')
    with pytest.raises(M2DError, match=r"'future_moe' needs transformers>=9\.1 \(installed: 5\.") as err:
        model_config(str(tmp_path))
    assert "\n" not in str(err.value)


@torch.no_grad()
def test_the_head_is_a_plain_projection_or_refused_by_name(teacher):
    """Cached `hidden` targets recompute the logits as the final state times the head: a family whose logits are
    scaled or soft-capped (beam, cohere2-moe, inkling2) is refused by name (arch/head.py), every other one's logits
    are exactly that product."""
    from m2d_ray.arch.head import check_plain_head

    _, t = teacher
    try:
        check_plain_head(t.config)
    except M2DError as refusal:
        assert "use stage2.targets=online" in str(refusal)
        return
    ids = torch.randint(0, t.config.get_text_config().vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    out = t.model(ids, output_hidden_states=True)
    head = t.model.get_output_embeddings().weight
    product = out.hidden_states[-1].double() @ head.double().T
    torch.testing.assert_close(product, out.logits.double(), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_expanded_routing_reaches_the_experts(teacher):
    """teacher_topk: set_top_k(k') makes every block hand its experts k' of them (the router's top_k and the block's,
    where a family reads the block's); a copy, so the fixture's teacher keeps its own k."""
    name, t = teacher
    model, k = copy.deepcopy(t.model), t.adapter.top_k(t.config) + 1
    if name == "deepseek_v4":  # its hash-routed layers' table holds k experts a token: refused in one line
        with pytest.raises(M2DError, match="cannot widen them"):
            t.adapter.set_top_k(model, k)
        return
    t.adapter.set_top_k(model, k)
    d = t.config.get_text_config().hidden_size
    for block in t.adapter.moe_blocks(model).values():
        assert t.adapter.route(block, torch.randn(5, d, dtype=t.adapter.exact_dtype)).index.shape == (5, k)


def _quantise_inkling2_loop(directory) -> None:
    """Rewrite a saved Inkling2-loop checkpoint's experts as the original checkpoints store them: the fused gate/up in
    MXFP8 (float8 values, a power-of-two exponent per 32), the down projections in NVFP4 (two E2M1 codes a byte, a
    float8 scale per 16, a per-expert amax over a denominator); random codes, as the layout is what is tested."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    state, gen = load_file(path), torch.Generator().manual_seed(0)
    for key in [k for k in state if k.endswith("experts.w13_weight")]:
        w = state.pop(key)
        state[key] = (torch.randn(w.shape, generator=gen) * 4).to(torch.float8_e4m3fn)
        state[key + "_scale"] = torch.randint(118, 126, (*w.shape[:2], w.shape[2] // 32), generator=gen).to(torch.uint8)
    for key in [k for k in state if k.endswith("experts.w2_weight")]:
        w = state.pop(key)
        E, rows, cols = w.shape
        state[key] = torch.randint(0, 256, (E, rows, cols // 2), generator=gen).to(torch.uint8)
        state[key + "_scale"] = (torch.rand(E, rows, cols // 16, generator=gen) + 0.5).to(torch.float8_e4m3fn)
        state[key + "_amax"] = torch.rand(E, generator=gen) + 1
        state[key + "_outer_scale_denominator"] = torch.full((E,), 448.0 * 6.0)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.skipif("inkling2_loop_text" not in CONFIG_MAPPING, reason="a family of a later transformers")
def test_quantised_experts_transformers_dequantises_are_read_lazily_as_it_loads_them(tmp_path):
    """Inkling2-loop's original checkpoints store NVFP4 and MXFP8 experts that transformers dequantises on load with
    an op of its own: the lazy teacher runs that op on just the experts it is asked for, equal to from_pretrained."""
    from transformers import AutoModelForCausalLM

    model = tiny_structured("inkling2_loop_text", dtype=torch.float32)
    model.save_pretrained(tmp_path)
    _quantise_inkling2_loop(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    lazy = LazyTeacher(
        str(tmp_path),
        model.config,
        None,
        get_adapter(model.config),
        skeleton(model.config, torch.float32),
        Checkpoint(tmp_path),
    )
    state = loaded.state_dict()
    assert not torch.equal(
        state["model.layers.0.mlp.experts.down_proj"], model.state_dict()["model.layers.0.mlp.experts.down_proj"]
    )
    for n, v in state.items():
        assert torch.equal(lazy.tensor(n), v), n
    experts = [5, 1]
    for n in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        assert torch.equal(lazy.tensor(n, experts), state[n][experts]), n


@pytest.mark.skipif("mistral4" not in CONFIG_MAPPING, reason="a family of a later transformers")
def test_a_family_transformers_maps_as_its_pretraining_model_only_loads_with_that_auto_class():
    """transformers 5.25 maps Mistral-4's causal LM under AutoModelForPreTraining, not AutoModelForCausalLM: the
    student is built and loaded back with that auto class, as the teacher is (no class of m2d's in between)."""
    from transformers import AutoModelForPreTraining

    config = tiny_config("mistral4")
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        AutoModelForCausalLM.from_config(config)
    assert auto_class(config) is AutoModelForPreTraining
    assert type(auto_class(config).from_config(config)).__name__ == "Mistral4ForCausalLM"


def test_a_family_an_older_transformers_builds_otherwise_is_named_with_the_release_m2d_runs_it_on(monkeypatch):
    """A family whose layer an older release builds otherwise (its experts not yet the decorated kind): one line naming
    the release m2d has run it on, before any work; a family m2d converts that the release lacks names the release m2d
    reads it from."""
    import transformers

    from m2d_ray.arch import refused

    config = tiny_config("qwen3_moe")
    monkeypatch.setitem(refused.READS_FROM, "qwen3_moe", "9.0")
    with pytest.raises(M2DError, match=rf"transformers {transformers.__version__} builds its layer otherwise .*>=9\.0"):
        get_adapter(config)
    monkeypatch.setitem(refused.READS_FROM, "qwen3_moe", "5.0")
    assert get_adapter(config) is not None
    assert "needs transformers>=" + refused.READ_AGAINST in refused.missing_release("some_moe", known=True)
    assert refused.missing_release("some_moe") is None


def test_a_config_whose_layers_differ_in_attention_is_planned_as_the_sum_of_its_layers():
    """Gemma-4 sets wider heads on its global layers (per_layer_config), and transformers refuses to read such an
    attribute off the whole config: stage 3's placement, the FLOPs and the plan's shapes count each layer's own."""
    from m2d_ray.distill.flops import attention_flops, causal_attention_flops
    from m2d_ray.evaluate.placement import model_size

    config = tiny_config("gemma4_text", **TINY_EXTRA["gemma4_text"])
    layers = [config.per_layer_config[i] for i in range(config.num_hidden_layers)]
    q = [c.num_attention_heads * c.head_dim for c in layers]
    kv = [c.num_key_value_heads * c.head_dim for c in layers]
    assert len(set(q)) == 2  # the layers do differ
    assert attention_flops(config, 16) == sum(causal_attention_flops(w, 1, 16) for w in q)
    size = model_size(config)
    assert size.layers * size.kv_heads * size.head_dim == sum(kv)
    shape = models_of(config).teacher
    assert shape.layers * shape.q_width == sum(q) and shape.layers * shape.kv_width == sum(kv)


def test_a_quantised_tensor_transformers_assembles_with_ops_of_its_own_is_dequantised_before_them(tmp_path):
    """Kimi-K2.5 published in fine-grained FP8: its vision tower's fused qkv, which transformers splits and permutes
    for its rotary embedding on load, is read dequantised and then through those operations: equal to the same tower
    read from the dequantised copy."""
    from quantize import FORMATS, expand, quantise_blocks, write
    from safetensors.torch import load_file, save_file

    from m2d_ray.models import model_config

    model = tiny_multimodal("kimi_k25", dtype=torch.float32)
    quantised, plain = write(model, tmp_path, "fp8")  # the language model's matrices
    block = FORMATS["fp8"]["weight_block_size"]
    stored, dequantised = load_file(quantised / "model.safetensors"), load_file(plain / "model.safetensors")
    for key in [k for k in stored if k.endswith("wqkv.weight")]:  # and the vision tower's fused qkv
        w = stored[key]
        stored[key], stored[key + "_scale_inv"] = quantise_blocks(w, *block, torch.float8_e4m3fn)
        dequantised[key] = (stored[key].double() * expand(stored[key + "_scale_inv"], w.shape, *block)).to(w.dtype)
    save_file(stored, quantised / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantised, plain / "model.safetensors", metadata={"format": "pt"})

    def lazy(directory):
        config = model_config(str(directory))
        adapter = get_adapter(config)
        return LazyTeacher(
            str(directory), config, None, adapter, skeleton(config, torch.float32), Checkpoint(directory)
        )

    q, p = lazy(quantised), lazy(plain)
    fused = [k for k in Checkpoint(quantised).names() if k.endswith("wqkv.weight")]
    assert fused and all(q._reader.quantised(k) for k in fused)
    names = [n for n in model.state_dict() if "vision_tower" in n and n.endswith(("q_proj.weight", "k_proj.weight"))]
    assert names
    for n in names:
        assert torch.equal(q.tensor(n), p.tensor(n)), n
