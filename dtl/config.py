"""Config = dataclass defaults, then an optional TOML file, then `--key=value` overrides.

    @dataclass
    class Config:
        lr: float = 1e-3  # AdamW learning rate      <- a field's comment is its --help line
        out_dir: str = "outputs/day15_collectives/ddp_mnist"

    cfg = parse(Config)  # reads sys.argv: [--config f.toml] [--key=value ...] [--help]

Everything here runs before the script touches a process group, so bad input never reaches a
collective:
- `--help` / `-h` prints every field with its type, default and comment, and exits 0;
- an unknown key or a value of the wrong type is a one-line error listing the valid keys;
- a choice field (typed `Literal[...]`, see `choices`) takes one of its values, or says which;
- numbers are checked once for every script: a field's declared `Range` (Annotated[int,
  Range(lo=0)]), else a rule by its name (learning rates and eps > 0, counts and parallel sizes
  >= 1, workers, warm-up, clipping and decay >= 0, fractions in [0, 1]); every float finite,
  `out_dir` created and writable; then the dataclass's own `validate()` runs, if it has one.
Errors exit with code 2 and one line on stderr (nanoGPT's configurator does the same, more
bluntly). Why not tyro (torchtitan's choice)? It builds the same command line from dataclasses,
but its syntax is `--lr 1e-3`, it has no TOML layer, and its errors are multi-line panels: we keep
the small parser the days already share.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import os
import re
import sys
import tempfile
import textwrap
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

from dtl.dist import exit_with_error, get_rank  # noqa: F401 (re-exported for the days)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_C = TypeVar("_C", bound="DataclassInstance")  # a config: a dataclass instance


class ConfigError(ValueError):
    """Bad config input; the message is one line, fit for the user."""


def int_list(key: str, value: str, minimum: int = 1) -> list[int]:
    """A field holding comma-separated integers ("8,64"), each >= minimum: the list, or a
    ConfigError naming the field (`validate` methods call it)."""
    try:
        sizes = [int(v) for v in value.split(",")]
    except ValueError:
        raise ConfigError(f"{key} must be comma-separated integers, got {value!r}") from None
    if min(sizes) < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value!r}")
    return sizes


class HelpRequested(Exception):
    """--help was given; the message is the help text."""


def _field_types(cls: type[DataclassInstance]) -> dict[str, Any]:
    # each field's type expression (int, X | None, Literal[...], Annotated[...]): Any to mypy
    hints = typing.get_type_hints(cls, include_extras=True)  # keep Annotated's label
    return {f.name: hints[f.name] for f in settable_fields(cls)}


def settable_fields(
    cls: DataclassInstance | type[DataclassInstance],
) -> list[dataclasses.Field[Any]]:
    """The fields a user sets (defaults, TOML, --key=value). A field declared with
    `dataclasses.field(init=False, ...)` is derived: `validate()` fills it (a loaded ds_config,
    the planned device), it is no key and is not saved, but it is declared, so a reader sees
    every attribute a config has."""
    return [f for f in dataclasses.fields(cls) if f.init]


def choices(typ: Any) -> tuple[str | None, tuple[str | int, ...]] | None:
    """(label, values) of a choice field, else None. A choice field is typed Literal[...], or
    Annotated[Literal[...], "label"] where the error should name it otherwise than by its key:

        impl: Literal["hand", "torch", "deepspeed"] = "hand"
        stage: Annotated[Literal[0, 1, 2, 3], "ZeRO stage"] = 2
        model: PresetName = "tiny"          # dtl.model's Literal of every preset
    """
    label = None
    if typing.get_origin(typ) is typing.Annotated:
        typ, *meta = typing.get_args(typ)
        label = next((m for m in meta if isinstance(m, str)), None)
    if typing.get_origin(typ) is typing.Literal:
        values = typing.get_args(typ)
        if not all(isinstance(v, str | int) for v in values):  # Literal[some_dict]: a slip
            raise TypeError(f"a choice field takes str or int values, got {values!r}")
        return label, values
    return None


def _plain(typ: Any) -> Any:
    """The type under Annotated[...] (its label is for choices)."""
    return typing.get_args(typ)[0] if typing.get_origin(typ) is typing.Annotated else typ


def _type_name(t: Any) -> str:
    choice = choices(t)
    if choice:
        return "{" + ",".join(map(str, choice[1])) + "}"
    t = _plain(t)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(t))
    return "None" if t is type(None) else getattr(t, "__name__", str(t))


def _valid_keys(cls: type[DataclassInstance]) -> str:
    return ", ".join(f"{k} ({_type_name(t)})" for k, t in _field_types(cls).items())


def _coerce(key: str, value: object, typ: Any) -> object:
    """Convert a TOML value or a command-line string to the field's type, or explain why not."""
    choice = choices(typ)
    if choice:
        label, values = choice
        got = _coerce(key, value, type(values[0]))
        if got not in values:
            name = label or key.replace("_", " ")
            raise ConfigError(f"unknown {name} {got!r}; one of {', '.join(map(str, values))}")
        return got
    typ = _plain(typ)
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


def _apply(cfg: _C, updates: Mapping[str, object], source: str) -> _C:
    field_types = _field_types(type(cfg))
    for key, value in updates.items():
        if key not in field_types:
            raise ConfigError(
                f"unknown config key '{key}' in {source}; valid keys: {_valid_keys(type(cfg))}"
            )
        setattr(cfg, key, _coerce(key, value, field_types[key]))
    return cfg


# --- checks every script gets: a field's declared Range, else a rule by its name ----------------


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric field allows, declared with its type where the name rule below does
    not fit (a 0 that means "auto", a size that must be > 0):

        micro_batch_size: Annotated[int, Range(lo=0)] = 0      # 0: the planner picks
        bucket_cap_mb: Annotated[float, POSITIVE] = 25.0        # Range(lo=0, lo_open=True)
    """

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself excluded (a size > 0)
    hi_open: bool = False  # hi itself excluded (Adam's beta < 1)
    text: str = ""  # how the error names the range ("a fraction in [0, 1]"); else built

    def allows(self, v: float) -> bool:
        above = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        below = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return math.isfinite(v) and above and below

    def describe(self, value: float) -> str:
        if self.text:
            return self.text
        low = None if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo:g}"
        high = None if self.hi is None else f"{'<' if self.hi_open else '<='} {self.hi:g}"
        kind = "an integer" if isinstance(value, int) else "a finite number"
        return f"{kind} " + " and ".join(x for x in (low, high) if x)


AT_LEAST_1, NON_NEGATIVE, POSITIVE = Range(lo=1), Range(lo=0), Range(lo=0, lo_open=True)
FRACTION = Range(lo=0, hi=1, text="a fraction in [0, 1]")

# the by-name rules: a field called so, in any script, takes these values
COUNT_NAMES = {
    "steps", "epochs", "batch_size", "seq_len", "grad_accum", "iters", "reps", "repeats",
    "log_every", "micro_batches", "microbatches", "micro_batch_size", "global_batch_size",
    "global_batch", "tp", "pp", "cp", "ep", "chunks", "heads", "head_dim", "n_head", "n_embd",
    "saves", "nproc", "keep", "train_iters", "seq_length", "eval_batches", "gpus_per_node", "world",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by",
}  # fmt: skip
NON_NEGATIVE_NAMES = {
    "workers", "warmup", "save_every", "eval_every", "sample_tokens", "save_at", "stop_at",
    "clip", "clip_grad", "weight_decay", "num_layers", "vocab_size", "gpus", "step_sleep_s",
    "hold_s", "global_batch_tokens", "num_layers_per_virtual_pipeline_stage",
}  # fmt: skip
POSITIVE_NAMES = {"eps", "adam_eps", "t_f_ms"}


def _name_rule(name: str) -> Range | None:
    if name == "lr" or name.endswith("_lr") or name in POSITIVE_NAMES:
        return POSITIVE
    if name in COUNT_NAMES:
        return AT_LEAST_1
    if name in NON_NEGATIVE_NAMES or name.endswith(("_mb", "_gb")):
        return NON_NEGATIVE
    if name.endswith(("_fraction", "_frac", "accuracy")) or name == "dropout":
        return FRACTION
    if name == "mfu":  # a share of the peak a run reaches: above 0, at most all of it
        return Range(lo=0, hi=1, lo_open=True)
    if name.startswith("adam_beta"):
        return Range(lo=0, hi=1, hi_open=True)
    if name.endswith(("_pct", "_percent")):
        return Range(lo=0, hi=100, text="a percentage in [0, 100]")
    return None


def _declared_range(typ: Any) -> Range | None:
    if typing.get_origin(typ) is typing.Annotated:
        return next((m for m in typing.get_args(typ)[1:] if isinstance(m, Range)), None)
    return None


def check_values(cfg: DataclassInstance) -> None:
    """The shared numeric checks: a declared Range, else the name's rule; finite floats."""
    types_ = _field_types(type(cfg))
    for key, value in to_dict(cfg).items():
        if isinstance(value, bool) or value is None or not isinstance(value, (int, float)):
            continue
        rule = _declared_range(types_.get(key)) or _name_rule(key)
        if rule and not rule.allows(value):
            raise ConfigError(f"config key '{key}' must be {rule.describe(value)}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")


def ensure_writable_dir(path: str, key: str = "out_dir") -> None:
    """Create `path` if needed and prove it is writable, or raise a one-line ConfigError."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"{key} '{path}' is not a writable folder: {reason}") from None


# --- --help -----------------------------------------------------------------------------------


def field_comments(cls: type) -> dict[str, str]:
    """Each field's documentation: its trailing `# comment`, or else the comment lines just above
    it (as in Python, a comment line describes what follows it). Fields a config inherits from a
    dataclass it shares with other scripts are documented where that base declares them."""
    docs = {}
    for klass in reversed(cls.__mro__):  # bases first: a subclass may document a field anew
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_comments(klass))
    return docs


def _own_field_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    docs = {}
    for node in cast(ast.ClassDef, ast.parse(source).body[0]).body:  # the class's source
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            end = cast(int, node.end_lineno)  # set on every node ast.parse builds
            trailing = re.search(r"#\s*(.*)$", lines[end - 1][node.end_col_offset :])
            above: list[str]
            above, k = [], node.lineno - 2
            while k >= 0 and lines[k].strip().startswith("#"):
                above.insert(0, lines[k].strip().lstrip("#").strip())
                k -= 1
            docs[node.target.id] = trailing.group(1) if trailing else " ".join(above)
    return docs


def help_text(
    cls: type[DataclassInstance], prog: str | None = None, description: str | None = None
) -> str:
    prog = prog or _program_name()
    description = description if description is not None else _main_description()
    types_ = _field_types(cls)
    docs = field_comments(cls)
    defaults = dataclasses.asdict(cls())
    rows = [
        (f"--{k}={_flag_value(t)}",
         f"{docs.get(k, '')} (default: {defaults[k]!r})".strip())
        for k, t in types_.items()
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    body = "\n".join(f"  {flag:<{width}}  {doc}" for flag, doc in rows)
    head = f"usage: {prog} [--config FILE.toml] [--key=value ...]"
    return (
        f"{head}\n\n{description}\n\n"
        f"options (a TOML file sets the same keys; --key=value overrides it):\n"
        f"  {'--config FILE.toml':<{width}}  read defaults from a TOML file\n"
        f"  {'-h, --help':<{width}}  show this message and exit\n{body}"
    )


def _flag_value(t: Any) -> str:
    if _plain(t) is bool:
        return "{true,false}"
    return _type_name(t) if choices(t) else _type_name(t).upper()


def _program_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name}"
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script"


def _main_description() -> str:
    doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
    return doc.strip().split("\n\n")[0]


# --- parsing ----------------------------------------------------------------------------------


def load(cls: type[_C], argv: list[str] | None = None) -> _C:
    """Build a `cls` instance from defaults, `--config FILE` (TOML) and `--key=value` arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        raise HelpRequested(help_text(cls))
    cfg = cls()
    types_ = _field_types(cls)
    overrides: dict[str, str] = {}
    config_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; use --key=value (or --help)")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")  # Megatron's spelling: --tensor-model-parallel-size
        if not eq:  # `--config f.toml`, `--key value` (Megatron-LM's style), or `--flag`
            takes_value = key == "config" or (key in types_ and types_[key] is not bool)
            if takes_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
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
        _apply(cfg, _read_toml(config_file), config_file)
    _apply(cfg, overrides, "the command line")
    check_values(cfg)
    if hasattr(cfg, "validate"):
        cfg.validate()  # the script's own checks; it may also fill in a default out_dir
    if out_dir := getattr(cfg, "out_dir", None):
        ensure_writable_dir(out_dir)
    return cfg


def _read_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def parse(cls: type[_C], argv: list[str] | None = None) -> _C:
    """`load`, but --help prints and exits 0, and bad input exits with one line (exit code 2)."""
    try:
        return load(cls, argv)
    except HelpRequested as h:
        if get_rank() == 0:
            print(h, flush=True)
        raise SystemExit(0) from None
    except ConfigError as e:
        exit_with_error(e)


def to_dict(cfg: DataclassInstance) -> dict[str, Any]:
    """The settable fields and their values (derived fields left out)."""
    values = dataclasses.asdict(cfg)  # once: it deep-copies every field
    return {f.name: values[f.name] for f in settable_fields(type(cfg))}


def describe(cfg: DataclassInstance) -> str:
    width = max(len(k) for k in to_dict(cfg))
    return "\n".join(f"  {k:<{width}} = {v!r}" for k, v in to_dict(cfg).items())


def save(cfg: DataclassInstance, out_dir: str, argv: list[str] | None = None) -> None:
    """Print the resolved config and write config.json + argv.txt (rank 0 only)."""
    if get_rank() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    print(f"config ({type(cfg).__name__}):\n{describe(cfg)}", flush=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f, indent=2)
    with open(os.path.join(out_dir, "argv.txt"), "w") as f:
        f.write(" ".join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]) + "\n")
