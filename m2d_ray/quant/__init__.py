"""Published quantised checkpoints: which formats a teacher is read from, and what it weighs as published.

A teacher published quantised is read as it is stored and dequantised on read, one tensor (or one expert's rows)
at a time, into the compute dtype (`quant.reader.Reader`); nothing is converted beforehand and no dequantised copy
is written. The formats, each in its own module:

    fp8                  fine-grained FP8 (`quant_method: fp8`): e4m3 / e5m2 weights, a float32 (or ue8m0)
                         `weight_scale_inv` per `weight_block_size` block (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8, ...)
    mxfp4                MXFP4 (`quant_method: mxfp4`): `*_blocks` of e2m1 nibbles, `*_scales` of e8m0 exponents
                         per 32 values (gpt-oss's experts)
    compressed           compressed-tensors (`quant_method: compressed-tensors`), float-/int-/naive-quantized 8-bit
                         weights with a `weight_scale` per tensor, channel, group or block (llm-compressor's output)

A tensor is dequantised when the checkpoint stores it quantised (an 8-bit weight beside its scale, or MXFP4 blocks
beside their scales); the modules a checkpoint leaves unquantised (`modules_to_not_convert`, `ignore`) are stored in
their float dtype and read as they are. Any other method (GPTQ, AWQ, bitsandbytes, NVFP4, ...) is refused by
`scheme_of` before any work, naming it.

This module reads configs only (no torch): `m2d plan` counts a teacher's published bytes (`stored_bytes`) from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from m2d_ray.errors import M2DError

FP8, MXFP4, COMPRESSED = "fp8", "mxfp4", "compressed-tensors"
#: compressed-tensors formats whose weights are one 8-bit value times a scale
CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")
_DEQUANTISE = (
    "use the model's unquantised (bf16) release, or dequantise it once (transformers: from_pretrained, then "
    "save_pretrained)"
)


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint stores its quantised weights (read from its config's `quantization_config`)."""

    method: str  # FP8, MXFP4 or COMPRESSED
    label: str  # one phrase for the plan and messages
    block: tuple[int, int] | None = None  # FP8's weight_block_size; compressed-tensors' block_structure
    strategy: str = ""  # compressed-tensors' weights strategy (tensor, channel, group, block)
    group: int | None = None  # compressed-tensors' group_size
    skip: tuple[str, ...] = field(default=())  # modules_to_not_convert / ignore, as the config gives them

    def stored_bits(self) -> float:
        """Bits a quantised weight takes as published, its share of the scales included."""
        if self.method == MXFP4:
            return 4 + 8 / 32
        scale_bits = 32  # float32 scales (bf16 ones are counted the same: a bound)
        if self.block is not None:
            return 8 + scale_bits / (self.block[0] * self.block[1])
        if self.strategy == "group" and self.group:
            return 8 + scale_bits / self.group
        return 8.0  # a scale per tensor or per output channel: nothing per weight


def _as_dict(q) -> dict:
    if q is None or isinstance(q, dict):
        return q or {}
    return q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))


def scheme_of(config, what: str = "teacher") -> Scheme | None:
    """The quantisation a checkpoint of `config` is published in; None when it is not quantised. One line
    (M2DError) for a method or format m2d cannot read, naming it and what to do instead."""
    q = _as_dict(getattr(config, "quantization_config", None))
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == FP8:
        block = q.get("weight_block_size")
        fmt = str(q.get("fmt", "e4m3"))
        return Scheme(
            FP8,
            f"fine-grained FP8 ({fmt}, " + (f"{block[0]}x{block[1]} blocks)" if block else "a scale per tensor)"),
            tuple(block) if block else None,
            skip=tuple(q.get("modules_to_not_convert") or ()),
        )
    if method == MXFP4:
        return Scheme(MXFP4, "MXFP4 (e2m1, an e8m0 scale per 32)", skip=tuple(q.get("modules_to_not_convert") or ()))
    if method == COMPRESSED:
        return _compressed(q, what)
    raise M2DError(
        f"the {what} is published quantised with {method or 'an unnamed method'!r}, which m2d cannot read (it reads "
        f"fp8, mxfp4 and compressed-tensors 8-bit checkpoints); {_DEQUANTISE}"
    )


def _compressed(q: dict, what: str) -> Scheme:
    """compressed-tensors: every config group's weights must be 8-bit values times a scale, stored as such."""
    groups = q.get("config_groups") or {}
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")]
    formats = {str(g.get("format") or q.get("format") or "") for g in groups.values() if isinstance(g, dict)}
    formats = formats or {str(q.get("format") or "")}
    bad = sorted(f for f in formats if f not in CT_FORMATS + ("dense", ""))
    if bad:
        raise M2DError(
            f"the {what} is published in compressed-tensors format {bad[0]!r}, which m2d cannot read (it reads "
            f"{', '.join(CT_FORMATS)} with 8-bit weights); {_DEQUANTISE}"
        )
    for w in weights:
        if int(w.get("num_bits", 8)) != 8 or w.get("symmetric") is False or w.get("strategy") == "attn_head":
            raise M2DError(
                f"the {what} is published in compressed-tensors with {w.get('num_bits')}-bit "
                f"{'asymmetric ' if w.get('symmetric') is False else ''}{w.get('type')} weights "
                f"({w.get('strategy')}), which m2d cannot read (it reads symmetric 8-bit ones); {_DEQUANTISE}"
            )
    specs = {(w.get("strategy"), tuple(w.get("block_structure") or ()) or None, w.get("group_size")) for w in weights}
    strategy, block, group = next(iter(specs)) if len(specs) == 1 else ("", None, None)
    kinds = "/".join(sorted({str(w.get("type", "float")) for w in weights})) or "float"
    return Scheme(
        COMPRESSED,
        f"compressed-tensors 8-bit {kinds}" + (f" (a scale per {strategy})" if strategy else ""),
        block,
        str(strategy or ""),
        group,
        tuple(q.get("ignore") or ()),
    )


def stored_bytes(scheme: Scheme | None, dtype_bytes: int, params: int, quantised: int) -> int:
    """Bytes of a checkpoint as published: `quantised` of its `params` at the scheme's bits, the rest in
    `dtype_bytes` (the config's dtype)."""
    if scheme is None:
        return params * dtype_bytes
    return round(quantised * scheme.stored_bits() / 8) + (params - quantised) * dtype_bytes
