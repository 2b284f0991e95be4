"""The kit's FP8 matmuls (dtl/float8.py) against torchao's: torchao 0.18.0's Float8Linear with
`Float8LinearConfig(emulate=True)` (dynamic tensorwise scaling, its default recipe; x and W in
e4m3, dy in e5m2 for both dx and dW), which runs on a CPU by dequantizing and calling torch.mm.

On the same weights and inputs, compared: the float8 bytes of each cast, and a Linear(64, 64)'s
output, input gradient and weight gradient (fp32 and bf16), and a tiny GPT's logits and every
parameter gradient (torchao converting all linears but `lm_head`, as the kit does).

They are not bit-equal, for two rounding choices only (torchao/float8/float8_utils.py and
float8_ops.py):
  * the scale: torchao divides max(dtype) / amax in fp64 and rounds once to fp32; the kit's
    `top / amax` is Tensor.__rtruediv__, amax.reciprocal() * top, rounded twice, so about one
    tensor in four gets a scale one fp32 ulp away. That flips a float8 byte only when x * scale
    sits on a rounding tie: none in 2,000 random fp32 tensors, but 3-5% of bf16 ones (their 8
    significant bits make exact ties common), and then that matmul differs by ~30-60 dB;
  * the dequantization: torchao's emulated mm divides each float8 value by the scale; the kit's
    torch._scaled_mm (on a CPU: (a8 * scale_a) @ (b8 * scale_b) in fp32) multiplies by the
    fp32-rounded inverse: each operand one fp32 ulp apart, so every product differs in its last
    bits (SQNR 127-146 dB between the two, while each is 18-35 dB from fp32).
With those two substituted the kit's layers and GPT equal torchao's bit for bit, which pins down
everything else: which tensors are cast, to which float8 dtype, with what amax, saturation and
output dtype. Without them, the seeds below cast to identical bytes, and the results agree to
fp32 rounding (bf16: within one bf16 ulp).

Skips where torchao is not importable; it needs no other package (its wheel lists dev extras
only) and runs on this torch 2.13 CPU build, logging that its CUDA kernels (_C_mxfp8,
_C_cutlass_90a) fail to load, which emulate mode does not use.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

ao_float8 = pytest.importorskip(
    "torchao.float8", reason="torchao is not installed: pip install torchao==0.18.0 --no-deps"
)
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402

from dtl import float8  # noqa: E402
from dtl.float8 import E4M3, E5M2, Float8Linear, convert_to_float8, sqnr_db, to_float8  # noqa: E402
from dtl.model import GPT, loss_fn, preset  # noqa: E402

EMULATE = ao_float8.Float8LinearConfig(emulate=True)
# the two agree to fp32 rounding: one fp32 ulp is 2^-24 relative (~144 dB); measured 127-146 dB
# on the seeds below. A float8 byte flipped by a one-ulp scale costs ~57 dB; a wrong float8 dtype
# or a missing scale, 20-35 dB.
ROUNDING_SQNR_DB = 120.0
ROUNDING_REL = 2.0**-20  # max |ours - torchao| over max |torchao|; measured <= 5.9e-7 (~2^-20.7)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _torchao(model: nn.Module) -> nn.Module:
    """torchao's emulated float8 on every linear but the output head, as convert_to_float8."""
    return ao_float8.convert_to_float8_training(
        model, config=EMULATE, module_filter_fn=lambda mod, fqn: fqn != "lm_head"
    )


def _linear_case(dtype: torch.dtype) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """A Linear(64, 64) without bias, x (32, 64) and dy (32, 64), all in `dtype`."""
    linear = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_((torch.rand(64, 64, generator=_gen(0)) * 2 - 1) / 8)  # its init
    x = torch.randn(32, 64, generator=_gen(1))
    dy = torch.randn(32, 64, generator=_gen(2))
    return linear.to(dtype), x.to(dtype), dy.to(dtype)


def _linear_step(make, linear: nn.Linear, x: torch.Tensor, dy: torch.Tensor):
    """(y, dx, dW) of `make` applied to a copy of `linear`."""
    layer = make(copy.deepcopy(linear))
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad


def _ours(linear: nn.Linear) -> nn.Module:
    return Float8Linear.from_linear(linear)


def _theirs(linear: nn.Linear) -> nn.Module:
    return _torchao(nn.Sequential(linear))[0]


def _gpt_step(gpt: nn.Module) -> dict[str, torch.Tensor]:
    """The logits and every parameter's gradient after one loss.backward()."""
    x = torch.randint(0, preset("tiny").vocab_size, (4, 33), generator=_gen(5))
    logits = gpt(x[:, :-1])
    loss_fn(logits, x[:, 1:]).backward()
    return {"logits": logits.detach(), **{n: p.grad for n, p in gpt.named_parameters()}}


def _assert_rounding_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert sqnr_db(theirs, ours) >= ROUNDING_SQNR_DB, (what, sqnr_db(theirs, ours))
    gap = (ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()
    assert gap.item() <= ROUNDING_REL, (what, gap.item())


def _torchaos_roundings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Swap in torchao's two roundings: the scale max/amax divided in fp64 and rounded once, the
    dequantization a division by the scale followed by an fp32 torch.mm."""

    def to_float8_torchao(t: torch.Tensor, dtype: torch.dtype, group=None):  # one process
        top = torch.finfo(dtype).max
        scale = (top / t.detach().abs().max().double().clamp(min=float8.AMAX_FLOOR)).float()
        return (t.detach().float() * scale).clamp(-top, top).to(dtype), scale  # the scale itself

    def scaled_matmul_torchao(a8, a_scale, b8, b_scale, out_dtype):
        return torch.mm(a8.float() / a_scale, b8.float() / b_scale).to(out_dtype)

    monkeypatch.setattr(float8, "to_float8", to_float8_torchao)
    monkeypatch.setattr(float8, "scaled_matmul", scaled_matmul_torchao)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_casts_give_torchaos_float8_bytes(dtype):
    """Same bytes for x, W (e4m3) and dy (e5m2) of the linear case; the scales differ by at most
    the rounding of the division (max/amax: torchao's fp64 quotient vs the kit's amax^-1 * max)."""
    linear, x, dy = _linear_case(dtype)
    for t, f8 in ((x, E4M3), (linear.weight.detach(), E4M3), (dy, E5M2)):
        t8, inverse = to_float8(t, f8)
        ao = hp_tensor_to_float8_dynamic(t, f8, LinearMMConfig())
        assert ao._data.dtype == t8.dtype == f8
        assert torch.equal(t8.view(torch.uint8), ao._data.view(torch.uint8)), f8
        torch.testing.assert_close(inverse.double(), 1 / ao._scale.double(), rtol=2**-22, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_torchaos_roundings_the_linear_is_torchaos_bit_for_bit(monkeypatch, dtype):
    _torchaos_roundings(monkeypatch)
    case = _linear_case(dtype)
    for name, ours, theirs in zip(
        ("y", "dx", "dW"), _linear_step(_ours, *case), _linear_step(_theirs, *case)
    ):
        assert ours.dtype == theirs.dtype == dtype, name
        assert torch.equal(ours, theirs), name


def test_with_torchaos_roundings_the_gpt_is_torchaos_bit_for_bit(monkeypatch):
    _torchaos_roundings(monkeypatch)
    ours = _gpt_step(convert_to_float8(GPT(preset("tiny"), seed=0)))
    theirs = _gpt_step(_torchao(GPT(preset("tiny"), seed=0)))
    unequal = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not unequal, unequal


def test_the_fp32_linear_matches_torchao_to_fp32_rounding():
    case = _linear_case(torch.float32)
    reference = _linear_step(lambda m: m, *case)
    ours, theirs = _linear_step(_ours, *case), _linear_step(_theirs, *case)
    for name, r, o, t in zip(("y", "dx", "dW"), reference, ours, theirs):
        _assert_rounding_close(o, t, name)
        assert abs(sqnr_db(r, o) - sqnr_db(r, t)) < 0.01, name  # equally far from fp32 (24-29 dB)


def test_the_bf16_linear_matches_torchao_within_one_bf16_ulp():
    """Both products are fp32 rounded to bf16; where the two fp32 values (a few fp32 ulps apart)
    straddle a bf16 rounding boundary the outputs differ by one bf16 ulp (y and dx bit-equal
    here, 1 of dW's 4096 one ulp apart)."""
    case = _linear_case(torch.bfloat16)
    for name, o, t in zip(
        ("y", "dx", "dW"), _linear_step(_ours, *case), _linear_step(_theirs, *case)
    ):
        assert o.dtype == t.dtype == torch.bfloat16
        ulps = (o.view(torch.int16).int() - t.view(torch.int16).int()).abs()
        assert ulps.max().item() <= 1, name
        assert (ulps == 0).float().mean().item() >= 0.99, name


def test_the_gpt_matches_torchao_to_fp32_rounding():
    ours_gpt = convert_to_float8(GPT(preset("tiny"), seed=0))
    theirs_gpt = _torchao(GPT(preset("tiny"), seed=0))
    converted = {
        name: type(m).__name__ for name, m in theirs_gpt.named_modules() if isinstance(m, nn.Linear)
    }
    assert converted == {
        name: type(m).__name__ for name, m in ours_gpt.named_modules() if isinstance(m, nn.Linear)
    }  # same linears converted, lm_head left alone, both classes called Float8Linear
    ours, theirs = _gpt_step(ours_gpt), _gpt_step(theirs_gpt)
    for name in ours:
        _assert_rounding_close(ours[name], theirs[name], name)
