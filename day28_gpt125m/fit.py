"""Day 28: will this model and strategy fit the device? Predicted before anything is allocated.

    need = predicted_bytes(cfg, "zero3")     # per rank: model state + activations, bytes
    check(cfg)                               # FitError (one line, with a strategy that fits)

Model state per rank, Ψ parameters, N = world ranks, fp32 (bf16 autocast keeps fp32 weights),
from the days that measured each: resident (the partitions a rank keeps) + gathered (what it holds
full while a step runs), each strategy's own predicted_state (its class in REGISTRY):
    ddp        16Ψ: 4 param + 4 grad + 8 Adam (day 18's table)               + 0
    fsdp2      16Ψ/N; 16Ψ/(N/r) as HSDP over r replicas                       + the largest block
    zero2      4Ψ + 16Ψ/N: parameters whole, the rest sharded, fp32 master    + 0
               (day 18); 2Ψ + 14Ψ/N in bf16
    zero3      20Ψ/N: DeepSpeed keeps an fp32 master beside fp32 parameters   + every parameter
               (day 18); 16Ψ/N in bf16 (2 + 2 + 12)                           (day 23: 4Ψ, 2Ψ)
    tp_pp,     day 22's formulas.state_bytes of the fullest pipeline stage (the TP shard of its
    tp_sp,     layers, the embedding on the first stage, the head on the last) + 0; tp_sp is
    ep,        tp_pp at pp = 1; ep keeps E/ep experts of each MoE layer (day 22's expert rows);
    megatron   megatron's DistributedOptimizer shards Adam's m and v over dp
    fsdp2_tp   16P/dp, P = one TP rank's parameters (day 22's params_per_rank)  + the largest
               block's TP shard, full
    fsdp2_dtensor_tp  the same with P = the blocks' TP shards and the embeddings and LayerNorms
               whole (DTensor TP on the blocks only: sharded_tp_dtensor.py)
Activations per rank: L/pp layers x 34·s·b·h bytes (Korthikanti's 16-bit count; doubled in
fp32), / t, with b the micro-batch; the 1F1B first stage holds pp micro-batches, which cancels
the /pp; plus the fp32 logits and their gradient, 8·b·s·V/t on the last stage. An MoE is counted
as its dense trunk: each token's k routed copies through F-wide experts are counted as one 4C-wide
MLP, so tiny-moe (k = 2, F = 4C) holds about one MLP's share more (18·s·b·h per layer).
The device: the GPU's total memory when the run computes on GPUs (NCCL), else the machine's RAM
shared by the local ranks (a gloo run); DTL_DEVICE_MEMORY_GB overrides it (the tests, and a
what-if on any machine).
"""

from __future__ import annotations

import os

import torch

from day22_megatron import formulas
from day28_gpt125m.strategies import REGISTRY
from dtl import dist as dtl_dist
from dtl.deepspeed import DsConfigError, planned_device_type

GB = 1e9


class FitError(ValueError):
    """The run would not fit the device; one line, with what would."""


def device_bytes(local_world: int) -> float:
    """The memory one rank may fill: its GPU's when the run computes on GPUs (NCCL), else the
    machine's RAM over the local ranks (a gloo run, on a GPU machine too: its tensors live in
    RAM)."""
    if os.environ.get("DTL_DEVICE_MEMORY_GB"):
        return float(os.environ["DTL_DEVICE_MEMORY_GB"]) * GB
    try:
        on_gpu = planned_device_type() == "cuda"  # dtl.dist.init's rule, before it runs
    except DsConfigError as e:  # a DTL_BACKEND that cannot run here
        raise FitError(str(e)) from None
    if on_gpu:
        return float(torch.cuda.get_device_properties(0).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / max(1, local_world)


def predicted_bytes(
    cfg,
    strategy: str,
    *,
    world: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    replicas: int = 1,
    micro: int = 1,
    seq_len: int = 1024,
    precision: str = "fp32",
) -> dict[str, float]:
    """Per-rank bytes of `strategy`: resident state, gathered parameters, activations, and the
    states and total they add up to. `cfg`: a GPTConfig, or anything with model_config()."""
    m = cfg.model_config() if hasattr(cfg, "model_config") else cfg
    kind = REGISTRY[strategy]  # each strategy predicts its own state (its class)
    resident, gathered = kind.predicted_state(
        m, world=world, tp=tp, pp=pp, ep=ep, replicas=replicas, precision=precision
    )
    t = tp if kind.model_parallel else 1
    acts = formulas.activation_bytes(m, seq_len, micro, t, precision)  # day 22's count
    states = resident + gathered
    return dict(
        resident=resident, gathered=gathered, states=states, activations=acts, total=states + acts
    )


def check(cfg) -> None:
    """Raise FitError if cfg's strategy needs more than the device has, naming one that fits."""
    have = device_bytes(dtl_dist.local_world_size() if "WORLD_SIZE" in os.environ else cfg.world)
    kw = dict(world=cfg.world, micro=cfg.micro_batch_size, seq_len=cfg.seq_len)
    own = dict(kw, precision=cfg.runs_precision)
    sizes = dict(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, replicas=cfg.replicas)
    need = predicted_bytes(cfg, cfg.strategy, **sizes, **own)
    if need["total"] <= have:
        return
    others = {
        s: predicted_bytes(cfg, s, **kw, precision=kind.runs_in(cfg.precision, cfg.device_type))[
            "total"
        ]
        for s, kind in REGISTRY.items()
        if kind.suggested_when_short
        and s != cfg.strategy
        and kind.experts == (cfg.model_config().moe is not None)  # dense models, or MoE ones
    }
    fits = [f"{s} ({b / GB:.1f} GB)" for s, b in others.items() if b <= have]
    hint = f"strategies that fit: {', '.join(fits)}" if fits else "lower --micro_batch_size"
    raise FitError(
        f"{cfg.model} with {cfg.strategy} needs ~{need['total'] / GB:.1f} GB per rank (state "
        f"{need['states'] / GB:.1f} + activations {need['activations'] / GB:.1f}) but the device "
        f"has {have / GB:.1f} GB; {hint}"
    )
