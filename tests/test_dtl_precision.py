"""The kit's precision table (dtl/precision.py): the bytes it states are the bytes tensors and
AdamW hold, its peaks resolve device names most specific first, and every config's `precision`
field offers every row, so that adding a precision is one row in the table."""

from __future__ import annotations

import importlib
import typing

import pytest
import torch

from dtl import config as dtl_config
from dtl import metrics
from dtl.precision import PRECISIONS, precision
from dtl.state import optimizer_state_bytes

# every script whose Config chooses a precision; each must offer every row of the table
CONFIGS_WITH_A_PRECISION = [
    "day18_zero.train",
    "day18_zero.bench",
    "day22_megatron.train_megatron",
    "day23_zero3_offload.train",
    "day27_profiling.bench",
    "day28_gpt125m.ablation",
    "day28_gpt125m.train",
]


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_param_and_grad_bytes_are_the_dtype_a_tensor_holds(name):
    p = PRECISIONS[name]
    w = torch.nn.Parameter(torch.zeros(10, dtype=p.storage))
    (w.float().sum() * 2).backward()
    assert w.element_size() == p.param and w.grad.element_size() == p.grad


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_optimizer_bytes_are_adam_with_an_fp32_master_where_the_params_are_not_fp32(name):
    p = PRECISIONS[name]
    w = torch.nn.Parameter(torch.randn(64, dtype=p.storage))
    # what a mixed-precision optimizer steps: an fp32 copy (the master) where w is not fp32
    master = w if p.storage == torch.float32 else torch.nn.Parameter(w.detach().float())
    master.grad = torch.ones_like(master)
    opt = torch.optim.AdamW([master])
    opt.step()
    counted = optimizer_state_bytes(opt, counters=False)  # m and v
    held = counted + (0 if master is w else master.numel() * master.element_size())
    assert held == p.optim * w.numel()


def test_fp32_master_is_deepspeeds_fp32_case_and_a_no_op_for_mixed_precision():
    fp32 = PRECISIONS["fp32"].with_fp32_master()
    assert (fp32.name, fp32.param, fp32.grad, fp32.optim, fp32.total) == (
        "fp32+master",
        4,
        4,
        12,
        20,
    )
    assert PRECISIONS["bf16"].with_fp32_master() is PRECISIONS["bf16"]
    # the ZeRO paper's K = 12: 16 bytes per parameter in mixed precision
    assert PRECISIONS["bf16"].total == PRECISIONS["fp16"].total == 16


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_autocast_computes_matmuls_in_the_row_dtype(name):
    p = PRECISIONS[name]
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with p.autocast("cpu"):
        assert (a @ b).dtype == p.autocast_dtype == p.matmul_dtype
    with PRECISIONS["fp32"].autocast("cpu"):
        assert (a @ b).dtype == torch.float32


@pytest.mark.parametrize(
    "device, bf16, fp32",
    [
        ("NVIDIA H100 80GB HBM3", 989e12, 67e12),
        ("NVIDIA H100 PCIe", 756e12, 51e12),
        ("NVIDIA H100 NVL", 835e12, None),  # never falls through to "H100"'s fp32 figure
        ("NVIDIA H200", 989e12, 67e12),
        ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12),
        ("NVIDIA GeForce RTX 4090", None, None),
    ],
)
def test_peaks_per_precision_match_the_most_specific_name(device, bf16, fp32):
    assert PRECISIONS["bf16"].peak_flops(device) == bf16
    assert PRECISIONS["fp16"].peak_flops(device) == bf16  # the same tensor cores
    assert PRECISIONS["fp32"].peak_flops(device) == fp32


def test_metrics_peak_asks_the_table_for_the_runs_precision(monkeypatch):
    monkeypatch.delenv("DTL_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(metrics.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(metrics.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    assert metrics.peak_flops("cuda:0") == 989e12  # bf16 unless told
    assert metrics.peak_flops("cuda:0", "fp32") == 67e12


def test_an_unknown_precision_is_one_line():
    with pytest.raises(
        ValueError, match="unknown precision 'fp7'; choose one of fp32, bf16, fp16, fp8"
    ):
        precision("fp7")


@pytest.mark.parametrize("module", CONFIGS_WITH_A_PRECISION)
def test_every_config_offers_every_row_of_the_table(module):
    cfg = importlib.import_module(module).Config
    hints = typing.get_type_hints(cfg, include_extras=True)
    assert "precision" in hints and not {"bf16", "dtype"} & set(hints), module
    _, values = dtl_config.choices(hints["precision"])
    assert set(PRECISIONS) <= set(values), (module, values)
