"""A quantiser of the tests' own: a tiny teacher written in each published format, beside its dequantised copy.

`write(model, out, fmt)` saves `model` as the hub holds it (`save_pretrained`), then writes
  out/quantised     the same checkpoint with its layers' matrices quantised in `fmt` and the config's
                    `quantization_config` (the router and the embeddings left unquantised, as published ones leave them)
  out/dequantised   every tensor as the quantised checkpoint means it, computed in float64 here (independently of
                    m2d_ray.quant) and stored in the model's dtype, with no quantization_config
Formats: fp8 (fine-grained, e4m3 or e5m2, `weight_block_size` not dividing the tiny shapes: partial edge blocks),
mxfp4 (gpt-oss's fused experts), compressed-tensors FP8 per tensor, channel or block.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from families import FAMILIES, tiny_model, tiny_structured
from safetensors.torch import load_file, save_file

from m2d_ray.data.synthetic import build_tokenizer

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FORMATS = {
    "fp8": dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[16, 24]),
    "fp8-e5m2": dict(quant_method="fp8", fmt="e5m2", activation_scheme="dynamic", weight_block_size=[8, 48]),
    "mxfp4": dict(quant_method="mxfp4"),
    **{
        f"ct-{strategy}": dict(
            quant_method="compressed-tensors",
            format="float-quantized",
            quantization_status="compressed",
            config_groups={
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": strategy,
                        "symmetric": True,
                        "dynamic": False,
                        "block_structure": [16, 24] if strategy == "block" else None,
                    },
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                }
            },
            ignore=["lm_head", "re:.*mlp.gate$", "re:.*router$"],
        )
        for strategy in ("tensor", "channel", "block")
    },
}


def _blocks_of(w: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """[..., ceil(R/bm), ceil(C/bn)] max |w| per block (the edge blocks partial)."""
    R, C = w.shape[-2:]
    pad = torch.zeros(*w.shape[:-2], -(-R // bm) * bm, -(-C // bn) * bn, dtype=w.dtype)
    pad[..., :R, :C] = w.abs()
    return pad.unflatten(-1, (-1, bn)).unflatten(-3, (-1, bm)).amax(dim=(-3, -1))


def expand(scale: torch.Tensor, shape, bm: int, bn: int) -> torch.Tensor:
    """Each [bm, bn] block's scale at every element it covers (float64)."""
    R, C = shape[-2:]
    s = scale.double()
    s = s.reshape(1, 1) if s.numel() == 1 else s
    return s.repeat_interleave(bm, -2).repeat_interleave(bn, -1)[..., :R, :C]


def quantise_blocks(w: torch.Tensor, bm: int, bn: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit weight, float32 scale per block) with weight x scale ~ w."""
    amax = _blocks_of(w.double(), bm, bn)
    scale = torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax)).float()
    q = (w.double() / expand(scale, w.shape, bm, bn)).clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype)
    return q, scale


def quantise_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's storage of an in-memory expert tensor [E, C, R]: (blocks [E, R, C/32, 16] uint8, scales
    [E, R, C/32] uint8), the nearest e2m1 value x 2^(scale - 127) per 32 values."""
    rows = w.transpose(-1, -2).double().unflatten(-1, (-1, 32))  # [E, R, G, 32]
    amax = rows.abs().amax(-1).clamp_min(2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # the largest value fits 6 x 2^exp
    mags = rows.abs() / torch.exp2(exp).unsqueeze(-1)
    idx = (mags.unsqueeze(-1) - E2M1.double()).abs().argmin(-1)  # nearest magnitude
    nibble = (idx + 8 * (rows < 0)).to(torch.uint8)
    blocks = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def dequantise_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 reference: back to the in-memory [E, C, R]."""
    lut = torch.cat([E2M1, -E2M1]).double()
    vals = torch.stack([lut[(blocks & 15).long()], lut[(blocks >> 4).long()]], -1).flatten(-2)  # [E, R, G, 32]
    vals = vals * torch.exp2(scales.double() - 127).unsqueeze(-1)
    return vals.flatten(-2).transpose(-1, -2)


def teacher(family: str, seed: int = 0):
    """The family's tiny teacher (tests/families.py; a family read from its structure: tiny_structured) with the
    synthetic corpus' vocabulary (convert calibrates on it) and, for gpt-oss, experts 32 wide (MXFP4 packs 32 values a
    scale)."""
    spec = next((f for f in FAMILIES if f.id == family), None)
    if spec is None:  # a family read from its structure (m2d_ray/arch/families.py)
        return tiny_structured(family, seed, torch.float32, vocab_size=len(build_tokenizer()))

    def config():
        c = spec.make_config()
        c.vocab_size = len(build_tokenizer())
        if family == "gpt_oss":
            c.intermediate_size = 32
        return c

    return tiny_model(dataclasses.replace(spec, make_config=config), seed)


def _quantised_matrix(key: str, t: torch.Tensor) -> bool:
    """The layers' matrices; not the routers (published checkpoints keep them), embeddings or the head."""
    return (
        key.startswith("model.layers.")
        and t.dim() >= 2
        and not key.endswith((".gate.weight", ".router.weight", "_bias"))
    )


def write(model, out: Path, fmt: str) -> tuple[Path, Path]:
    """(quantised dir, dequantised dir) of `model` in `fmt` (see module doc)."""
    hub = out / "hub"
    model.save_pretrained(hub)
    state = load_file(str(hub / "model.safetensors"))
    q_cfg = FORMATS[fmt]
    stored, plain = {}, {}
    for key, t in state.items():
        plain[key] = t
        if not _quantised_matrix(key, t):
            stored[key] = t
        elif fmt == "mxfp4":
            if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                stored[key] = t
                continue
            blocks, scales = quantise_mxfp4(t)
            stored[key + "_blocks"], stored[key + "_scales"] = blocks, scales
            plain[key] = dequantise_mxfp4(blocks, scales).to(t.dtype)
        elif fmt.startswith("fp8"):
            dtype = torch.float8_e5m2 if q_cfg["fmt"] == "e5m2" else torch.float8_e4m3fn
            q, scale = quantise_blocks(t, *q_cfg["weight_block_size"], dtype)
            stored[key], stored[key + "_scale_inv"] = q, scale
            plain[key] = (q.double() * expand(scale, t.shape, *q_cfg["weight_block_size"])).to(t.dtype)
        else:
            strategy = fmt.removeprefix("ct-")
            R, C = t.shape[-2:]
            bm, bn = {"tensor": (R, C), "channel": (1, C), "block": (16, 24)}[strategy]
            q, scale = quantise_blocks(t, bm, bn, torch.float8_e4m3fn)
            stored[key], stored[key + "_scale"] = q, scale.reshape(1) if strategy == "tensor" else scale
            plain[key] = (q.double() * expand(scale, t.shape, bm, bn)).to(t.dtype)
    for d, tensors, quantised in ((out / "quantised", stored, True), (out / "dequantised", plain, False)):
        d.mkdir(parents=True)
        config = json.loads((hub / "config.json").read_text())
        if quantised:
            config["quantization_config"] = q_cfg
            if fmt == "mxfp4" or fmt.startswith("fp8"):
                config["quantization_config"] = {
                    **q_cfg,
                    "modules_to_not_convert": ["lm_head", "model.embed_tokens", "mlp.gate", "mlp.router"],
                }
        (d / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        build_tokenizer().save_pretrained(d)
    return out / "quantised", out / "dequantised"


def stored_bytes(directory: Path) -> int:
    """Bytes of a checkpoint's tensors as stored."""
    return sum(math.prod(t.shape) * t.element_size() for t in load_file(str(directory / "model.safetensors")).values())
