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

from dtl import config as dtl_config
from dtl import precision as dtl_precision
from dtl.deepspeed import SECTIONS, DsConfigError, apply_precision
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
    """What the planted FP8-shaped row shows: its storage, autocast and activations are bf16's,
    and only the conversion tells it apart, so nothing that reads one field mistakes it."""
    bf16 = PRECISIONS["bf16"]
    assert (PLANTED.storage, PLANTED.autocast_dtype, PLANTED.activation) == (
        bf16.storage,
        bf16.autocast_dtype,
        bf16.activation,
    )
    assert PLANTED.conversion and not bf16.conversion
    assert PRECISIONS["fp32"].autocast_dtype is None
    assert PRECISIONS["fp32"].matmul_dtype == torch.float32


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
