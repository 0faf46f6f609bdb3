"""Typed configuration: dataclasses built from YAML / dicts with strict key checking.

Every preset (``envs/*.yaml``, ``agents/*.yaml``) is a plain mapping that ``from_dict`` turns
into a dataclass. Unknown keys are errors with a "did you mean" suggestion, so a misspelt key
never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from specrl.errors import ConfigError, did_you_mean

T = TypeVar("T")


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} fits none of the allowed types ({tp}).")
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}.")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}.")
        (arg,) = typing.get_args(tp)[:1] or (Any,)
        items = [_convert(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}.")
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}.")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}.")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}.")
        return value
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}.")
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys raise ConfigError with a suggestion."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            raise ConfigError(
                f"Unknown key {path!r} in {cls.__name__}.{did_you_mean(key, fields)} "
                f"Allowed keys: {', '.join(sorted(fields))}."
            )
        kwargs[key] = _convert(value, hints[key], path)
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from e
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Preset {str(path)!r} does not exist. Fix: pass an existing YAML file (see envs/ and agents/).")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"Preset {str(path)!r} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"Preset {str(path)!r} must be a mapping of keys to values, got {type(data).__name__}.")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML) to a nested mapping."""
    items = overrides.items() if isinstance(overrides, dict) else [split_override(o) for o in overrides]
    out = {**data}
    for key, value in items:
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node[p] = dict(node.get(p) or {})
            node = node[p]
        node[parts[-1]] = value
    return out


def split_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"Override {item!r} is not of the form key=value. Fix: e.g. --set workload.rate=4.")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw)
