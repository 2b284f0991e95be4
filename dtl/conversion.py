"""The changes of a model's linears a precision row names (`Precision.conversion`), by name.

    model = apply_conversion(GPT(cfg), PRECISIONS["fp8"])   # every linear but the head in float8
    model = apply_conversion(GPT(cfg), PRECISIONS["bf16"])  # unchanged: the row names none

An engine that trains a row with a conversion calls this once, on the one-process model, before
it wraps or shards it; the row says which change, this table says how.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch.nn as nn

from dtl.float8 import convert_to_float8
from dtl.precision import Precision

CONVERSIONS: Mapping[str, Callable[[nn.Module], nn.Module]] = MappingProxyType(
    {"float8": convert_to_float8}
)


def apply_conversion(model: nn.Module, row: Precision) -> nn.Module:
    """`model` with `row`'s conversion applied in place (none for most rows); returns it."""
    if row.conversion is None:
        return model
    if row.conversion not in CONVERSIONS:
        raise ValueError(
            f"precision {row.name} names the conversion {row.conversion!r}, which dtl.conversion "
            f"does not know; it knows {', '.join(CONVERSIONS)}"
        )
    return CONVERSIONS[row.conversion](model)
