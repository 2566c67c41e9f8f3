"""Teachers as they are published: FP8 block-scaled, MXFP4 and compressed-tensors checkpoints (m2d_ray/quant/).

(a) the dequantisation is transformers' own (fine-grained FP8: `_dequantize_fp8_weight`, `Fp8Dequantize`; MXFP4:
    `convert_moe_packed_tensors`), with partial edge blocks, e4m3 and e5m2, ue8m0 scales, and a fused tensor's rows;
(b) a tiny teacher written in each format by the tests' own quantiser (tests/quantize.py) converts as its dequantised
    copy does (`m2d convert`'s `convert_one`): the same selection, groups and scales, the same student in float32,
    whole or streamed, and the student's config says nothing of the teacher's quantisation;
(c) what cannot be read is refused in one line: another method, naming it; a missing or non-finite scale, naming
    the tensor;
(d) the plan counts a quantised teacher's checkpoint at its published bytes (DeepSeek-R1's 671 GB, gpt-oss-20b's
    13.8 GB) and its memory at the dequantised teacher a stage holds.
"""

from __future__ import annotations

import json

import pytest
import quantize
import torch
from families import tiny_config
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from m2d_ray.arch import get_adapter
from m2d_ray.checkpoint import Checkpoint, scan
from m2d_ray.cli import main
from m2d_ray.commands.convert import convert_one
from m2d_ray.config import load_config
from m2d_ray.errors import M2DError
from m2d_ray.models import load_model, model_config
from m2d_ray.pipeline import plan as make_plan
from m2d_ray.plan.run_plan import plan_line
from m2d_ray.plan.shapes import models_of, shape_of
from m2d_ray.quant import Scheme, scheme_of
from m2d_ray.quant.fp8 import dequantize_blocks
from m2d_ray.quant.mxfp4 import dequantize
from m2d_ray.quant.reader import Reader
from m2d_ray.shipped import EXPERIMENTS
from m2d_ray.sizes import gib
from m2d_ray.weights import open_teacher, read_output_head

G = torch.Generator().manual_seed(0)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
HEAD = "lm_head.weight"


@pytest.mark.parametrize(
    "shape, block, dtype",
    [
        ((3, 40, 72), (16, 24), torch.float8_e4m3fn),  # fused experts, partial edge blocks
        ((576, 300), (128, 128), torch.float8_e4m3fn),  # DeepSeek-V3's kv_a_proj_with_mqa rows
        ((64, 96), (32, 48), torch.float8_e5m2),
    ],
)
def test_fp8_is_dequantised_as_transformers_does(shape, block, dtype):
    w = torch.randn(shape, generator=G)
    q, scale = quantize.quantise_blocks(w, *block, dtype)
    ours = dequantize_blocks(q, scale, block, torch.float32)
    assert torch.equal(ours, _dequantize_fp8_weight(q, scale, list(block), torch.float32))
    if all(n % b == 0 for n, b in zip(shape[-2:], block)):  # transformers' load-time op needs whole blocks
        assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(q, scale, torch.float32))
    assert torch.equal(ours, (q.double() * quantize.expand(scale, shape, *block)).float())  # float64's, rounded
    ue8m0 = torch.exp2(torch.ceil(torch.log2(scale))).to(torch.float8_e8m0fnu)  # DeepSeek-V3.1's scale_fmt
    assert torch.equal(
        dequantize_blocks(q, ue8m0, block, torch.float32), _dequantize_fp8_weight(q, ue8m0, list(block), torch.float32)
    )
    with pytest.raises(ValueError, match="do not cover"):
        dequantize_blocks(q, scale, (block[0] * 2, block[1]), torch.float32)


def test_mxfp4_is_dequantised_as_transformers_does():
    w = torch.randn(4, 64, 96, generator=G)  # gpt-oss's in-memory [E, d, 2I]
    blocks, scales = quantize.quantise_mxfp4(w)
    ours = dequantize(blocks, scales, torch.float32)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(ours, quantize.dequantise_mxfp4(blocks, scales).float())
    assert (ours - w).abs().max() < 1.0 and ours.shape == w.shape


def test_a_fused_tensors_rows_are_read_alone(tmp_path):
    """An expert's rows of a fused [E, ...] tensor: its weight and its scale grid only, the same values."""
    w = torch.randn(5, 40, 72, generator=G)
    q, scale = quantize.quantise_blocks(w, 16, 24, torch.float8_e4m3fn)
    blocks, scales = quantize.quantise_mxfp4(torch.randn(5, 64, 32, generator=G))
    save_file(
        {"f.w": q, "f.w_scale_inv": scale, "m.w_blocks": blocks, "m.w_scales": scales}, tmp_path / "a.safetensors"
    )
    ckpt = Checkpoint(tmp_path)
    fp8 = Reader(ckpt, Scheme("fp8", "", (16, 24)))
    assert torch.equal(fp8.read("f.w", [3, 1]), fp8.read("f.w")[[3, 1]])
    mx = Reader(ckpt, Scheme("mxfp4", ""))
    assert "m.w" in mx and mx.quantised("m.w") and torch.equal(mx.read("m.w", [4, 0]), mx.read("m.w")[[4, 0]])


#: (family, format): one of each format in the default suite, the other variants with M2D_SLOW=1
CASES = [
    pytest.param(("qwen3_moe", "fp8"), id="qwen3_moe-fp8"),
    pytest.param(("gpt_oss", "mxfp4"), id="gpt_oss-mxfp4"),
    pytest.param(("deepseek_v3", "ct-block"), id="deepseek_v3-ct-block"),
    pytest.param(("minimax_m2", "fp8"), id="minimax_m2-fp8"),  # read from its structure, its student's config copied
    pytest.param(("deepseek_v3", "fp8-e5m2"), id="deepseek_v3-fp8-e5m2", marks=pytest.mark.slow),
    pytest.param(("qwen3_moe", "ct-channel"), id="qwen3_moe-ct-channel", marks=pytest.mark.slow),
    pytest.param(("qwen3_moe", "ct-tensor"), id="qwen3_moe-ct-tensor", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=CASES)
def written(request, tmp_path_factory):
    family, fmt = request.param
    return (fmt, *quantize.write(quantize.teacher(family), tmp_path_factory.mktemp(f"{family}-{fmt}"), fmt))


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["whole", "streamed"])
def test_a_quantised_teacher_converts_as_its_dequantised_copy(written, stream, tmp_path):
    fmt, quantised, dequantised = written
    assert quantize.stored_bytes(quantised) < 0.75 * quantize.stored_bytes(dequantised)  # it is stored quantised
    lazy = open_teacher(str(quantised))
    assert lazy.quantization is not None and lazy.dtype == torch.float32
    scan(str(quantised), "teacher")  # m2d run's check of every stored value: 8-bit floats too
    assert torch.equal(read_output_head(str(quantised), torch.float32), open_teacher(str(dequantised)).tensor(HEAD))
    out = {}
    for name, teacher in (("q", quantised), ("d", dequantised)):
        result = convert_one(
            str(teacher),
            "do-acp",
            "oc",
            "proportional",
            4,
            tmp_path / name,
            calib_data="synthetic:valid",
            calib_kwargs={"max_tokens": 1024, "seq_len": 64, "stream": stream},
        )
        out[name] = result, load_file(str(tmp_path / name / "model.safetensors"))
    (a, sa), (b, sb) = out["q"], out["d"]
    assert [a[k] for k in ("selected", "groups", "scales")] == [b[k] for k in ("selected", "groups", "scales")]
    assert sa.keys() == sb.keys() and all(sa[k].dtype == torch.float32 and torch.equal(sa[k], sb[k]) for k in sa)
    assert "quantization_config" not in json.loads((tmp_path / "q" / "config.json").read_text())


@pytest.mark.parametrize(
    "config, method",
    [
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "awq", "bits": 4}, "awq"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt"),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "nvfp4-pack-quantized"),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
            "4-bit",
        ),
    ],
)
def test_a_method_m2d_cannot_read_is_refused_naming_it(config, method):
    class Config:
        quantization_config = config

    with pytest.raises(M2DError, match=method) as err:
        scheme_of(Config())
    assert "dequantise" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("damage", ["missing", "nan"])
def test_a_missing_or_non_finite_scale_is_refused_naming_the_tensor(written, damage, tmp_path):
    fmt, quantised, _ = written
    state = load_file(str(quantised / "model.safetensors"))
    scale = next(k for k in sorted(state) if k.endswith(("_scale_inv", "_scale", "_scales")) and "layers.1." in k)
    if damage == "missing":
        del state[scale]
    else:
        state[scale] = state[scale].clone()
        state[scale].view(-1)[0] = 255 if fmt == "mxfp4" else float("nan")
    save_file(state, str(quantised.parent / "damaged.safetensors"))
    damaged = tmp_path / "t"
    damaged.mkdir()
    for f in quantised.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    (damaged / "model.safetensors").write_bytes((quantised.parent / "damaged.safetensors").read_bytes())
    weight = scale.removesuffix("_scales").removesuffix("_scale").removesuffix("_scale_inv")
    for read in (lambda: open_teacher(str(damaged)).module(""), lambda: load_model(str(damaged), what="teacher")):
        with pytest.raises(M2DError, match=scale if damage == "nan" else "missing") as err:  # lazily, and whole
            read()
        assert weight in str(err.value) and "\n" not in str(err.value)


# ---- counted as published (m2d plan) ---------------------------------------------------------------------------


def test_the_plan_counts_a_quantised_teacher_at_its_stored_bytes(written):
    """What is downloaded and stored is the published checkpoint; what a stage holds is the dequantised teacher."""
    _, quantised, dequantised = written
    shape = shape_of(model_config(str(quantised)))
    assert shape.checkpoint_bytes == pytest.approx(quantize.stored_bytes(quantised), rel=0.02)
    assert shape.weights == pytest.approx(quantize.stored_bytes(dequantised), rel=1e-3)  # held dequantised (buffers)


def test_a_671b_fp8_teacher_plans_at_its_published_671_gb():
    """DeepSeek-R1 (DeepSeek-V3's architecture), its config.json as published, shipped: fine-grained FP8."""
    config = model_config(str(EXPERIMENTS / "configs" / "deepseek-ai--DeepSeek-R1"))
    plan = make_plan(load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml"), config)
    stored = json.loads(plan_line(plan))["teacher_checkpoint_bytes"]
    assert plan.models["teacher_params"] == pytest.approx(671e9, rel=0.001)
    assert stored == pytest.approx(671e9, rel=0.01)  # not the 1.34 TB of its bf16 copy
    assert plan.by_stage()["calibrate"].parts["teacher"] == 2 * plan.models["teacher_params"]  # held in bf16
    assert f"teacher: {gib(stored)} as published in fine-grained FP8 (e4m3, 128x128 blocks)," in plan.table()
    assert "multi-token-prediction layer (num_nextn_predict_layers=1) left out" in plan.table()  # not converted


def test_the_shipped_gpt_oss_20b_is_planned_as_published():
    """Its config.json as the hub has it, MXFP4 experts: 13.8 GB as published (the hub's size), 39 GiB held."""
    shape = shape_of(model_config(str(EXPERIMENTS / "configs" / "openai--gpt-oss-20b")))
    assert shape.quantisation.startswith("MXFP4") and shape.checkpoint_bytes == pytest.approx(13.8e9, rel=0.01)
    assert shape.weights == 2 * shape.params


def test_a_students_config_is_unquantised_whatever_the_teacher_was_published_in():
    """A family read from its structure builds its student's config from the teacher's (quantization_config too):
    convert/ and the plan drop it (the student is written in the compute dtype)."""
    config = tiny_config("minimax_m2")
    config.quantization_config = FP8_CONFIG
    adapter = get_adapter(config)
    assert getattr(adapter.student_config(config, 64), "quantization_config", None) == FP8_CONFIG
    assert not hasattr(adapter.dense_config(config, 64), "quantization_config")
    assert not hasattr(models_of(config).student_config, "quantization_config")


def test_m2d_plan_on_a_quantised_teacher_counts_its_stored_size(tmp_path, capsys):
    quantised, _ = quantize.write(quantize.teacher("gpt_oss"), tmp_path, "mxfp4")
    assert main(["plan", "tiny", "--model", str(quantised), "--json"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    stored = json.loads(next(t for t in reversed(text.splitlines()) if t.startswith("{")))["teacher_checkpoint_bytes"]
    assert stored == pytest.approx(quantize.stored_bytes(quantised), rel=0.02)
    assert f"teacher: {gib(stored)} as published in " in text
