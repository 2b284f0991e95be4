"""The precisions the course trains in, in one table, and the engines that train in each.

Every config that chooses a precision has one field, `precision: PrecisionName`, and reads the
rest here. A row says what each kind of tensor is held in, separately, because the kinds differ:

    name   storage    compute               activations   bytes per parameter (Adam)
                                            (per element)  param + grad + optimizer state
    fp32   float32    float32 (no autocast)  4             4 + 4 + 8  (m, v; no master)
    bf16   bfloat16   autocast to bfloat16   2             2 + 2 + 12 (fp32 master, m, v)
    fp16   float16    autocast to float16    2             2 + 2 + 12, and a loss scaler
    fp8    bfloat16   autocast to bfloat16,  2             2 + 2 + 12 (fp32 master, m, v)
                      the linears' matmuls
                      in float8 (e4m3 operands,
                      e5m2 gradients)

`storage` is the dtype an engine that casts the model holds parameters in (hand ZeRO, DeepSpeed,
megatron-core); `autocast` the dtype matmuls run in under torch.autocast; `conversion` names a
change of the model's linears the matmuls go through instead (FP8 training keeps bf16 weights and
scales only the matmul inputs to float8: its storage, autocast and activations are bf16's, its
conversion is not; dtl.conversion applies it by name). FP8's bytes per parameter are bf16's: the
float8 copies live only inside each matmul (and, one byte per element, as what its backward
keeps). The bytes are the ZeRO paper's (Rajbhandari et al. 2019, section 3: K = 12
for mixed-precision Adam). An optimizer that keeps a separate fp32 copy even in fp32 (DeepSpeed
does) holds `with_fp32_master()`'s 12. The peaks are the vendors' datasheet figures, dense (never
the 2:4 sparse one); a device the table does not name has no peak and gets no MFU.

An engine declares the precisions it trains in, and on which devices (`declare`); its config asks
that declaration (`Support.require`), never a row's other fields, so a row no engine declares is
refused by every engine in one line, and a row is offered by an engine only once it says so.
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


# Dense FP8 (e4m3 or e5m2) tensor-core peaks, twice the 16-bit ones on Hopper and Blackwell;
# the A100 has no FP8 units. None: not in the table.
FP8_TENSOR_CORE_FLOPS = {
    "H100 PCIe": 1513e12,  # NVIDIA H100 datasheet: 3,026 sparse
    "H100 NVL": 1671e12,  # 3,341 sparse
    "H100": 1979e12,  # H100 SXM5: 3,958 sparse
    "H200 NVL": 1671e12,
    "H200": 1979e12,
    "B200": 4500e12,  # NVIDIA DGX B200 datasheet, per GPU: 9 PFLOP/s sparse
    "A100": None,  # no FP8 tensor cores
}


@dataclass(frozen=True)
class Precision:
    """One row of the table: what parameters, matmuls and activations are held and run in, the
    bytes per parameter held for Adam, the peaks."""

    name: str
    storage: torch.dtype  # parameters (and their gradients) where an engine casts the model
    autocast_dtype: torch.dtype | None  # what torch.autocast runs matmuls in; None: no autocast
    conversion: str | None  # a named change of the model's linears (float8 matmuls); None: none
    activation: int  # bytes per element of the activations the backward keeps
    param: int  # bytes per parameter of the parameters the forward reads
    grad: int  # bytes per parameter of the gradients
    optim: int  # bytes per parameter of optimizer state: Adam m and v, plus an fp32 master copy
    loss_scaling: bool  # needs a loss scaler (fp16's small exponent underflows gradients)
    peaks: Mapping[str, float | None] = field(repr=False, compare=False)

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optim

    def with_fp32_master(self) -> Precision:
        """The same, held by an optimizer that keeps an fp32 copy of the parameters even when
        they are fp32 already (DeepSpeed's ZeRO partitions): 4 + 8 bytes of optimizer state."""
        if self.optim >= 12:
            return self
        return replace(self, name=f"{self.name}+master", optim=self.optim + 4)

    def peak_flops(self, device_name: str) -> float | None:
        """The dense peak of the first table name found in `device_name`; None if none is."""
        return next((v for k, v in self.peaks.items() if k in device_name), None)

    @property
    def matmul_dtype(self) -> torch.dtype:
        """The dtype the model's matmuls take their inputs in: autocast's, else the storage's."""
        return self.autocast_dtype or self.storage

    def autocast(self, device_type: str) -> AbstractContextManager[None]:
        """Autocast to this row's autocast dtype on `device_type`; a no-op where it has none."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)


PRECISIONS: Mapping[str, Precision] = MappingProxyType(
    {
        "fp32": Precision(
            "fp32",
            storage=torch.float32,
            autocast_dtype=None,
            conversion=None,
            activation=4,
            param=4,
            grad=4,
            optim=8,
            loss_scaling=False,
            peaks=MappingProxyType(FP32_FLOPS),
        ),
        "bf16": Precision(
            "bf16",
            storage=torch.bfloat16,
            autocast_dtype=torch.bfloat16,
            conversion=None,
            activation=2,
            param=2,
            grad=2,
            optim=12,
            loss_scaling=False,
            peaks=MappingProxyType(TENSOR_CORE_16BIT_FLOPS),
        ),
        "fp16": Precision(
            "fp16",
            storage=torch.float16,
            autocast_dtype=torch.float16,
            conversion=None,
            activation=2,
            param=2,
            grad=2,
            optim=12,
            loss_scaling=True,
            peaks=MappingProxyType(TENSOR_CORE_16BIT_FLOPS),
        ),
        "fp8": Precision(
            "fp8",
            storage=torch.bfloat16,
            autocast_dtype=torch.bfloat16,
            conversion="float8",
            activation=2,
            param=2,
            grad=2,
            optim=12,
            loss_scaling=False,  # per-tensor scales on every cast: no loss scaler
            peaks=MappingProxyType(FP8_TENSOR_CORE_FLOPS),
        ),
    }
)

# The config field's type: `precision: PrecisionName = "fp32"` offers every row above.
PrecisionName = Literal[tuple(PRECISIONS)]  # type: ignore[valid-type]  # built at run time

ANY_DEVICE = ("cpu", "cuda")
GPU_ONLY = ("cuda",)


class PrecisionError(ValueError):
    """A precision an engine does not train in (or not on this device); one line."""


@dataclass(frozen=True)
class Support:
    """The precisions one engine trains in, each with the device types it trains it on."""

    engine: str
    devices: Mapping[str, tuple[str, ...]]  # precision name -> device types ("cpu", "cuda")
    why: str  # what the engine lacks for the rows it leaves out, said when it refuses one

    def require(self, name: str, device_type: str) -> Precision:
        """The row `name`, if this engine trains in it on `device_type`; PrecisionError (one
        line) otherwise."""
        if name not in self.devices:
            offered = ", ".join(self.devices)
            raise PrecisionError(
                f"{self.engine} does not train in {name}; it trains in {offered} ({self.why})"
            )
        if not self.trains(name, device_type):
            where = " or ".join(self.devices[name])
            raise PrecisionError(
                f"{self.engine} trains {name} on {where} only, and this run's device is "
                f"{device_type}; use {self.fallback(device_type)}"
            )
        return precision(name)

    def trains(self, name: str, device_type: str) -> bool:
        """Whether this engine trains in the row `name` on `device_type`."""
        return device_type in self.devices.get(name, ())

    def fallback(self, device_type: str) -> str:
        """The precisions this engine trains in on `device_type`, for an error's advice."""
        return ", ".join(n for n in self.devices if self.trains(n, device_type))


# engine -> its declaration: filled by `declare` as each engine's module is imported
SUPPORTS: dict[str, Support] = {}


def declare(engine: str, devices: Mapping[str, tuple[str, ...]], why: str) -> Support:
    """Declare the precisions `engine` trains in (name -> device types); a name that is not a row
    of the table is refused here, when the engine's module is imported."""
    for name in devices:
        precision(name)
    support = Support(engine, MappingProxyType(dict(devices)), why)
    SUPPORTS[engine] = support
    return support


def undeclared() -> list[str]:
    """The rows of the table no imported engine declares: a precision nothing trains in."""
    declared = {name for support in SUPPORTS.values() for name in support.devices}
    return [name for name in PRECISIONS if name not in declared]


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
