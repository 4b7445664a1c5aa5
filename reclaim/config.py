"""Configs for every command that takes `--config`: a dataclass with HF/TRL field names, filled
from a YAML file (or a config bundled with reclaim, by name) and `--field value` overrides.

Types are checked by pydantic against the dataclass's annotations; an unknown field is refused by
name with the allowed ones listed, a wrong type names the field, the value and the type it takes,
and the dataclass's own `__post_init__` checks the values.

    cfg = load_config(SSMTrainConfig, "ssm-tiny", ["--learning_rate", "3e-4", "--resume_from_checkpoint"])
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
CONFIG_PACKAGE, CONFIG_DIR = "reclaim", "configs"  # bundled configs: reclaim/configs/*.yaml
NONE_WORDS = ("none", "null", "~")


class ConfigError(ValueError):
    """A config that cannot be built: the message says which field and what is allowed."""


# ---- where a config comes from -----------------------------------------------------------------

def _bundled_dir() -> Any:
    return resources.files(CONFIG_PACKAGE) / CONFIG_DIR


def bundled_configs() -> list[str]:
    """Names of the configs shipped inside the package (`--config NAME`)."""
    return sorted(f.name.removesuffix(".yaml") for f in _bundled_dir().iterdir()
                  if f.name.endswith(".yaml"))


def read_config_text(path_or_name: str | os.PathLike) -> tuple[str, str]:
    """(where it came from, YAML text) of a config file path or a bundled config name."""
    path = Path(path_or_name).expanduser()
    if path.is_file():
        return str(path), path.read_text()
    name = str(path_or_name).removesuffix(".yaml")
    bundled = _bundled_dir() / f"{name}.yaml"
    if "/" not in name and os.sep not in name and bundled.is_file():
        return f"bundled config {name!r}", bundled.read_text()
    raise ConfigError(f"config {str(path_or_name)!r} is neither a file nor a bundled config; "
                      f"bundled: {bundled_configs()}")


# ---- field types -------------------------------------------------------------------------------

def config_fields(cls: type) -> dict[str, Any]:
    """The dataclass's init fields and their (resolved) types."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _members(tp: Any) -> tuple[Any, ...]:
    """The alternatives of a union type (the type itself otherwise)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _type_name(tp: Any) -> str:
    return " | ".join("None" if m is type(None) else getattr(m, "__name__", str(m))
                      for m in _members(tp))


def _is_bool(tp: Any) -> bool:
    return bool in _members(tp)


# ---- command-line overrides --------------------------------------------------------------------

def _cli_value(tp: Any, text: str) -> Any:
    """A command-line string as YAML would read it, for fields that are not plain strings."""
    import yaml

    members = _members(tp)
    if type(None) in members and text.strip().lower() in NONE_WORDS:
        return None
    if str in members:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # pydantic then names the field and the type it takes


def parse_overrides(cls: type, args: Sequence[str]) -> dict[str, Any]:
    """`--field value`, `--field=value`, and for bool fields `--field` (true) or `--no_field`.

    Dashes in names become underscores; an unknown name is refused with the allowed ones.
    """
    fields = config_fields(cls)
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected --field value, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in fields and key.startswith("no_") and _is_bool(fields.get(key[3:])) and not eq:
            out[key[3:]] = False
            i += 1
            continue
        _check_names(cls, {key: None}, "the command line")
        has_next = i + 1 < len(args) and not args[i + 1].startswith("--")
        if eq:
            out[key] = _cli_value(fields[key], value)
        elif has_next:
            out[key] = _cli_value(fields[key], args[i + 1])
            i += 1
        elif _is_bool(fields[key]):
            out[key] = True
        else:
            raise ConfigError(f"{arg} needs a value ({key} takes {_type_name(fields[key])})")
        i += 1
    return out


# ---- building the dataclass --------------------------------------------------------------------

def _check_names(cls: type, raw: Mapping[str, Any], source: str) -> None:
    fields = config_fields(cls)
    unknown = [k for k in raw if k not in fields]
    if unknown:
        hints = {k: difflib.get_close_matches(k, fields, n=1) for k in unknown}
        near = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in hints.items() if m)
        raise ConfigError(f"unknown {cls.__name__} field(s) {unknown} in {source}"
                          + (f" ({near})" if near else "") + f"; allowed: {sorted(fields)}")


def _validate(cls: type[T], raw: dict[str, Any]) -> T:
    import pydantic

    fields = config_fields(cls)
    for k, v in raw.items():  # pydantic reads True as 1 for an int field: refuse it here
        if isinstance(v, bool) and not _is_bool(fields[k]) and not any(
                m is typing.Any for m in _members(fields[k])):
            raise ConfigError(f"{k}={v!r}: {k} takes {_type_name(fields[k])}, not a boolean")
    try:
        return pydantic.TypeAdapter(cls).validate_python(raw)
    except pydantic.ValidationError as e:
        problems = []
        for err in e.errors():
            loc = err["loc"]
            if not loc:  # raised by the dataclass's own __post_init__
                problems.append(str(err.get("ctx", {}).get("error", err["msg"])))
                continue
            name = str(loc[0])
            problems.append(f"{name}={err['input']!r}: {name} takes {_type_name(fields[name])} "
                            f"({err['msg']})")
        raise ConfigError("; ".join(problems)) from None


def load_config(cls: type[T], path_or_name: str | os.PathLike | None = None,
                overrides: Mapping[str, Any] | Sequence[str] | None = None) -> T:
    """A `cls` instance from a YAML file or bundled config name (None: the defaults), with overrides
    (a mapping of field: value, or command-line `--field value` strings) applied on top."""
    import yaml

    raw: dict[str, Any] = {}
    if path_or_name is not None:
        source, text = read_config_text(path_or_name)
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{source} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{source} must hold a mapping of field: value, "
                              f"got {type(loaded).__name__}")
        raw = dict(loaded or {})
        _check_names(cls, raw, source)
    if overrides is not None:
        if not isinstance(overrides, Mapping):
            overrides = parse_overrides(cls, list(overrides))
        _check_names(cls, overrides, "the overrides")
        raw.update(overrides)
    return _validate(cls, raw)
