"""Reading a config: a YAML file or a shipped name (`include:` read beside the including file), `key=value`
overrides, the keys of earlier versions, each value coerced to its field's type and checked once against its closed
set (with "did you mean"), then the checks (config/checks.py)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from m2d_ray import shipped
from m2d_ray.artifacts import write_text_atomic
from m2d_ray.catalog.distill import AUTO, COMPILED, RETIRED_CHECKPOINTING
from m2d_ray.config.checks import check_config
from m2d_ray.config.fields import REGISTRIES
from m2d_ray.config.schema import SweepConfig
from m2d_ray.console import say
from m2d_ray.errors import M2DError


def load_config(path: str | Path | None, overrides: list[str] = ()) -> SweepConfig:
    """Read a YAML config (a file, else a shipped name such as `tiny`: shipped.find; None = all defaults) and apply
    `a.b=value` overrides."""
    raw: dict = _read_yaml(shipped.find(path)) if path is not None else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise M2DError(
                f"override {item!r} is not key=value: write it like grid.K=[8,16] or search.early_stop=false"
            )
        _set_path(raw, key.strip().split("."), yaml.safe_load(value))
    _retired(raw)
    _retired_checkpointing(raw.get("distill"))
    if (raw.get("distill") or {}).get("kl_kernel") == COMPILED:
        say(
            "distill.kl_kernel=compiled is deprecated: it is read as distill.kl_kernel=chunked distill.compile=true; "
            "write that"
        )
        raw["distill"].update(kl_kernel="chunked", compile=True)
    cfg = _build(SweepConfig, raw, "")
    check_config(cfg)
    return cfg


#: keys of earlier versions: (section, key) -> what replaced them (a saved run's `null` is dropped)
RETIRED = {
    ("ray", "storage_path"): "storage: (students, checkpoints and Tune state, on a path every node mounts or s3://…)"
}


def _retired(raw: dict) -> None:
    for (section, key), instead in RETIRED.items():
        node = raw.get(section)
        if isinstance(node, dict) and key in node:
            if node.pop(key) is not None:
                raise M2DError(f"{section}.{key} was replaced by {instead}; write that instead")


def _retired_checkpointing(distill: dict | None) -> None:
    """distill.gradient_checkpointing (a boolean of earlier versions) read as distill.checkpointing full / none, said
    in one line (a saved run's config keeps running); with both keys given, one line asks for one."""
    if not isinstance(distill, dict) or "gradient_checkpointing" not in distill:
        return
    old = distill.pop("gradient_checkpointing")
    if "checkpointing" in distill:
        raise M2DError("distill.gradient_checkpointing was replaced by distill.checkpointing; give only that one")
    if old not in RETIRED_CHECKPOINTING:
        raise M2DError(f"distill.gradient_checkpointing={old!r}: write distill.checkpointing=none|selective|full|auto")
    distill["checkpointing"] = RETIRED_CHECKPOINTING[old]
    say(
        f"distill.gradient_checkpointing={str(old).lower()} is read as distill.checkpointing="
        f"{distill['checkpointing']}; write that (or auto: the plan picks the least recompute that fits)"
    )


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if not path.exists():
        raise M2DError(f"config {path} not found (an include: is read beside the file that names it)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise M2DError(
            f"{path} is not valid YAML ({getattr(exc, 'problem', None) or str(exc).splitlines()[0]}{where}); fix it"
        ) from None
    if not isinstance(data, dict):
        raise M2DError(f"{path} must be a mapping of keys (name:, model:, grid: ...)")
    base = data.pop("include", None)
    if base is None:
        return data
    base_path = (path.parent / base).resolve()
    if base_path in seen:
        raise M2DError(f"{path}: include cycle through {base_path}")
    return _merge(_read_yaml(base_path, seen + (path.resolve(),)), data)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _set_path(raw: dict, keys: list[str], value: Any) -> None:
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise M2DError(f"override {'.'.join(keys)}: {k} is not a section")
    node[keys[-1]] = value


#: keys a config no longer takes -> what to write instead
RENAMED = {
    "distill.dtype": (
        "distill.precision: bfloat16 -> bf16-mixed (float32 master weights and optimizer states; bf16-pure for "
        "bfloat16 ones), float32 -> fp32, auto -> auto"
    ),
}


def _build(cls, raw: Any, where: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise M2DError(f"{where or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        path = f"{where}{key}"
        if path in RENAMED:
            raise M2DError(f"{path} is now {RENAMED[path]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f" did you mean {where}{close[0]}?" if close else ""
            raise M2DError(f"unknown config key {path!r};{hint} known keys here: {', '.join(names)}")
        hint = hints[key]
        kwargs[key] = _build(hint, value, f"{path}.") if dataclasses.is_dataclass(hint) else _coerce(value, hint, path)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Check/convert a YAML value against a field's type hint (str | None, int, tuple[str, ...], ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None and type(None) in args:
        return None
    if (values := _closed(hint)) is not None:
        if any(value == v and type(value) is type(v) for v in values):
            return value
        raise M2DError(_not_one_of(path, value, hint, values))
    if origin in (Union, types.UnionType):
        alts = [a for a in args if a is not type(None)]
        # a value of a closed set's type is that set's (grid.K: auto or a list), and is answered as such
        closed = [a for a in alts if (vs := _closed(a)) is not None and type(value) in {type(v) for v in vs}]
        errors = []
        for alt in closed or alts:
            try:
                return _coerce(value, alt, path)
            except M2DError as exc:
                errors.append(str(exc))
        raise M2DError(errors[-1])
    if origin is dict:
        if not isinstance(value, dict):
            raise M2DError(f"{path}={value!r} should be a mapping such as {{gpu_h100_8x: 55.04}}")
        return {str(k): _coerce(v, args[1], f"{path}.{k}") for k, v in value.items()}
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce(v, args[0], path) for v in items)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }
    if hint in ok and ok[hint](value):
        return float(value) if hint is float else value
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    name = getattr(hint, "__name__", hint)
    raise M2DError(f"{path}={value!r} should be {name}: give a{'n' * (str(name)[0] in 'aeiou')} {name}")


def dump_config(cfg: SweepConfig, path: str | Path) -> None:

    write_text_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def _closed(hint: Any) -> tuple | None:
    """The values a closed-set field takes (a Literal, a union of Literals and bool: distill.deepspeed), else None."""
    alts = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    values: list = []
    for a in alts:
        if a is bool:
            values += [True, False]
        elif typing.get_origin(a) is Literal:
            values += typing.get_args(a)
        elif a is not type(None):
            return None
    return tuple(values)


def _not_one_of(path: str, value: Any, hint: Any, values: tuple) -> str:
    """One line for a value outside its closed set: the registry's own (with "did you mean"), or the values, the
    closest first."""
    shown = [_yaml(v) for v in values]
    registry = next((r for alt in (hint, *typing.get_args(hint)) if (r := REGISTRIES.get(alt)) is not None), None)
    if registry is not None and isinstance(value, str):
        line = registry.unknown_message(value)
        line = line if path in line else f"{path}: {line}"
        return line + (f" (or {AUTO})" if AUTO in values else "")
    close = difflib.get_close_matches(str(_yaml(value)), [str(v) for v in shown], n=1, cutoff=0.5)
    hint_ = f"did you mean {close[0]}? " if close else ""
    listed = ", ".join(map(str, shown[:-1])) + f" or {shown[-1]}" if len(shown) > 1 else str(shown[0])
    return f"{path}={value!r}: {hint_}use {listed}"


def _yaml(value: Any) -> Any:
    """A value as YAML writes it (true, false)."""
    return {True: "true", False: "false"}.get(value, value) if isinstance(value, bool) else value
