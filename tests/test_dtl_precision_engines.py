"""The engines' precision declarations (dtl.precision.declare): every engine says which rows it
trains in and on which devices, every config asks that declaration, a row no engine declares is
refused by every engine in one line, DeepSpeed's section is chosen by the row's storage dtype,
and day 27's peak table is the kit's."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from types import MappingProxyType

import pytest
import torch
import torch.nn as nn

from dtl import config as dtl_config
from dtl import precision as dtl_precision
from dtl.conversion import apply_conversion
from dtl.deepspeed import SECTIONS, DsConfigError, apply_precision
from dtl.float8 import Float8Linear
from dtl.model import GPT, preset
from dtl.precision import (
    FP8_TENSOR_CORE_FLOPS,
    FP32_FLOPS,
    PRECISIONS,
    SUPPORTS,
    TENSOR_CORE_16BIT_FLOPS,
    PrecisionError,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = ("cpu", "cuda")

# every script whose Config chooses a precision, and the engine module each trains through
CONFIGS = [
    "day18_zero.train",
    "day18_zero.bench",
    "day18_zero.scale",
    "day22_megatron.train_megatron",
    "day23_zero3_offload.train",
    "day27_profiling.bench",
    "day28_gpt125m.ablation",
    "day28_gpt125m.train",
]
# a row the way FP8 training would be one: bf16 storage and autocast, float8 matmuls
PLANTED = dataclasses.replace(PRECISIONS["bf16"], name="planted", conversion="float8 matmuls")


def _declaring_modules() -> list[str]:
    """Every module of the kit and the days that declares an engine's precisions."""
    found = []
    for folder in sorted(os.listdir(ROOT)):
        if folder != "dtl" and not folder.startswith("day"):
            continue
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            path = os.path.join(ROOT, folder, name)
            if name.endswith(".py") and re.search(r"= declare\(", open(path).read()):
                found.append(f"{folder}.{name[:-3]}")
    return found


@pytest.fixture(scope="module")
def supports():
    """SUPPORTS once every declaring module and every config is imported."""
    for module in _declaring_modules() + CONFIGS:
        importlib.import_module(module)
    return dict(SUPPORTS)


@pytest.fixture
def planted(monkeypatch):
    """The table with the planted row in it, as a contributor would add it."""
    table = MappingProxyType({**PRECISIONS, "planted": PLANTED})
    monkeypatch.setattr(dtl_precision, "PRECISIONS", table)
    return table


def test_every_declaring_module_is_counted(supports):
    declared = sum(
        len(re.findall(r"= declare\(", open(os.path.join(ROOT, *m.split(".")) + ".py").read()))
        for m in _declaring_modules()
    )
    assert len(supports) == declared >= 8, sorted(supports)


def test_every_row_of_the_table_is_declared_by_an_engine(supports):
    assert dtl_precision.undeclared() == [], "a precision no engine trains in"


def test_a_row_no_engine_declares_is_caught_by_the_declaration_check(supports, planted):
    assert dtl_precision.undeclared() == ["planted"]


def test_a_planted_row_is_refused_by_every_engine_in_one_line(supports, planted):
    for engine, support in supports.items():
        for device in DEVICES:
            with pytest.raises(PrecisionError, match=r"does not train in planted") as info:
                support.require("planted", device)
            assert "\n" not in str(info.value), engine


@pytest.mark.parametrize("module", CONFIGS)
def test_a_planted_row_is_refused_by_every_config_before_anything_runs(
    module, supports, planted, monkeypatch
):
    """Each config's validate() asks its engine's declaration: the planted row, set past the
    parser (which lists the table's rows as they were at import), stops there in one line."""
    monkeypatch.setenv("DTL_BACKEND", "gloo")
    cfg = importlib.import_module(module).Config(precision="planted")
    with pytest.raises(dtl_config.ConfigError, match="planted") as info:
        cfg.validate()
    assert "\n" not in str(info.value)


def test_a_declaration_names_only_rows_of_the_table():
    with pytest.raises(ValueError, match="unknown precision 'fp7'"):
        dtl_precision.declare("probe", {"fp7": dtl_precision.ANY_DEVICE}, why="none")
    assert "probe" not in SUPPORTS


def test_a_device_an_engine_does_not_declare_is_refused_with_what_it_runs_there(supports):
    with pytest.raises(PrecisionError, match="DeepSpeed trains fp16 on cuda only, and this run's"):
        supports["DeepSpeed"].require("fp16", "cpu")
    assert supports["DeepSpeed"].require("fp16", "cuda") is PRECISIONS["fp16"]


# --- DeepSpeed: the section is chosen by the row's storage dtype --------------------------------


@pytest.mark.parametrize(
    "name, device, enabled",
    [("fp32", "cpu", None), ("bf16", "cpu", "bf16"), ("fp16", "cuda", "fp16")],
)
def test_deepspeed_enables_the_section_of_the_row_asked_and_no_other(name, device, enabled):
    for written in ({}, {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}):
        ds = {k: dict(v) for k, v in written.items()}
        row = apply_precision(ds, name, device)
        on = [s for s in SECTIONS.values() if ds.get(s, {}).get("enabled") is True]
        assert on == ([enabled] if enabled else []), (name, written, ds)
        assert SECTIONS.get(row.storage) == enabled


def test_deepspeed_refuses_a_section_that_contradicts_the_row_and_a_row_it_lacks(planted):
    with pytest.raises(DsConfigError, match=r"'bf16.enabled' is True but the run has False"):
        apply_precision({"bf16": {"enabled": True}}, "fp32", "cpu")
    ds: dict = {}
    with pytest.raises(DsConfigError, match="DeepSpeed does not train in planted"):
        apply_precision(ds, "planted", "cpu")  # bf16 storage: it would have trained bf16
    assert ds == {}, "nothing enabled before the refusal"


# --- the rows' separate fields ------------------------------------------------------------------


def test_fields_that_differ_in_fp8_are_separate():
    """FP8's storage, autocast, activations and bytes are bf16's; only the conversion and the
    peaks tell it apart, so nothing that reads one field mistakes it for another row."""
    bf16, fp8 = PRECISIONS["bf16"], PRECISIONS["fp8"]
    same = ("storage", "autocast_dtype", "activation", "param", "grad", "optim", "loss_scaling")
    assert all(getattr(fp8, f) == getattr(bf16, f) for f in same)
    assert (fp8.conversion, bf16.conversion) == ("float8", None)
    # the datasheet: twice the BF16 rate (1,979 against 989 TFLOP/s, each rounded)
    assert fp8.peak_flops("NVIDIA H100") == pytest.approx(
        2 * bf16.peak_flops("NVIDIA H100"), rel=1e-3
    )
    assert fp8.peak_flops("NVIDIA A100-SXM4-80GB") is None  # no FP8 tensor cores
    assert PRECISIONS["fp32"].autocast_dtype is None
    assert PRECISIONS["fp32"].matmul_dtype == torch.float32


# --- fp8: the engines that lack it refuse it, the one that has it converts the linears ----------


def test_fp8_is_refused_in_one_line_by_every_engine_that_does_not_declare_it(supports):
    lacking = [e for e, support in supports.items() if "fp8" not in support.devices]
    assert len(lacking) == len(supports) - 1, "day 28's autocast alone declares fp8"
    for engine in lacking:
        for device in DEVICES:
            with pytest.raises(PrecisionError, match=r"does not train in fp8") as info:
                supports[engine].require("fp8", device)
            assert "\n" not in str(info.value), engine
    autocast = supports["day 28's autocast (ddp, fsdp2, the ablation)"]
    assert autocast.require("fp8", "cuda") is PRECISIONS["fp8"]
    with pytest.raises(PrecisionError, match="trains fp8 on cuda only"):
        autocast.require("fp8", "cpu")


@pytest.mark.parametrize("module", CONFIGS)
def test_every_config_refuses_fp8_on_a_cpu_or_says_what_it_runs_instead(module, monkeypatch):
    """On this CPU no engine trains fp8: each config refuses it in one line before anything
    runs, except day 28's train, whose strategies run fp32 where they lack a precision (its
    main prints the note) and which must then say fp32, never train another row unasked."""
    monkeypatch.setenv("DTL_BACKEND", "gloo")
    cfg = importlib.import_module(module).Config(precision="fp8")
    if module == "day28_gpt125m.train":
        cfg.validate()
        assert cfg.runs_precision == "fp32"
        return
    with pytest.raises(dtl_config.ConfigError, match="fp8") as info:
        cfg.validate()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("device", DEVICES)
def test_deepspeed_never_enables_a_section_for_fp8(device):
    """fp8's storage is bf16: a lookup by storage alone would switch DeepSpeed's bf16 section on
    and train bf16 without a word. The declaration refuses it first, with nothing written."""
    for written in ({}, {"bf16": {"enabled": "auto"}}):
        ds = {k: dict(v) for k, v in written.items()}
        with pytest.raises(DsConfigError, match="DeepSpeed does not train in fp8"):
            apply_precision(ds, "fp8", device)
        assert ds == written, "nothing enabled before the refusal"


def test_the_fp8_row_converts_every_linear_but_the_head_and_the_others_none():
    tiny = preset("tiny")
    converted = apply_conversion(GPT(tiny, seed=0), PRECISIONS["fp8"])
    kinds = {type(m).__name__ for n, m in converted.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == {"Float8Linear", "Linear"}
    assert type(converted.lm_head) is nn.Linear
    for name in ("fp32", "bf16", "fp16"):
        plain = apply_conversion(GPT(tiny, seed=0), PRECISIONS[name])
        assert not any(isinstance(m, Float8Linear) for m in plain.modules()), name
    odd = dataclasses.replace(PRECISIONS["fp8"], name="odd", conversion="int4")
    with pytest.raises(ValueError, match="names the conversion 'int4'") as info:
        apply_conversion(GPT(tiny, seed=0), odd)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_activation_bytes_are_the_element_size_autocast_leaves(name):
    row = PRECISIONS[name]
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with row.autocast("cpu"):
        saved = a @ b  # what the backward keeps of a linear's output
    assert saved.element_size() == row.activation


# --- day 27's peak table is the kit's -----------------------------------------------------------


def _notes_peak_rows() -> dict[str, list[str]]:
    text = open(os.path.join(ROOT, "day27_profiling", "README.md")).read()
    head = "| GPU | dense BF16 / FP16 peak, TFLOP/s | FP8 | FP32 | MAMF, BF16 |"
    rows = text[text.index(head) :].split("\n\n")[0].splitlines()[2:]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    return {c[0]: c[1:4] for c in cells}


def _tflops(cell: str) -> float | None:
    return float(cell) * 1e12 if cell else None


def test_day27_peak_table_is_the_kits_for_every_precision():
    names = {"H100 SXM": ["H100"], "H100 NVL, H200 NVL": ["H100 NVL", "H200 NVL"]}
    rows = _notes_peak_rows()
    assert sum(len(names.get(gpu, [gpu])) for gpu in rows) == len(FP8_TENSOR_CORE_FLOPS)
    for gpu, (bf16, fp8, fp32) in rows.items():
        for key in names.get(gpu, [gpu]):
            assert TENSOR_CORE_16BIT_FLOPS[key] == _tflops(bf16), gpu
            assert FP8_TENSOR_CORE_FLOPS[key] == _tflops(fp8), gpu
            assert FP32_FLOPS[key] == _tflops(fp32), gpu
