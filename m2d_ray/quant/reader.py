"""A checkpoint's tensors by stored name, dequantised on read where the checkpoint stores them quantised.

`Reader.read(key, rows)` returns what `Checkpoint.read` returns for a tensor stored as it is (a float weight, a
module the checkpoint leaves unquantised) and, for a quantised one, its value in float32 computed from the stored
weight and its scales, only `rows` of its first dimension read (a fused [E, ...] tensor's experts): the memory of a
read is that of the tensor read, as for an unquantised checkpoint. Missing or non-finite scales and scales that do
not fit their weight are refused naming the tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from m2d_ray.checkpoint import Checkpoint, check_finite
from m2d_ray.errors import M2DError
from m2d_ray.quant import COMPRESSED, FP8, MXFP4, Scheme, compressed, fp8, mxfp4

_FIX = "re-download or re-export the model"
#: activation scales a quantised checkpoint stores beside its weights (unused: activations are computed unquantised)
_ACTIVATION_SCALES = ("input_scale", "activation_scale", "output_scale", ".k_scale", ".v_scale")


class Reader:
    """`Checkpoint` reads with the dequantisation of `scheme` (None: the checkpoint's tensors as stored)."""

    def __init__(self, ckpt: Checkpoint, scheme: Scheme | None) -> None:
        self.ckpt, self.scheme = ckpt, scheme

    def __contains__(self, key: str) -> bool:
        return key in self.ckpt or (self._mxfp4(key) and key + mxfp4.BLOCKS in self.ckpt)

    def _mxfp4(self, key: str) -> bool:
        return self.scheme is not None and self.scheme.method == MXFP4 and key not in self.ckpt

    def names(self) -> list[str]:
        """The checkpoint's tensors as the model names them: a quantised weight by its own name (MXFP4's `x` for its
        `x_blocks` and `x_scales`), without the scales read with it or activation scales (activations are computed
        unquantised)."""
        stored = self.ckpt.names()
        if self.scheme is None:
            return sorted(stored)
        if self.scheme.method == MXFP4:  # x for x_blocks and x_scales (read with it, or refused missing)
            blocks = {k.removesuffix(mxfp4.BLOCKS) for k in stored if k.endswith(mxfp4.BLOCKS)}
            companions = {b + suffix for b in blocks for suffix in (mxfp4.BLOCKS, mxfp4.SCALES)}
            return sorted((stored - companions) | blocks)
        scales = {self._scale_key(k) for k in stored if self.quantised(k)}
        return sorted(k for k in stored - scales if not k.endswith(_ACTIVATION_SCALES))

    def quantised(self, key: str) -> bool:
        """Whether `key` is stored quantised: MXFP4 blocks, or an 8-bit weight (its scale beside it, or missing)."""
        if self.scheme is None:
            return False
        if self.scheme.method == MXFP4:
            return self._mxfp4(key) and key + mxfp4.BLOCKS in self.ckpt
        return key in self.ckpt and self.ckpt.shard(key).dtype(key).itemsize == 1

    def _scale_key(self, key: str) -> str:
        return fp8.scale_key(key) if self.scheme.method == FP8 else compressed.scale_key(key)

    def read(self, key: str, rows: Sequence[int] | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """Tensor `key` (only `rows` of its first dimension): as stored, or dequantised into `dtype`."""
        if not self.quantised(key):
            return self.ckpt.read(key, rows)
        if self._mxfp4(key):
            blocks = self._companion(key, key + mxfp4.BLOCKS, rows, finite=False)
            scales = self._companion(key, key + mxfp4.SCALES, rows, finite=False)
            if (scales == 255).any():  # e8m0's NaN
                raise M2DError(f"checkpoint {self.ckpt.dir}: scales {key}{mxfp4.SCALES} hold NaN (255); {_FIX}")
            return self._checked(key, lambda: mxfp4.dequantize(blocks, scales, dtype))
        name = self._scale_key(key)
        scale = self._companion(key, name, rows if self._per_row(key, name) else None)
        weight = self.ckpt.read(key, rows)
        return self._checked(key, lambda: fp8.dequantize_blocks(weight, scale, self.scheme.block, dtype))

    def _per_row(self, key: str, scale: str) -> bool:
        """The scale has a grid per row of the weight's first dimension (a fused [E, ...] tensor's experts)."""
        shape = self.ckpt.shard(key).shape(key)
        return len(shape) > 2 and scale in self.ckpt and self.ckpt.shard(scale).shape(scale)[:1] == shape[:1]

    def _companion(self, key: str, name: str, rows: Sequence[int] | None, finite: bool = True) -> Tensor:
        if name not in self.ckpt:
            method = self.scheme.method if self.scheme else ""
            raise M2DError(
                f"checkpoint {self.ckpt.dir}: {key} is stored quantised ({method}) but its {name} is missing; {_FIX}"
            )
        t = self.ckpt.read(name, rows)
        if finite:
            check_finite([(name, t)], "scale", f"the checkpoint is damaged: {_FIX}")
        return t

    def _checked(self, key: str, dequantise) -> Tensor:
        try:
            return dequantise()
        except ValueError as exc:
            raise M2DError(f"checkpoint {self.ckpt.dir}: {key}: {exc}; {_FIX}") from None


class Dequantised:
    """One tensor of a `Reader`, read when indexed (`t[...]`): what transformers' loader reads a checkpoint's
    tensors through (`from_pretrained(state_dict=...)`), one at a time, as from a safetensors file."""

    def __init__(self, reader: Reader, key: str) -> None:
        self.reader, self.key = reader, key

    def __getitem__(self, index) -> Tensor:
        return self.reader.read(self.key)[index]


__all__ = ["Reader", "Dequantised", "COMPRESSED", "FP8", "MXFP4"]
