"""The kit's FP8 matmuls (dtl/float8.py) against the arithmetic they stand for and against high
precision: the hand cast-and-scale equals torch._scaled_mm on the same float8 inputs, the
backward's dx and dW are the float8 products they claim, and the fp8 row's conversion of `small`
keeps every float8 layer within torchao's bars of its fp32 matmul (output SQNR >= 18 dB, gradient
SQNR >= 17 dB; twenty steps beside bf16: day28_gpt125m.fp8, a launch line of the suite). A CPU
computes these numbers exactly as FP8 training does; it says nothing of speed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from day19_tp.tp import apply_tp, full_tensors, tp_loss
from dtl import float8
from dtl.amax_groups import WHOLE
from dtl.conversion import apply_conversion
from dtl.float8 import (
    E4M3,
    E5M2,
    Float8Linear,
    LayerBars,
    convert_to_float8,
    dequantize,
    sqnr_db,
    to_float8,
)
from dtl.grid import ParallelGrid
from dtl.model import GPT, loss_fn, preset
from dtl.precision import PRECISIONS
from dtl.testing import run_distributed

OUTPUT_SQNR_DB = 18.0  # torchao's bars for a float8 linear against its bf16 twin
GRAD_SQNR_DB = 17.0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_scale_puts_amax_on_the_formats_largest_value_and_rounds_within_its_mantissa(dtype):
    t = torch.randn(64, 48, generator=_gen(0)) * 1e-3  # far below 1: the scale lifts it
    t8, inverse = to_float8(t, dtype)
    assert t8.dtype == dtype
    assert t8.float().abs().max().item() == torch.finfo(dtype).max
    mantissa = {E4M3: 3, E5M2: 2}[dtype]
    normal = dequantize(t8, inverse).abs() > 0
    rel = ((dequantize(t8, inverse) - t) / t).abs()[normal]
    assert rel.max().item() <= 2.0 ** -(mantissa + 1) * 1.001  # round to nearest


def test_the_hand_cast_and_scale_equals_scaled_mm_on_the_same_inputs():
    x = torch.randn(32, 64, generator=_gen(1))
    w = torch.randn(48, 64, generator=_gen(2)) * 0.02
    (x8, xi), (w8, wi) = to_float8(x, E4M3), to_float8(w, E4M3)
    by_hand = dequantize(x8, xi) @ dequantize(w8, wi).t()
    got = float8.scaled_matmul(x8, xi, w8.t(), wi, torch.float32)
    torch.testing.assert_close(got, by_hand, rtol=1e-6, atol=1e-6)
    assert sqnr_db(x @ w.t(), got) > OUTPUT_SQNR_DB  # and close to the fp32 product


def test_scaled_mm_takes_a_scale_per_row_and_it_saves_the_rows_a_tensor_scale_flushes():
    """Row-wise scaling (torchao's "rowwise" recipe): one scale per row of x and per output
    column of W, shapes (M, 1) and (1, N), which this CPU's _scaled_mm accepts and applies exactly.
    With rows five decades apart, one tensor-wide scale leaves the smallest row a handful of
    float8 steps, many of them zero; a scale of its own gives it e4m3's full precision."""
    x = torch.randn(16, 32, generator=_gen(8)) * torch.logspace(-3, 2, 16).unsqueeze(1)
    w = torch.randn(24, 32, generator=_gen(9))
    top = torch.finfo(E4M3).max
    x_scale = top / x.abs().amax(1, keepdim=True)  # (M, 1)
    w_scale = top / w.abs().amax(1, keepdim=True)  # (N, 1): one per output column of x @ w^T
    x8 = (x * x_scale).clamp(-top, top).to(E4M3)
    w8 = (w * w_scale).clamp(-top, top).to(E4M3)
    rowwise = float8.scaled_matmul(
        x8, x_scale.reciprocal(), w8.t(), w_scale.reciprocal().t(), torch.float32
    )
    want = (x8.float() * x_scale.reciprocal()) @ (w8.float() * w_scale.reciprocal()).t()
    assert torch.equal(rowwise, want)  # each product times its row's and its column's inverse
    t8, t_inv = to_float8(x, E4M3)
    tensorwise = dequantize(t8, t_inv) @ dequantize(w8, w_scale.reciprocal()).t()
    exact = x @ w.t()
    # the smallest row: 29.3 dB with its own scale, 12.8 dB (41% of its values zero) without
    assert sqnr_db(exact[0], rowwise[0]) >= 25 > OUTPUT_SQNR_DB > sqnr_db(exact[0], tensorwise[0])


def test_float8_linear_backward_is_the_e5m2_gradient_times_the_e4m3_operands():
    linear = nn.Linear(64, 48, bias=True)
    fp8 = Float8Linear.from_linear(linear)
    assert fp8.weight is linear.weight and fp8.bias is linear.bias  # shared, not copied
    x = torch.randn(4, 8, 64, generator=_gen(3), requires_grad=True)
    dy = torch.randn(4, 8, 48, generator=_gen(4))
    fp8(x).backward(dy)
    (x8, xi), (w8, wi) = to_float8(x.reshape(-1, 64), E4M3), to_float8(linear.weight, E4M3)
    dy8, dyi = to_float8(dy.reshape(-1, 48), E5M2)
    want_dx = dequantize(dy8, dyi) @ dequantize(w8, wi)
    want_dw = dequantize(dy8, dyi).t() @ dequantize(x8, xi)
    torch.testing.assert_close(x.grad.reshape(-1, 64), want_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(linear.weight.grad, want_dw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(linear.bias.grad, dy.sum((0, 1)))  # the bias: in high precision


def test_conversion_swaps_every_linear_but_the_head_and_keeps_the_parameters():
    gpt = GPT(preset("tiny"), seed=0)
    before = dict(gpt.named_parameters())
    convert_to_float8(gpt)
    kinds = {n: type(m) for n, m in gpt.named_modules() if isinstance(m, nn.Linear)}
    assert kinds.pop("lm_head") is nn.Linear
    assert kinds and set(kinds.values()) == {Float8Linear}, kinds
    assert {n: p for n, p in gpt.named_parameters()} == before


def _one_step_bars(gpt: GPT, x: torch.Tensor) -> dict[str, float]:
    """One bf16-autocast step of a converted GPT, each float8 layer held against its fp32 matmul
    (LayerBars): the worst output, dx and dW SQNR of the step."""
    bars = LayerBars(gpt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(gpt(x[:, :-1]), x[:, 1:]).backward()
    return bars.check_weight_grads()


def test_layer_bars_hold_every_float8_layer_to_torchaos_bars_and_catch_a_missing_scale(
    monkeypatch,
):
    """The fp8 row's conversion of `small`, one step: every float8 layer within torchao's bars of
    its own matmul in fp32 (day28_gpt125m.fp8 runs twenty such steps beside bf16). Cast without
    their scales, the gradients fall far below the bar while the output still passes it."""
    x = torch.randint(0, preset("small").vocab_size, (4, 65), generator=_gen(11))
    worst = _one_step_bars(apply_conversion(GPT(preset("small"), seed=0), PRECISIONS["fp8"]), x)
    assert worst["y"] >= OUTPUT_SQNR_DB and min(worst["dx"], worst["dW"]) >= GRAD_SQNR_DB, worst

    def unscaled(t: torch.Tensor, dtype: torch.dtype, group=None) -> tuple[torch.Tensor, ...]:
        return t.detach().float().to(dtype), torch.ones(())

    monkeypatch.setattr(float8, "to_float8", unscaled)
    worst = _one_step_bars(apply_conversion(GPT(preset("small"), seed=0), PRECISIONS["fp8"]), x)
    assert min(worst["dx"], worst["dW"]) < GRAD_SQNR_DB, worst


def test_without_the_scale_small_gradients_fall_below_float8s_range(monkeypatch):
    """The scale is the point: cast as they are, a linear's gradients (~1e-5 here) are mostly
    below e5m2's smallest subnormal (1.5e-5) and the gradient SQNR collapses."""
    linear = nn.Linear(64, 64)
    x = torch.randn(32, 64, generator=_gen(6))
    dy = torch.randn(32, 64, generator=_gen(7)) * 1e-6
    linear(x).backward(dy)
    want = linear.weight.grad.clone()
    linear.weight.grad = None
    Float8Linear.from_linear(linear)(x).backward(dy)
    assert sqnr_db(want, linear.weight.grad) >= GRAD_SQNR_DB

    def unscaled(t: torch.Tensor, dtype: torch.dtype, group=None) -> tuple[torch.Tensor, ...]:
        return t.detach().float().to(dtype), torch.ones(())

    monkeypatch.setattr(float8, "to_float8", unscaled)
    linear.weight.grad = None
    Float8Linear.from_linear(linear)(x).backward(dy)
    assert sqnr_db(want, linear.weight.grad) < GRAD_SQNR_DB


# --- day 19's tensor-parallel layers, converted -------------------------------------------------


def _tp_float8_grads() -> dict:
    """tp = 2: the GPT cut by apply_tp, then converted; one step's full gradients with each
    split operand scaled as a whole (the layers' amax_groups), and again with each rank scaling
    its own pieces (the groups taken away); and the matmul each parallel layer runs."""
    grid = ParallelGrid(tp=2)
    x = torch.randint(0, preset("small").vocab_size, (4, 33), generator=_gen(12))
    out: dict = {}
    for scales in ("whole", "per piece"):
        model = apply_tp(GPT(preset("small"), seed=0), grid)
        if scales == "per piece":
            for m in model.modules():
                if hasattr(m, "amax_groups"):
                    m.amax_groups = WHOLE  # as if every piece were the whole tensor
        convert_to_float8(model)
        out["slots"] = {
            n: getattr(m.linear, "func", None) is float8.float8_linear
            for n, m in model.named_modules()
            if hasattr(m, "linear")
        }
        tp_loss(model, model(x[:, :-1]), x[:, 1:]).backward()
        out[scales] = full_tensors(model, grads=True)
    return out


def test_tensor_parallel_float8_scales_each_split_operand_as_a_whole_like_one_process():
    """Day 19's column- and row-parallel layers hold their matmul in a slot and declare which
    operands are split over the TP group; the conversion puts float8_linear there with those
    groups, and each split operand's amax is a MAX all-reduce over them. At tp = 2 the step's
    gradients then equal the one-process float8 step's to fp32 rounding; a rank scaling only its
    own piece casts other float8 values, a float8 step of its own."""
    rank0 = run_distributed(_tp_float8_grads, world_size=2)[0]
    assert rank0["slots"] and all(rank0["slots"].values()), rank0["slots"]
    x = torch.randint(0, preset("small").vocab_size, (4, 33), generator=_gen(12))
    one = convert_to_float8(GPT(preset("small"), seed=0))
    loss_fn(one(x[:, :-1]), x[:, 1:]).backward()
    converted = [n for n, _ in one.named_parameters() if n.rsplit(".", 1)[0] in rank0["slots"]]
    worst = {
        scales: min(sqnr_db(one.get_parameter(n).grad, rank0[scales][n]) for n in converted)
        for scales in ("whole", "per piece")
    }
    # measured: 125.9 dB scaled as a whole, 17.1 dB scaled per piece
    assert worst["whole"] >= 80 > 40 > worst["per piece"], worst
