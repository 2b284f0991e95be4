"""Where a matmul's operands are split, for the scales a conversion gives them.

    AmaxGroups(input=None, weight=tp_group, grad=tp_group)   # a column-parallel layer

For a matmul's input, weight and output gradient: the process group over whose ranks the tensor
lies in pieces (day 19's tensor parallelism), or None where every rank holds it whole. A layer
declares its own; dtl.float8 reads it, since a per-tensor scale belongs to the whole tensor and
a split operand's amax is the maximum over its group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AmaxGroups:
    input: Any = None  # the process group the input is split over; None: whole on every rank
    weight: Any = None  # the same for the weight
    grad: Any = None  # the same for dL/d(output)


WHOLE = AmaxGroups()  # one process, or every operand replicated
