"""dtl.config: defaults -> TOML -> --key=value, --help from the dataclass, the value checks every
script gets, and one-line errors for bad input."""

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Annotated, Literal

import pytest

from dtl import config
from dtl.model import PresetName


@dataclass
class Cfg:
    lr: float = 1e-3  # AdamW learning rate
    steps: int = 10  # optimizer steps
    # the run's name,
    # in two comment lines above the field
    name: str = "run"
    compile: bool = False
    out_dir: str = ""  # where outputs go (empty: none)
    ckpt: str | None = None  # a checkpoint to resume from
    val_fraction: float = 0.1  # share of tokens held out


def test_overrides_apply_in_order_defaults_then_toml_then_command_line(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('lr = 3\nsteps = 20\nname = "from_toml"\n')
    cfg = config.load(Cfg, ["--config", str(toml), "--steps=5", "--compile", "--ckpt=a.pt"])
    assert cfg == Cfg(lr=3.0, steps=5, name="from_toml", compile=True, ckpt="a.pt")
    assert isinstance(cfg.lr, float)
    assert config.load(Cfg, ["--compile=false", "--ckpt=none"]) == Cfg()


def test_megatron_style_flags_with_dashes_and_a_space_before_the_value():
    argv = ["--val-fraction", "0.25", "--steps", "3", "--compile", "--name", "x", "--lr=2"]
    assert config.load(Cfg, argv) == Cfg(val_fraction=0.25, steps=3, compile=True, name="x", lr=2.0)
    # a boolean never swallows the next word, and the next flag is never taken as a value
    with pytest.raises(config.ConfigError, match="unexpected argument 'yes'"):
        config.load(Cfg, ["--compile", "yes"])
    with pytest.raises(config.ConfigError, match="'steps' expects int, got 'true'"):
        config.load(Cfg, ["--steps", "--compile"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--lrr=1"],
            "unknown config key 'lrr' in the command line; valid keys: lr (float), steps",
        ),
        (["--steps=1.5"], "config key 'steps' expects int, got '1.5' (str)"),
        (["--compile=maybe"], "config key 'compile' expects bool, got 'maybe'"),
        (["steps=3"], "unexpected argument 'steps=3'; use --key=value"),
        (["--config", "/nope.toml"], "config file not found: /nope.toml"),
    ],
)
def test_bad_input_is_a_one_line_error(argv, message):
    with pytest.raises(config.ConfigError) as err:
        config.load(Cfg, argv)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_toml_values_are_type_checked_too(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text('steps = "ten"\n')
    with pytest.raises(config.ConfigError, match=r"config key 'steps' expects int, got 'ten'"):
        config.load(Cfg, ["--config", str(toml)])
    toml.write_text("typo = 1\n")
    with pytest.raises(config.ConfigError, match=f"unknown config key 'typo' in {toml}"):
        config.load(Cfg, ["--config", str(toml)])


def test_parse_exits_with_code_2_and_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        config.parse(Cfg, ["--nope=1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'nope'") and err.count("\n") == 1


def test_save_prints_and_writes_config_json_and_argv(tmp_path, capsys):
    cfg = config.load(Cfg, ["--steps=7"])
    config.save(cfg, str(tmp_path), argv=["--steps=7"])
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 7
    assert (tmp_path / "argv.txt").read_text().strip().endswith("--steps=7")
    assert "  steps        = 7" in capsys.readouterr().out


def test_help_lists_every_field_with_type_default_and_its_comment():
    with pytest.raises(config.HelpRequested) as h:
        config.load(Cfg, ["--steps=3", "--help"])
    text = str(h.value)
    assert "--config FILE.toml" in text and "-h, --help" in text
    assert "--lr=FLOAT" in text and "AdamW learning rate (default: 0.001)" in text
    assert "--compile={true,false}" in text and "(default: False)" in text
    assert "the run's name, in two comment lines above the field (default: 'run')" in text
    assert "--ckpt=STR | NONE" in text and "a checkpoint to resume from (default: None)" in text
    assert all(f"--{k}=" in text for k in config.to_dict(Cfg()))


@dataclass
class Inherits(Cfg):  # a Config sharing fields with another script's, as plan and compare do
    models: str = "a,b"  # comma-separated


def test_help_documents_the_fields_a_config_inherits_where_its_base_declares_them():
    with pytest.raises(config.HelpRequested) as h:
        config.load(Inherits, ["--help"])
    text = str(h.value)
    assert "AdamW learning rate (default: 0.001)" in text
    assert "comma-separated (default: 'a,b')" in text


def test_parse_answers_help_with_exit_0_on_stdout(capsys):
    with pytest.raises(SystemExit) as exit_:
        config.parse(Cfg, ["-h"])
    assert exit_.value.code == 0
    out = capsys.readouterr()
    assert out.out.startswith("usage: ") and out.err == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr=nan"], "config key 'lr' must be a finite number > 0, got nan"),
        (["--lr=-1"], "config key 'lr' must be a finite number > 0, got -1.0"),
        (["--lr=0"], "config key 'lr' must be a finite number > 0, got 0.0"),
        (["--lr=inf"], "config key 'lr' must be a finite number > 0, got inf"),
        (["--steps=0"], "config key 'steps' must be an integer >= 1, got 0"),
        (["--val_fraction=1.5"], "config key 'val_fraction' must be a fraction in [0, 1], got 1.5"),
    ],
)
def test_values_every_script_shares_are_checked_before_anything_runs(argv, message):
    with pytest.raises(config.ConfigError) as err:
        config.load(Cfg, argv)
    assert str(err.value) == message


def test_out_dir_is_created_and_must_be_writable(tmp_path):
    cfg = config.load(Cfg, [f"--out_dir={tmp_path}/a/b"])
    assert (tmp_path / "a" / "b").is_dir() and cfg.out_dir.endswith("a/b")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(config.ConfigError) as err:
        config.load(Cfg, [f"--out_dir={blocker}/sub"])
    assert str(err.value) == f"out_dir '{blocker}/sub' is not a writable folder: Not a directory"


@dataclass
class NoFloats:
    ratio: float = 0.5  # any finite float, no by-name rule


def test_every_float_must_be_finite_even_without_a_rule():
    assert config.load(NoFloats, ["--ratio=-3"]).ratio == -3.0
    with pytest.raises(config.ConfigError, match="'ratio' must be a finite number, got nan"):
        config.load(NoFloats, ["--ratio=nan"])


MODES = ("hand", "torch")


@dataclass
class Choices:
    impl: Literal[MODES] = "hand"  # who trains
    stage: Annotated[Literal[0, 1, 2, 3], "ZeRO stage"] = 2  # how much is sharded
    model: PresetName = "tiny"  # GPT preset


def test_choice_fields_take_one_of_their_values_and_name_them_when_not():
    cfg = config.load(Choices, ["--impl=torch", "--stage", "3", "--model=small"])
    assert (cfg.impl, cfg.stage, cfg.model) == ("torch", 3, "small")  # "3" read as the int 3
    cases = [
        (["--impl=fsdp"], "unknown impl 'fsdp'; one of hand, torch"),
        (["--stage=4"], "unknown ZeRO stage 4; one of 0, 1, 2, 3"),  # the Annotated label
        (["--stage=two"], "config key 'stage' expects int, got 'two'"),
        (["--model=huge"], "unknown model 'huge'; one of tiny, "),
    ]
    for argv, message in cases:
        with pytest.raises(config.ConfigError, match=re.escape(message)):
            config.load(Choices, argv)


def test_help_lists_a_choice_fields_values():
    text = config.help_text(Choices, prog="x", description="")
    assert "--impl={hand,torch}" in text and "--stage={0,1,2,3}" in text
    assert "how much is sharded (default: 2)" in text


def test_a_choice_field_over_a_dict_is_refused_not_read_as_one_value():
    @dataclass
    class Slip:
        dtype: Literal[{"fp32": 4}] = "fp32"  # meant Literal[tuple(...)]

    with pytest.raises(TypeError, match="a choice field takes str or int values"):
        config.load(Slip, ["--dtype=fp32"])


@dataclass
class Derived:
    steps: int = 2  # optimizer steps
    plan: list = dataclasses.field(default_factory=list, init=False)  # filled by validate()

    def validate(self):
        self.plan = list(range(self.steps))


def test_a_derived_field_is_declared_filled_by_validate_and_neither_a_key_nor_saved():
    cfg = config.load(Derived, ["--steps=3"])
    assert cfg.plan == [0, 1, 2] and config.to_dict(cfg) == {"steps": 3}
    with pytest.raises(config.ConfigError, match="unknown config key 'plan'"):
        config.load(Derived, ["--plan=x"])
    assert "--plan" not in config.help_text(Derived, prog="x", description="")
