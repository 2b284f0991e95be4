"""The ZeRO paper's accounting, in one place: model-state bytes per rank and bytes moved per step.

Rajbhandari et al. 2019 (arXiv 1910.02054), section 3 and figure 1. Per parameter, a rank holds
`param` bytes of parameters, `grad` bytes of gradient and `optim` bytes of optimizer state (for
Adam: m and v, plus an fp32 master copy when the parameters are not fp32 themselves). Stage s
divides the first s kinds (counting from the optimizer state) by N:

    stage 0   (param + grad + optim) Ψ
    stage 1   (param + grad) Ψ + optim Ψ / N
    stage 2   param Ψ + (grad + optim) Ψ / N
    stage 3   (param + grad + optim) Ψ / N

Activations, the temporary buffers of a collective and the allocator's fragmentation are not in
these formulas; a real run holds them on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtl.exercise_seam import exercise
from dtl.precision import PRECISIONS, Precision

STAGES_ALL = (0, 1, 2, 3)


@dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float
    optim: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optim


@exercise("day18.state_bytes")
def model_state_bytes(
    psi: float, n: int, stage: int, precision: Precision, padded: float | None = None
) -> StateBytes:
    """Bytes per rank of parameters, gradients and optimizer state under ZeRO stage `stage`.

    `padded`: the elements an implementation holds per copy, Ψ rounded up so that every flat
    buffer splits into N equal slices (hand ZeRO pads each bucket to a multiple of N, and keeps
    even its whole copies in those buckets): a sharded kind holds padded / N, a replicated one
    padded. None: the paper's Ψ and Ψ / N."""
    if stage not in STAGES_ALL:
        raise ValueError(f"unknown ZeRO stage {stage!r}; choose one of 0, 1, 2, 3")
    # per kind: a whole copy (Ψ elements, or `padded` when given) or this rank's slice of it,
    # times the kind's bytes per element (precision.param, .grad, .optim); which kinds stage
    # `stage` slices: the table at the top of this file
    # exercise day18.state_bytes: begin
    whole = psi if padded is None else padded  # elements in a whole copy
    shard = whole / n  # elements in this rank's slice
    return StateBytes(
        params=precision.param * (shard if stage >= 3 else whole),
        grads=precision.grad * (shard if stage >= 2 else whole),
        optim=precision.optim * (shard if stage >= 1 else whole),
    )
    # exercise day18.state_bytes: end


def comm_volume_factor(stage: int) -> int:
    """How many times Ψ (gradient-sized messages) each rank moves per step, times (N-1)/N.

    Stages 0-2: 2 (DDP's all-reduce = reduce-scatter + all-gather; ZeRO-1/2 do exactly those
    two halves, one for the gradients and one for the updated parameters). Stage 3: 3 (the
    parameters are all-gathered in forward *and* again in backward, plus the reduce-scatter).
    """
    return 3 if stage == 3 else 2


def comm_bytes_per_rank(numel: int, n: int, stage: int, elem_bytes: int) -> float:
    """Bytes each rank sends per optimizer step with bandwidth-optimal rings (no accumulation)."""
    return comm_volume_factor(stage) * numel * elem_bytes * (n - 1) / n


# The paper's figure 1: Ψ = 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12)
PAPER_PSI, PAPER_N = 7.5e9, 64
PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # as printed in the paper (rounded)


def paper_example() -> dict[int, float]:
    """GB per GPU for the paper's example, computed (10^9 bytes, as the paper counts)."""
    return {
        s: model_state_bytes(PAPER_PSI, PAPER_N, s, PRECISIONS["bf16"]).total / 1e9
        for s in STAGES_ALL
    }
