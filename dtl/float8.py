"""FP8 training's matmuls, written out: each linear's inputs and weight cast to float8 with a
per-tensor dynamic scale, multiplied by torch._scaled_mm, the gradients cast to float8 too.

    y = x @ W^T                        forward, both operands in e4m3 (3 mantissa bits, max 448)
    dx = dy @ W,  dW = dy^T @ x        backward, dy in e5m2 (2 mantissa bits, max 57,344)

A per-tensor dynamic scale (torchao's and torchtitan's default "tensorwise" recipe): before each
cast, amax = max |t|; the tensor is multiplied by scale = max(dtype) / amax, so its largest
element lands on the format's largest value, cast, and the matmul undoes both scales in its
fp32 accumulator (`scale_a`, `scale_b` are the inverses). The weights stay in their own dtype
(fp32 or bf16) for the optimizer; only the matmul sees float8, and the backward keeps the float8
casts of x and W (1 byte per element) for dW and dx.

    model = convert_to_float8(GPT(cfg))          # every nn.Linear but the output head
    loss_fn(model(x), y).backward()              # the same training loop

On a CPU, torch._scaled_mm computes in fp32 from the float8 values: the numbers are FP8
training's, the speed is not (an H100's datasheet gives FP8 twice its BF16 rate, not run on a
GPU here; a CPU runs no faster, nor is it measured here).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtl.amax_groups import WHOLE, AmaxGroups
from dtl.exercise_seam import exercise

E4M3 = torch.float8_e4m3fn  # forward operands: more mantissa
E5M2 = torch.float8_e5m2  # gradients: more range
AMAX_FLOOR = 1e-12  # an all-zero tensor keeps a finite scale


def to_float8(
    t: torch.Tensor, dtype: torch.dtype, group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` cast to the float8 `dtype` with a per-tensor dynamic scale; returns (the float8
    tensor, the inverse scale, an fp32 scalar): t ≈ t8.float() * inverse. With `group`, t is
    this rank's piece of a tensor split over it, and the scale is the whole tensor's."""
    top = torch.finfo(dtype).max
    amax = t.detach().abs().max().float()
    if group is not None:  # () -> (): the largest |value| over every piece, one MAX all-reduce
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = top / amax.clamp(min=AMAX_FLOOR)
    t8 = (t.detach().float() * scale).clamp(-top, top).to(dtype)
    return t8, scale.reciprocal()


def dequantize(t8: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """What a float8 tensor stands for, in fp32: its values times the inverse scale."""
    return t8.float() * inverse


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column by column, as _scaled_mm's second operand must be."""
    return t.t().contiguous().t()


def scaled_matmul(
    a8: torch.Tensor,
    a_inv: torch.Tensor,
    b8: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(a8 * a_inv) @ (b8 * b_inv), accumulated in fp32 and written in `out_dtype`."""
    return torch._scaled_mm(
        a8.contiguous(), _column_major(b8), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype
    )


class _Float8Matmul(torch.autograd.Function):
    """x @ w^T with both operands in e4m3, and dx, dw from dy in e5m2."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, groups: AmaxGroups) -> torch.Tensor:
        x8, x_inv = to_float8(x, E4M3, groups.input)  # (rows, in)
        w8, w_inv = to_float8(w, E4M3, groups.weight)  # (out, in)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)  # 1 byte per element kept for backward
        ctx.dtypes, ctx.groups = (x.dtype, w.dtype), groups
        return scaled_matmul(x8, x_inv, w8.t(), w_inv, x.dtype)  # (rows, out)

    @staticmethod
    @exercise("day28.float8_backward")
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """dx = dy @ W and dW = dy^T @ x, from dy cast to e5m2 and the e4m3 copies the forward
        kept, each product in the dtype its parameter or input had."""
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        # exercise day28.float8_backward: begin
        dy8, dy_inv = to_float8(dy, E5M2, ctx.groups.grad)  # (rows, out)
        dx = scaled_matmul(dy8, dy_inv, w8, w_inv, x_dtype)  # (rows, out) @ (out, in)
        dw = scaled_matmul(dy8.t(), dy_inv, x8, x_inv, w_dtype)  # (out, rows) @ (rows, in)
        # exercise day28.float8_backward: end
        return dx, dw, None


def float8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    groups: AmaxGroups = WHOLE,
) -> torch.Tensor:
    """F.linear with its matmul in float8 (forward e4m3, gradients e5m2); the bias added after
    the matmul, in its own dtype; `groups`: where its operands are split (their scales are the
    whole tensors'). What a layer whose matmul is a slot (`linear`, as day 19's tensor-parallel
    layers have) runs once converted."""
    rows = x.reshape(-1, weight.shape[1])  # (..., in) -> (rows, in)
    # autograd.Function.apply is untyped in torch: its result is the forward's tensor
    y: torch.Tensor = _Float8Matmul.apply(rows, weight, groups)  # type: ignore[no-untyped-call]
    y = y.reshape(*x.shape[:-1], weight.shape[0])  # (rows, out) -> (..., out)
    return y if bias is None else y + bias


class Float8Linear(nn.Linear):
    """nn.Linear whose matmul runs in float8 (forward e4m3, gradients e5m2); the weight and the
    bias stay in their own dtype, the bias added after the matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        """The same parameters (shared, not copied) under a float8 matmul."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        return new


def keep_high_precision(name: str) -> bool:
    """The linears FP8 recipes leave alone: the output head (its logits feed the loss's softmax
    over the whole vocabulary; torchtitan's float8 skips it too)."""
    return name == "lm_head"


def convert_to_float8(
    model: nn.Module, skip: Callable[[str], bool] = keep_high_precision
) -> nn.Module:
    """Every linear of `model` whose name `skip` does not keep runs its matmul in float8, in
    place, on the same parameters: an nn.Linear becomes a Float8Linear; a layer whose matmul is
    a slot, `linear` = F.linear (day 19's column- and row-parallel layers), gets float8_linear
    in it, with the operand groups the layer declares (`amax_groups`; WHOLE if none). Returns
    `model`."""
    for name, module in list(model.named_modules()):
        if skip(name):
            continue
        if getattr(module, "linear", None) is F.linear:  # a matmul slot: the layer's choice
            groups = getattr(module, "amax_groups", WHOLE)
            module.linear = functools.partial(float8_linear, groups=groups)
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and not skip(full):
                setattr(module, child_name, Float8Linear.from_linear(child))
    return model


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, dB: 20 log10(|ref| / |ref - approx|), torchao's
    measure of a float8 result against its high-precision twin."""
    reference, approx = reference.detach().float(), approx.detach().float()
    noise = (reference - approx).norm()
    return float(20 * torch.log10(reference.norm() / noise.clamp(min=1e-30)))


class LayerBars:
    """Every Float8Linear of `model`, at every backward, against its own matmul in fp32 on the
    same inputs: the worst output, input-gradient and weight-gradient SQNR (dB) seen so far,
    torchao's per-layer measure. Call `check_weight_grads()` after each backward."""

    def __init__(self, model: nn.Module):
        self.worst = {"y": math.inf, "dx": math.inf, "dW": math.inf}
        self.step_worst = dict(self.worst)  # since the last check_weight_grads
        self._inputs: dict[str, torch.Tensor] = {}
        self._exact_dw: dict[str, torch.Tensor] = {}
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        for name, layer in self.layers.items():
            layer.register_forward_hook(self._forward(name))
            layer.register_full_backward_hook(self._backward(name))

    def _forward(self, name: str) -> Callable[..., None]:
        def hook(layer: Float8Linear, args: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
            x = args[0].detach().float()
            self._inputs[name] = x
            exact = x @ layer.weight.detach().float().t()
            if layer.bias is not None:  # added after the matmul, in high precision
                exact = exact + layer.bias.detach().float()
            self._bar("y", exact, y)

        return hook

    def _backward(self, name: str) -> Callable[..., None]:
        def hook(layer: Float8Linear, grad_in: tuple[Any, ...], grad_out: tuple[Any, ...]) -> None:
            dy = grad_out[0].float().flatten(0, -2)  # (rows, out)
            x = self._inputs.pop(name).flatten(0, -2)  # (rows, in)
            self._bar("dx", dy @ layer.weight.detach().float(), grad_in[0].flatten(0, -2))
            self._exact_dw[name] = dy.t() @ x  # compared once backward has written .grad

        return hook

    def _bar(self, what: str, exact: torch.Tensor, got: torch.Tensor) -> None:
        db = sqnr_db(exact, got)
        self.worst[what] = min(self.worst[what], db)
        self.step_worst[what] = min(self.step_worst[what], db)

    def check_weight_grads(self) -> dict[str, float]:
        """Compare each layer's .grad with its exact dW (one backward since the last call);
        returns this step's worst per kind and starts the next step's."""
        for name, exact in self._exact_dw.items():
            grad = self.layers[name].weight.grad
            assert grad is not None, f"{name}: no gradient after backward"
            self._bar("dW", exact, grad)
        self._exact_dw = {}
        step, self.step_worst = self.step_worst, {k: math.inf for k in self.worst}
        return step
