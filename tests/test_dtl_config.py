"""dtl.config: defaults -> TOML -> --key=value, and one-line errors for bad input."""

import json
from dataclasses import dataclass

import pytest

from dtl import config


@dataclass
class Cfg:
    lr: float = 1e-3
    steps: int = 10
    name: str = "run"
    compile: bool = False
    out_dir: str = "outputs/x"
    ckpt: str | None = None


def test_overrides_apply_in_order_defaults_then_toml_then_command_line(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('lr = 3\nsteps = 20\nname = "from_toml"\n')
    cfg = config.load(Cfg, ["--config", str(toml), "--steps=5", "--compile", "--ckpt=a.pt"])
    assert cfg == Cfg(lr=3.0, steps=5, name="from_toml", compile=True, ckpt="a.pt")
    assert isinstance(cfg.lr, float)
    assert config.load(Cfg, ["--compile=false", "--ckpt=none"]) == Cfg()


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
    assert "steps   = 7" in capsys.readouterr().out
