"""`m2d calibrate`: one pass of calibration statistics -> a statistics artifact (reused when it matches)."""

from __future__ import annotations

import json
from pathlib import Path

from m2d_ray.artifacts import check_output
from m2d_ray.calibrate import StatsArtifact, calibrate, data_fingerprint
from m2d_ray.calibrate.artifact import load_matching
from m2d_ray.calibrate.tokens import calibration_tokens, resolve_calib
from m2d_ray.config import CalibConfig
from m2d_ray.console import emit
from m2d_ray.data.text import check_spec
from m2d_ray.models import (
    Teacher,
    check_teacher,
    default_teacher,
    device_default,
    load_tokenizer,
    model_config,
    model_fingerprint,
)
from m2d_ray.sizes import parse_size
from m2d_ray.weights import LazyTeacher, open_teacher


def run_calibrate(
    model: str | None,
    calib_data: str | None,
    out: str | Path | None,
    max_tokens: int = CalibConfig.max_tokens,
    seq_len: int = CalibConfig.seq_len,
    batch_size: int = CalibConfig.batch_size,
    device: str | None = None,
    teacher: Teacher | LazyTeacher | None = None,
    overwrite: bool = False,
    what: str = "--out",
    stream: bool | None = None,
    max_memory: str | None = None,
) -> tuple[Teacher | LazyTeacher | None, StatsArtifact, bool]:
    """The statistics artifact; `out` is reused when it matches (teacher None then, unless given).

    Everything but the weights is checked first: the teacher's config and files, the data, the output,
    the memory budget. The teacher is opened lazily; it is streamed layer by layer when `stream` is set
    or it does not fit `max_memory` (default: the device's free memory), else loaded whole.
    """
    name = model or default_teacher()
    check_teacher(name)
    parse_size(max_memory)
    check_spec(resolve_calib(calib_data, model), "calibration data")
    if out is not None:
        check_output(out, "statistics", overwrite=True, what=what)  # never a file or a foreign directory
    tokenizer = teacher.tokenizer if teacher else load_tokenizer(name)
    spec, tokens = calibration_tokens(tokenizer, calib_data, model, seq_len, max_tokens)
    if out is not None:
        found = load_matching(out, model_fingerprint(name, model_config(name)), data_fingerprint(spec, tokens))
        if found is not None:
            return teacher, found, True
        check_output(out, "statistics", overwrite, what)  # other statistics: replaced only on --overwrite
    device = device or device_default()
    teacher = teacher or open_teacher(name, device=device)
    art, _ = calibrate(
        teacher,
        tokens,
        spec,
        out=out,
        batch_size=batch_size,
        device=device,
        stream=stream,
        max_memory=max_memory,
        overwrite=overwrite,
    )
    return teacher, art, False


def main(args) -> None:
    _, art, reused = run_calibrate(
        args.model, args.calib_data, args.out, device=args.device, overwrite=args.overwrite, **calib_options(args)
    )
    m = art.manifest
    emit(
        json.dumps(
            {
                "out": args.out,
                "reused": reused,
                "n_tokens": m["n_tokens"],
                "layers": m["layers"],
                "num_experts": m["num_experts"],
                "sha256": m["sha256"],
            }
        )
    )


def calib_options(args) -> dict:
    """The calibration options a command's parser has (cli._add_calib)."""
    return {
        k: getattr(args, k) for k in ("max_tokens", "seq_len", "batch_size", "max_memory", "stream") if hasattr(args, k)
    }
