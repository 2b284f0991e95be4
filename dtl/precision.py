"""The precisions the course trains in, in one table: what each stores and what each computes at.

Every config that chooses a precision has one field, `precision: PrecisionName`, and reads the
rest here:

    name   compute dtype   bytes per parameter (Adam)        dense peak FLOP/s
                           param + grad + optimizer state
    fp32   float32         4 + 4 + 8  (m, v; no master)      FP32 CUDA cores (no tensor cores)
    bf16   bfloat16        2 + 2 + 12 (fp32 master, m, v)    BF16 tensor cores
    fp16   float16         2 + 2 + 12 (fp32 master, m, v)    FP16 tensor cores (= BF16's), and a
                                                             loss scaler (5-bit exponent)

The bytes are the ZeRO paper's (Rajbhandari et al. 2019, section 3: K = 12 for mixed-precision
Adam). An optimizer that keeps a separate fp32 copy even in fp32 (DeepSpeed does) holds
`with_fp32_master()`'s 12. The peaks are the vendors' datasheet figures, dense (never the 2:4
sparse one); a device the table does not name has no peak and gets no MFU.

Adding a precision (FP8, say) is one row here; then every config that lists PrecisionName
offers it, and each day refuses it in one line where its engine cannot run it.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

import torch

# Dense tensor-core peaks per GPU, FLOP/s. Order matters: the first name found in
# torch.cuda.get_device_name() wins, so the specific names come before the general ones.
TENSOR_CORE_16BIT_FLOPS = {
    "H100 PCIe": 756e12,  # NVIDIA H100 datasheet
    "H100 NVL": 835e12,  # H100 NVL (per GPU)
    "H100": 989e12,  # H100 SXM5
    "H200 NVL": 835e12,  # H200 NVL (PCIe card, lower power): 1,671 sparse = 835 dense
    "H200": 989e12,  # same compute die as H100 SXM
    "B200": 2250e12,  # NVIDIA DGX B200 datasheet, per GPU
    "A100": 312e12,  # NVIDIA A100 datasheet
}
# Plain FP32 (CUDA cores; torch leaves TF32 matmuls off unless asked). None: not in the table.
FP32_FLOPS = {
    "H100 PCIe": 51e12,
    "H100 NVL": None,
    "H100": 67e12,  # H100 SXM5
    "H200 NVL": None,
    "H200": 67e12,
    "B200": None,
    "A100": 19.5e12,
}


@dataclass(frozen=True)
class Precision:
    """One row of the table: bytes per parameter held for Adam, the compute dtype, the peaks."""

    name: str
    dtype: torch.dtype  # what parameters (hand ZeRO, DeepSpeed, megatron) or autocast compute in
    param: int  # bytes per parameter of the parameters the forward reads
    grad: int  # bytes per parameter of the gradients
    optim: int  # bytes per parameter of optimizer state: Adam m and v, plus an fp32 master copy
    loss_scaling: bool  # needs a loss scaler (fp16's small exponent underflows gradients)
    peaks: Mapping[str, float | None] = field(repr=False, compare=False)

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optim

    @property
    def is_fp32(self) -> bool:
        return self.dtype == torch.float32

    def with_fp32_master(self) -> Precision:
        """The same, held by an optimizer that keeps an fp32 copy of the parameters even when
        they are fp32 already (DeepSpeed's ZeRO partitions): 4 + 8 bytes of optimizer state."""
        if self.optim >= 12:
            return self
        return replace(self, name=f"{self.name}+master", optim=self.optim + 4)

    def peak_flops(self, device_name: str) -> float | None:
        """The dense peak of the first table name found in `device_name`; None if none is."""
        return next((v for k, v in self.peaks.items() if k in device_name), None)

    def autocast(self, device_type: str) -> AbstractContextManager[None]:
        """Autocast to this precision on `device_type`; a no-op for fp32."""
        if self.is_fp32:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)


def _row(
    name: str,
    dtype: torch.dtype,
    param: int,
    grad: int,
    optim: int,
    loss_scaling: bool,
    peaks: Mapping[str, float | None],
) -> Precision:
    return Precision(name, dtype, param, grad, optim, loss_scaling, MappingProxyType(peaks))


PRECISIONS: Mapping[str, Precision] = MappingProxyType({
    "fp32": _row("fp32", torch.float32, 4, 4, 8, False, FP32_FLOPS),
    "bf16": _row("bf16", torch.bfloat16, 2, 2, 12, False, TENSOR_CORE_16BIT_FLOPS),
    "fp16": _row("fp16", torch.float16, 2, 2, 12, True, TENSOR_CORE_16BIT_FLOPS),
})  # fmt: skip

# The config field's type: `precision: PrecisionName = "fp32"` offers every row above.
PrecisionName = Literal[tuple(PRECISIONS)]  # type: ignore[valid-type]  # built at run time


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """The dtype to accumulate and update in: fp32 for 16-bit types, the type itself when it is
    wider (fp64 stays fp64: an upcast must never be a downcast, or an fp64 check loses 1e-7)."""
    return torch.promote_types(dtype, torch.float32)


def precision(name: str) -> Precision:
    """The row called `name`; a one-line error naming the choices otherwise."""
    try:
        return PRECISIONS[name]
    except KeyError:
        choices = ", ".join(PRECISIONS)
        raise ValueError(f"unknown precision {name!r}; choose one of {choices}") from None
