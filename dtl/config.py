"""Config = dataclass defaults, then an optional TOML file, then `--key=value` overrides.

    @dataclass
    class Config:
        lr: float = 1e-3          # a field's comment is its documentation
        out_dir: str = "outputs/day15_collectives/ddp_mnist"

    cfg = parse(Config)           # reads sys.argv: [--config f.toml] [--key=value ...]

An unknown key or a value of the wrong type is a one-line error that lists the valid keys, raised
before the script touches a process group (nanoGPT's configurator does the same, more bluntly).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tomllib
import types
import typing

from dtl.dist import get_rank


class ConfigError(ValueError):
    """Bad config input; the message is one line, fit for the user."""


def _field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _valid_keys(cls) -> str:
    return ", ".join(
        f"{k} ({t.__name__ if hasattr(t, '__name__') else t})" for k, t in _field_types(cls).items()
    )


def _coerce(key: str, value, typ):
    """Convert a TOML value or a command-line string to the field's type, or explain why not."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        typ = args[0]
    try:
        if isinstance(value, str) and typ is not str:
            if typ is bool:
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            return typ(value)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if typ is bool and not isinstance(value, bool):
            raise ValueError
        if typ in (int, float) and isinstance(value, bool):
            raise ValueError
        if not isinstance(value, typ):
            raise ValueError
        return value
    except (ValueError, TypeError):
        raise ConfigError(
            f"config key '{key}' expects {typ.__name__}, got {value!r} ({type(value).__name__})"
        ) from None


def _apply(cfg, updates: dict, source: str):
    field_types = _field_types(type(cfg))
    for key, value in updates.items():
        if key not in field_types:
            raise ConfigError(
                f"unknown config key '{key}' in {source}; valid keys: {_valid_keys(type(cfg))}"
            )
        setattr(cfg, key, _coerce(key, value, field_types[key]))
    return cfg


def load(cls, argv: list[str] | None = None):
    """Build a `cls` instance from defaults, `--config FILE` (TOML) and `--key=value` arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = cls()
    overrides: dict[str, str] = {}
    config_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; use --key=value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:  # `--config f.toml` or a bare boolean flag `--compile`
            if key == "config" and i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                value = "true"
        if key == "config":
            config_file = value
        else:
            overrides[key] = value
        i += 1
    if config_file is not None:
        if not os.path.isfile(config_file):
            raise ConfigError(f"config file not found: {config_file}")
        with open(config_file, "rb") as f:
            try:
                table = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {config_file} is not valid TOML: {e}") from None
        _apply(cfg, table, config_file)
    _apply(cfg, overrides, "the command line")
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def parse(cls, argv: list[str] | None = None):
    """`load`, but bad input exits with one line on stderr (exit code 2), not a traceback."""
    try:
        return load(cls, argv)
    except ConfigError as e:
        exit_with_error(e)


def exit_with_error(error: Exception | str) -> None:
    """Bad user input: one line `error: ...` on stderr (rank 0), exit code 2 on every rank."""
    if get_rank() == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def describe(cfg) -> str:
    width = max(len(k) for k in to_dict(cfg))
    return "\n".join(f"  {k:<{width}} = {v!r}" for k, v in to_dict(cfg).items())


def save(cfg, out_dir: str, argv: list[str] | None = None) -> None:
    """Print the resolved config and write config.json + argv.txt (rank 0 only)."""
    if get_rank() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    print(f"config ({type(cfg).__name__}):\n{describe(cfg)}", flush=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f, indent=2)
    with open(os.path.join(out_dir, "argv.txt"), "w") as f:
        f.write(" ".join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]) + "\n")
