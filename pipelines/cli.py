"""One command line for every job: a typed config dataclass, overridden by `--config FILE` (YAML or JSON), then by
`--section.field VALUE` flags; then validated."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml


def parse_config(argv: list[str] | None, default, description: str = ""):
    """default < --config FILE (YAML or JSON) < --section.field VALUE flags; then validated. Any config dataclass
    with to_dict / from_dict / validate (StageConfig, pipelines.ul2.Ul2Config)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML or JSON file with any of the sections below")
    flat = flatten(default.to_dict())
    for key, value in flat.items():
        parser.add_argument(f"--{key}", default=None, metavar=type(value).__name__.upper() if value is not None else "VALUE",
                            help=f"default: {value}")
    args = vars(parser.parse_args(argv))
    data = default.to_dict()
    config_file = args.pop("config")
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            parser.error(f"--config {config_file}: no such file")
        _merge(data, yaml.safe_load(path.read_text()) or {}, "")
    for key, raw in args.items():
        if raw is not None:
            _set(data, key, raw)
    return type(default).from_dict(data).validate()


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}: the flags' names, and the params MLflow records."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _merge(data: dict[str, Any], updates: dict[str, Any], prefix: str) -> None:
    for key, value in updates.items():
        if key not in data:
            raise ValueError(f"unknown config key {prefix + key!r}; known: {sorted(data)}")
        if isinstance(data[key], dict):
            if not isinstance(value, dict):
                raise ValueError(f"config key {prefix}{key!r} is a section; give it a mapping")
            _merge(data[key], value, f"{prefix}{key}.")
        else:
            data[key] = value


def _set(data: dict[str, Any], dotted: str, raw: str) -> None:
    *sections, name = dotted.split(".")
    target = data
    for section in sections:
        target = target[section]
    target[name] = yaml.safe_load(raw) if raw.lower() not in ("none", "null") else None


def from_typed_dict(cls, data: dict[str, Any], prefix: str = ""):
    """A (nested) config dataclass from plain data, coercing each value to its field's type; unknown keys fail."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown config keys {sorted(prefix + k for k in unknown)}")
    for f in fields(cls):
        if f.name not in data:
            continue
        hint, value = hints[f.name], data[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = from_typed_dict(hint, value or {}, f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = _coerce(value, hint, f"{prefix}{f.name}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"config key {name} cannot be empty")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)  # YAML reads 3e-4 as a string
            except ValueError:
                continue
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is bool and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if option is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ValueError(f"config key {name} expects {hint}, got {value!r}")
