"""Day 22 beside Megatron-LM: every flag train_megatron.py accepts is one of Megatron-LM's (or is
named below as ours only, with the reason), and the README's pretrain_gpt.py and preprocess_data.py
lines, and its flag-for-flag table, use only flags Megatron-LM's parsers have.

Megatron-LM is not installed here (megatron-core is): its parsers are read from the snapshots in
day22_megatron/, written by tools/megatron_lm_flags.py from its source at the tag of the
megatron-core release the course pins. One process, no process group.
"""

import importlib.metadata
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from day22_megatron import train_megatron
from dtl import config as dtl_config
from dtl import extras
from dtl.testing import needs_extras

DAY = Path(train_megatron.__file__).resolve().parent
PRETRAIN, PREPROCESS = "megatron_lm_flags.txt", "megatron_lm_preprocess_flags.txt"
SECTION = "### The same run in Megatron-LM"

# train_megatron.py's flags that Megatron-LM's pretrain_gpt.py does not have, and why
OURS_ONLY = {
    "--model": "a dtl.model preset names the shape; Megatron-LM takes each size: --num-layers, ...",
    "--precision": "one choice of dtype; Megatron-LM: no flag for fp32, --bf16 or --fp16",
    "--check": "rank 0's one-process reference run; Megatron-LM has none",
    "--out-dir": "the run's config and metrics folder; Megatron-LM has --save, --tensorboard-dir",
    "--config": "dtl.config's TOML file of the same keys; Megatron-LM's nearest is --yaml-cfg",
}


def snapshot(name: str) -> set[str]:
    return {line for line in (DAY / name).read_text().splitlines() if line.startswith("--")}


def our_flags() -> set[str]:
    """What dtl.config.load takes for train_megatron.Config, in Megatron-LM's spelling: field
    `a_b` is --a-b (load also takes --a_b), plus load's own --config FILE and --help."""
    fields = dtl_config.settable_fields(train_megatron.Config)
    return {"--config", "--help"} | {"--" + f.name.replace("_", "-") for f in fields}


def _section() -> str:
    return (DAY / "README.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]


def readme_command(program: str) -> list[str]:
    """The words after `program` on the section's shell line that runs it."""
    for block in re.findall(r"```bash\n(.*?)```", _section(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if program in line:  # only that line: others hold a multi-line python -c
                words = shlex.split(line, comments=True)
                return words[words.index(program) + 1 :]
    raise AssertionError(f"no {program} line under '{SECTION}' in day22_megatron/README.md")


def flags_of(words) -> set[str]:
    return {w.split("=")[0] for w in words if w.startswith("--")}


def readme_table() -> list[tuple[set[str], set[str]]]:
    """(ours, Megatron-LM) flags of each row of the section's table; ours in dashes."""
    rows = []
    for line in _section().splitlines():
        cells = line.strip().strip("|").split("|")
        if line.startswith("|") and len(cells) == 3:
            ours, theirs = (set(re.findall(r"--[\w-]+", " ".join(re.findall(r"`([^`]*)`", c))))
                            for c in cells[:2])  # fmt: skip
            rows.append(({f.replace("_", "-") for f in ours}, theirs))
    return rows


def test_every_train_megatron_flag_is_megatron_lms_or_named_ours_only():
    megatron_lm = snapshot(PRETRAIN)
    missing = our_flags() - megatron_lm - OURS_ONLY.keys()
    assert not missing, (
        f"train_megatron.py accepts {sorted(missing)}, which Megatron-LM's pretrain_gpt.py does "
        f"not ({PRETRAIN}): use Megatron-LM's name, or add it to OURS_ONLY with the reason"
    )
    assert OURS_ONLY.keys() <= our_flags(), "OURS_ONLY names a flag train_megatron.py lacks"
    assert not OURS_ONLY.keys() & megatron_lm, "OURS_ONLY names a flag Megatron-LM has"


@pytest.mark.parametrize(
    "program, parser", [("pretrain_gpt.py", PRETRAIN), ("tools/preprocess_data.py", PREPROCESS)]
)
def test_readme_megatron_lm_lines_use_only_their_parsers_flags(program, parser):
    used = flags_of(readme_command(program))
    assert used and used <= snapshot(parser), sorted(used - snapshot(parser))


def test_readme_table_maps_both_lines_flag_for_flag():
    rows = readme_table()
    ours = set().union(*(r[0] for r in rows))
    theirs = set().union(*(r[1] for r in rows))
    assert theirs <= snapshot(PRETRAIN), sorted(theirs - snapshot(PRETRAIN))
    assert ours <= our_flags(), sorted(ours - our_flags())
    assert flags_of(readme_command("day22_megatron.train_megatron")) <= ours
    assert flags_of(readme_command("pretrain_gpt.py")) <= theirs


@needs_extras("megatron")
def test_readme_train_megatron_line_is_the_8_gpu_layout(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(train_megatron.dtl_dist, "planned_backend", lambda: "nccl")  # 8 GPUs
    args = readme_command("day22_megatron.train_megatron") + [f"--out_dir={tmp_path}"]
    cfg = dtl_config.load(train_megatron.Config, args)
    lay = cfg.layout
    assert (lay.tp, lay.pp, lay.vpp, lay.dp, cfg.microbatches) == (2, 2, 2, 2, 8)
    assert cfg.model_config().vocab_size == 50_432  # the table's padding, as Megatron-LM's


def test_snapshots_are_of_the_megatron_core_release_installed():
    headers = {(DAY / name).read_text().splitlines()[0] for name in (PRETRAIN, PREPROCESS)}
    tags = {re.search(r"^# Megatron-LM core_v(\d+\.\d+\.\d+) \([0-9a-f]{40}\)", h) for h in headers}
    assert None not in tags, headers
    (release,) = {t.group(1) for t in tags}  # both read at one commit
    absent = extras.missing(["megatron"])
    if absent:
        pytest.skip(extras.skip_reason(absent))
    installed = importlib.metadata.version("megatron-core")
    assert installed.split(".")[:2] == release.split(".")[:2], (installed, release)


def _tool():
    path = DAY.parent / "tools" / "megatron_lm_flags.py"
    spec = importlib.util.spec_from_file_location("megatron_lm_flags", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOY_SOURCE = {  # ArgumentGroupFactory's naming rule, each case once
    "pkg/arguments.py": """
import argparse
from pkg.configs import Config
def parse_args():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    return _add_args(parser)
def _add_args(parser):
    parser.add_argument("--plain", "--alias", type=int)
    parser.add_argument("--toggle", action=argparse.BooleanOptionalAction)
    exclude = ["skipped"]
    ArgumentGroupFactory(Config, exclude=exclude).build_group(parser, "config")
    return parser
def _never_called(parser):
    parser.add_argument("--unreached")
""",
    "pkg/configs.py": """
from dataclasses import dataclass, field
from .base import Base
@dataclass
class Config(Base):
    on: bool = False
    off: bool = True
    maybe: Optional[bool] = None
    size: int = 0
    derived: int = field(init=False, default=0)
    eps: float = field(default=1e-5, metadata={"argparse_meta": {"arg_names": ["--norm-eps"]}})
    skipped: int = 1
""",
    "pkg/base.py": "@dataclass\nclass Base:\n    base_size: int = 1\n",
}


def test_tool_reads_flags_and_applies_the_factorys_naming_rule():
    reader = _tool().ParserReader(TOY_SOURCE.get)
    assert reader.flags("pkg/arguments.py", "parse_args") == {
        "--help", "--plain", "--alias", "--toggle", "--no-toggle", "--base-size", "--on",
        "--no-off", "--disable-off", "--no-maybe", "--disable-maybe", "--size", "--norm-eps",
    }  # fmt: skip
