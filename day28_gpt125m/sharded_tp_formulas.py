"""Day 28: what fsdp2_tp costs one rank, by formula: the state it holds and the bytes each axis
of its (dp, tp) mesh sends in one optimizer step of m micro-batches of b sequences of s tokens.

    P'      this rank's TP shard of the model (day 22's params_per_rank at tp, pp 1), each
            tensor's dim 0 padded to a multiple of dp, as FSDP2 cuts it; R' the root's share
            (wte, wpe, ln_f: the parameters outside every block)
    state   16 P'/dp bytes: the fp32 weight, gradient and Adam's m and v of its dp shard
    tp      day 22's TP row at (tp, dp): per micro-batch 4 all-reduces of b s C per block, the
            embedding's and the head's, and the vocab-parallel loss's 3 b s numbers
    dp      per micro-batch each block all-gathered twice (forward, then again for backward:
            FSDP2 frees a block after its forward) and the root once (kept gathered from its
            forward to its backward); once per step, on the last micro-batch, every gradient
            reduce-scattered: (dp-1)/dp e [m (2 P' - R') + P']
    norm    the squared norm's shares, one fp64 number all-reduced over every rank (each holds
            other shards of the same parameters)

Exact for the course's GPT when the counts come from its shapes (padded_counts); FSDP2's
all-gather pads each rank's share of a unit as its dim-0 cut does, nothing more.
"""

from __future__ import annotations

import torch

from day19_tp.formulas import ring_bytes
from day22_megatron import formulas, hsdp
from day22_megatron.layouts import Layout
from dtl.model import GPTConfig

FP32 = formulas.FP32
AXES = ("tp", "dp", "norm")


def padded_counts(tp_model: torch.nn.Module, dp: int) -> tuple[int, int]:
    """(P', R'): this rank's TP-shard parameters, and the root's, padded as FSDP2 pads over dp
    (dim 0 to a multiple of dp). `tp_model`: the GPT after apply_tp, before fully_shard."""
    return hsdp.padded_counts(tp_model, dp)


def state_bytes(padded: int, dp: int) -> float:
    """What a rank holds between steps: 1/dp of its TP shard's weights, gradients and moments."""
    return hsdp.ADAM_FP32 * padded / dp


def comm_bytes(
    cfg: GPTConfig,
    *,
    tp: int,
    dp: int,
    padded: int,
    root: int,
    micro_batch_size: int,
    microbatches: int,
    seq_len: int,
) -> dict[str, float]:
    """Ring bytes one rank sends per optimizer step on each axis (dtl.comm's ring bytes)."""
    lay = Layout(tp=tp, dp=dp)
    m = microbatches
    tp_row = formulas.comm_bytes(
        cfg, lay, 0, micro_batch_size=micro_batch_size, microbatches=m, seq_len=seq_len
    )["tp"]
    # one all-gather or reduce-scatter of n elements sends (dp-1)/dp of them per rank
    gathered = m * (2 * padded - root)  # blocks twice per micro-batch, the root once
    return {
        "tp": tp_row,
        "dp": (dp - 1) / dp * (gathered + padded) * FP32,  # + the step's reduce-scatter
        "norm": ring_bytes(1, 8, tp * dp),
    }
