"""Day 28: the interface every strategy fills in, and the registry that lists them.

A strategy is a class with a name, what it supports (model parallelism, --precision, --compile,
checkpoints), the optional extras it needs (deepspeed, megatron), its predicted per-rank model
state (fit.py asks it), how it is built from the recipe and the grid, and one optimizer step.
The course's strategies are classes with @register in one module per family (data_parallel.py,
deepspeed_zero.py, model_parallel.py, megatron_core.py); strategies.py imports them all, so its
REGISTRY is complete, and train.py's --strategy, fit.py and the tests take them from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from day28_gpt125m.recipe import Recipe
from dtl.grid import ParallelGrid
from dtl.model import GPTConfig
from dtl.precision import ANY_DEVICE, Support, declare
from dtl.state import StateBytes

REGISTRY: dict[str, type[Strategy]] = {}  # name -> class, in the order the notes list them


@dataclass(frozen=True)
class Setup:
    """What every strategy is built from: the one-process GPT(cfg, seed), the recipe, the run's
    grid and device, and the step's shape. Each strategy reads the fields it uses."""

    cfg: GPTConfig
    recipe: Recipe
    grid: ParallelGrid
    device: torch.device
    micro_batch: int  # sequences per micro-batch per DP rank
    accum: int  # micro-batches per optimizer step
    seq_len: int
    seed: int
    steps: int  # optimizer steps of the whole run (a scheduler's length)
    recompute: str = "none"  # dtl.model's set_recompute
    replicas: int = 1  # HSDP (a strategy that `replicates`): shard groups of world / replicas


# What a strategy that applies no precision of its own trains in
FP32_ONLY = declare(
    "day 28's TP, PP and megatron strategies",
    {"fp32": ANY_DEVICE},
    why="they train fp32 here; bf16 runs with ddp, fsdp2, zero2 and zero3, fp8 with ddp and fsdp2",
)


def register(cls: type[Strategy]) -> type[Strategy]:
    REGISTRY[cls.name] = cls
    return cls


class Strategy:
    name = ""
    model_parallel = False  # takes --tp and --pp (tp x pp x dp ranks); else pure data parallel
    pipelines = True  # a model-parallel strategy that takes --pp > 1 (tp_sp: no, pp = 1)
    sequence_parallel = False  # Megatron SP on top of TP (needs --tp > 1)
    # trains a mixture-of-experts GPT, its experts over --ep of the dp ranks (the others train
    # dense models: they refuse an MoE preset in one line)
    experts = False
    no_recompute = ""  # why --recompute other than none is refused ("": dtl.model's applies)
    # the precisions it applies (autocast, or DeepSpeed's section), and on which devices; asked
    # for another, it runs fp32 (train.py says so)
    support: Support = FP32_ONLY
    compile = False  # --compile wraps its model in torch.compile
    measures_state = True  # counts this rank's model-state bytes at the last step
    counts_sent = False  # counts the bytes each axis sent in the last step (last_sent)
    # takes --replicas > 1: HSDP, its state sharded over world / replicas ranks and replicated
    # over `replicas` groups of them (day 22's hsdp.py)
    replicates = False
    suggested_when_short = False  # named by fit.check when the chosen strategy does not fit
    no_checkpoints = ""  # why --resume / --save_every are refused ("" : they work)
    extras: tuple[str, ...] = ()  # the optional extras it imports; its tests skip without them
    last_state: StateBytes | None = None  # this rank's bytes of model state at the last step
    # ring bytes this rank sent on each axis in the last step, and their formula, where the
    # strategy counts them (dtl.comm.CommCounter)
    last_sent: dict[str, float] | None = None
    predicted_sent: dict[str, float] | None = None
    measure_state = False  # the loop sets it for the last step: counting is kept out of the rest

    def __init__(self, s: Setup):
        """The strategy on the one-process GPT(s.cfg, s.seed), over the run's grid s.grid."""
        raise NotImplementedError

    @classmethod
    def predicted_state(
        cls,
        m: GPTConfig,
        *,
        world: int,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        replicas: int = 1,
        precision: str = "fp32",
    ) -> tuple[float, float]:
        """(resident, gathered) model-state bytes per rank: the partitions a rank keeps, and
        what it holds full while a step runs (fit.py's table). `ep`: expert-parallel ranks
        (a strategy with `experts`; the others train dense models and ignore it); `replicas`:
        HSDP's replica groups (a strategy that `replicates`; the others ignore it)."""
        raise NotImplementedError

    @classmethod
    def predicted_rank_state(
        cls,
        m: GPTConfig,
        *,
        world: int,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        replicas: int = 1,
        pp_rank: int = 0,
        precision: str = "fp32",
    ) -> float:
        """The resident model-state bytes of the ranks at pipeline position `pp_rank` (the
        same on every rank unless the strategy pipelines: then the first stage holds the
        embedding, the last the head). fit.py sizes by the fullest; the tests check each."""
        sizes = dict(world=world, tp=tp, pp=pp, ep=ep, replicas=replicas)
        return cls.predicted_state(m, **sizes, precision=precision)[0]

    @classmethod
    def runs_in(cls, precision: str, device_type: str) -> str:
        """The precision it trains in on `device_type` when asked for `precision`: that one where
        it declares it, else fp32 (which every strategy trains in)."""
        return precision if cls.support.trains(precision, device_type) else "fp32"

    def step(self, micro_batches, lr: float) -> tuple[float | None, float]:
        """One optimizer step over this DP rank's micro-batches; returns (the mean loss where
        this rank knows it, the global gradient norm before clipping)."""
        raise NotImplementedError

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> the full tensor, keyed as the one-process GPT's named_parameters."""
        raise NotImplementedError

    def save(self, folder: str, step: int) -> None:
        """A checkpoint of everything the next steps need, as of `step` steps done."""
        raise NotImplementedError(f"{self.name}: no checkpoint support")

    def load(self, folder: str) -> int:
        """Load the latest checkpoint in `folder`; returns its step (steps done)."""
        raise NotImplementedError(f"{self.name}: no checkpoint support")

    def close(self) -> None:
        pass
