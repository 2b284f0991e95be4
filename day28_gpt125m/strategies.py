"""Day 28: one interface over every strategy of the course, so one loop trains them all.

    s = build("fsdp2", Setup(cfg, recipe, grid, device, ...))   # any name in REGISTRY
    loss, norm = s.step(micro_batches, lr)              # one optimizer step (accumulation inside)
    full = s.full_parameters()                          # the dense model's tensors (collective)
    s.close()

    strategy  built from                  the DP sync                 the optimizer
    ddp       torch DDP (day 17)           all-reduce in buckets       AdamW, full state per rank
    fsdp2     torch fully_shard (day 18)   reduce-scatter / all-gather AdamW on each rank's shard
    zero2     DeepSpeed ZeRO-2 (day 18)    reduce-scatter / all-gather DeepSpeed's AdamW on shards
    zero3     DeepSpeed ZeRO-3 (day 23)    reduce-scatter / all-gather DeepSpeed's AdamW on shards
    tp_pp     our stack (day 22): apply_tp -> apply_pp, DP by average_gradients; torch AdamW
    tp_sp     the same stack with Megatron SP on TP (day 21), pp = 1
    ep        the same stack on an MoE GPT: experts over ep of the dp ranks, tokens by all-to-all
    megatron  megatron-core (day 22): GPTModel, its schedule, DDP, DistributedOptimizer
    fsdp2_tp  our TP layers (day 19) over tp, fully_shard over dp: torchtitan's (dp, tp) mesh
    fsdp2_dtensor_tp  the same mesh with torch's DTensor TP (parallelize_module), as torchtitan

Each strategy is a class in REGISTRY that says what it supports (model parallelism, --precision,
--compile, checkpoints) and predicts its own per-rank model state (fit.py asks it), in a module of
its family: data_parallel.py (ddp, fsdp2), deepspeed_zero.py (zero2, zero3), model_parallel.py
(tp_pp, tp_sp, ep, and the Pipelined base they share with megatron), megatron_core.py (megatron),
sharded_tp.py (fsdp2_tp), sharded_tp_dtensor.py (fsdp2_dtensor_tp).
This module imports them all, so that REGISTRY is complete for whoever imports it here: adding a
strategy is a class with @register in one of them (or a new module imported below), and the
config, the fit check and the tests take it from there.

Checkpoints: DDP, FSDP2, our TP + PP and TP + SP through day 24's Checkpointer (DCP: sharded,
atomic, reshardable; every TP shard a DTensor, day24_checkpoint/sharded.py, loads at another tp,
pp or dp), DeepSpeed's ZeRO through its save_checkpoint; megatron-core's dist_checkpointing is
not wired here (train.py refuses --resume).

Every strategy takes the same recipe (AdamW betas 0.9/0.95, decay on matrices only, global-norm
clipping, the learning rate of this step) and the same global batch, so every one must train like
the one-process GPT: tests/test_day28_gpt125m.py checks that, strategy by strategy.
"""

from __future__ import annotations

import torch.distributed as dist

# imported for their @register: REGISTRY lists the strategies in the notes' order (--help,
# fit.check's hint) because these load in that order, megatron_core after model_parallel (its base)
from day28_gpt125m import (  # noqa: F401
    data_parallel,
    deepspeed_zero,
    megatron_core,
    model_parallel,
    sharded_tp,
    sharded_tp_dtensor,
)
from day28_gpt125m.strategy import REGISTRY, Setup, Strategy
from dtl.dist import all_reduce_scalar
from dtl.grid import ParallelGrid
from dtl.precision import PRECISIONS

STRATEGIES = tuple(REGISTRY)  # what --strategy takes
MODEL_PARALLEL = tuple(n for n, c in REGISTRY.items() if c.model_parallel)  # take --tp, --pp
EXPERTS = tuple(n for n, c in REGISTRY.items() if c.experts)  # train an MoE model, take --ep
REPLICATES = tuple(n for n, c in REGISTRY.items() if c.replicates)  # take --replicas (HSDP)
# --precision=p is applied by APPLIES[p] (on some device); the others run fp32
APPLIES = {p: tuple(n for n, c in REGISTRY.items() if p in c.support.devices) for p in PRECISIONS}
COMPILE = tuple(n for n, c in REGISTRY.items() if c.compile)  # wrap in torch.compile


def build(name: str, s: Setup) -> Strategy:
    """The strategy `name`, built from `s` (strategy.Setup: the GPT, recipe, grid, device...)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; one of {', '.join(REGISTRY)}")
    return REGISTRY[name](s)


def mean_loss(loss: float | None, grid: ParallelGrid) -> float:
    """The step's loss averaged over the ranks that hold it (the last pipeline stage of every
    DP replica; every rank without a pipeline)."""
    holders = dist.get_world_size() // grid.pp_size
    return all_reduce_scalar(loss or 0.0) / holders
