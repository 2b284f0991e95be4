"""A parallel layout (tp, cp, pp with vpp chunks, dp) and every check that must pass before it
runs: the errors Megatron-LM's argument validation gives, one line each, before any collective.

    lay = Layout.from_world(8, tp=2, pp=2, layers_per_virtual_stage=1, n_layer=4)   # dp = 2
    check(lay, cfg, micro_batch_size=1, global_batch_size=8, seq_length=64)
    lay.microbatches(global_batch_size=8, micro_batch_size=1)                        # 4 per DP rank

The world is tp x cp x pp x dp ranks (dtl.grid.ParallelGrid lays them out TP innermost, PP
outermost, as Megatron does); the global batch is dp x micro-batches x micro_batch_size sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtl.model import PRESETS, GPTConfig, pad_vocab_size, preset

# Megatron's default --make-vocab-size-divisible-by: the vocabulary is padded to a multiple of
# this times tp, so that every TP rank holds the same number of embedding rows
VOCAB_MULTIPLE = 128


def tp_vocab(cfg: GPTConfig, tp: int) -> GPTConfig:
    """`cfg` with a vocabulary tp ranks can split: kept when tp divides it (so that a simulated
    model, the formulas and planner.py count the same rows), else padded as Megatron pads, to
    a multiple of VOCAB_MULTIPLE x tp (the extra rows are never a target)."""
    if cfg.vocab_size % tp == 0:
        return cfg
    return replace(cfg, vocab_size=pad_vocab_size(cfg.vocab_size, VOCAB_MULTIPLE, tp))


def padded_preset(name: str, n_layer: int, vocab_multiple: int, tp: int) -> GPTConfig:
    """A dtl preset with `n_layer` layers (0: the preset's) and its vocabulary padded to a
    multiple of vocab_multiple x tp (Megatron's --make-vocab-size-divisible-by): the extra rows
    are never a target, and the one-process reference is built with the same padded config."""
    cfg = PRESETS[name]
    return preset(
        name,
        n_layer=n_layer or cfg.n_layer,
        vocab_size=pad_vocab_size(cfg.vocab_size, vocab_multiple, tp),
    )


class LayoutError(ValueError):
    """A layout or batch that cannot run; the message is one line."""


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    ep: int = 1  # expert-parallel ranks among the dp ranks (megatron-core's EP folds in DP)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @classmethod
    def from_world(
        cls,
        world: int,
        *,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        layers_per_virtual_stage: int = 0,
        n_layer: int = 1,
    ) -> Layout:
        """dp from the world size; vpp from Megatron's --num-layers-per-virtual-pipeline-stage."""
        for name, size in (("tensor", tp), ("pipeline", pp), ("context", cp)):
            if size < 1:
                raise LayoutError(f"{name}-model-parallel size must be >= 1, got {size}")
        if world % (tp * pp * cp):
            raise LayoutError(
                f"tp {tp} x pp {pp} x cp {cp} = {tp * pp * cp} does not divide the world size "
                f"{world} (world = tp x pp x cp x dp)"
            )
        vpp = 1
        if layers_per_virtual_stage:
            if pp < 2:
                raise LayoutError("interleaving (virtual pipeline stages) needs pp >= 2")
            if n_layer % (pp * layers_per_virtual_stage):
                raise LayoutError(
                    f"{n_layer} layers do not split into pp {pp} x chunks of "
                    f"{layers_per_virtual_stage} layers (layers % (pp x layers per virtual "
                    "stage) must be 0)"
                )
            vpp = n_layer // (pp * layers_per_virtual_stage)
        return cls(tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp), vpp=vpp)

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "no pipelining (micro-batches accumulated)"
        return f"interleaved 1F1B (v={self.vpp})" if self.vpp > 1 else "1F1B"

    def microbatches(self, global_batch_size: int, micro_batch_size: int) -> int:
        return global_batch_size // (micro_batch_size * self.dp)

    def name(self, sp: bool = False) -> str:
        """tp2-pp2-vpp2-sp-dp1: the run folder's name."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp > 1 else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += ["sp"] if sp else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        return "-".join([*parts, f"dp{self.dp}"])


def check(
    lay: Layout,
    cfg: GPTConfig,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    seq_length: int,
    sequence_parallel: bool = False,
) -> None:
    """Raise LayoutError (one line) for anything the layout cannot run with this model and batch."""
    if cfg.n_layer % (lay.pp * lay.vpp):
        raise LayoutError(
            f"{cfg.n_layer} layers do not split over pp {lay.pp} x vpp {lay.vpp} = "
            f"{lay.pp * lay.vpp} stages"
        )
    if cfg.n_head % lay.tp:
        raise LayoutError(f"{cfg.n_head} attention heads do not split over tp {lay.tp}")
    if cfg.vocab_size % lay.tp:
        raise LayoutError(
            f"vocabulary {cfg.vocab_size} is not a multiple of tp {lay.tp} (pad it: "
            "dtl.model.pad_vocab_size, Megatron's --make-vocab-size-divisible-by)"
        )
    if seq_length > cfg.block_size:
        raise LayoutError(f"seq_length {seq_length} exceeds the model's {cfg.block_size} positions")
    if sequence_parallel and lay.tp == 1:
        raise LayoutError("--sequence-parallel needs tensor parallelism (tp > 1)")
    if sequence_parallel and seq_length % lay.tp:
        raise LayoutError(
            f"sequence parallelism splits the {seq_length} tokens over tp {lay.tp}: not divisible"
        )
    check_experts(lay, cfg, sequence_parallel)
    rows = micro_batch_size * lay.dp
    if global_batch_size % rows:
        raise LayoutError(
            f"global batch {global_batch_size} is not divisible by micro-batch "
            f"{micro_batch_size} x dp {lay.dp} = {rows}"
        )
    m = global_batch_size // rows
    if lay.vpp > 1 and m % lay.pp:
        raise LayoutError(
            f"interleaved 1F1B needs the micro-batches per DP rank ({m}) to be a multiple of "
            f"pp {lay.pp}"
        )


def check_experts(lay: Layout, cfg: GPTConfig, sequence_parallel: bool = False) -> None:
    """Expert parallelism's sizes, and what an MoE does not run with here: CP and SP hand each
    rank part of a row, so its router's load-balancing loss would count part of the tokens."""
    moe = cfg.moe
    if lay.ep > 1 and moe is None:
        raise LayoutError(f"ep {lay.ep} needs a model with experts (e.g. --model=tiny-moe)")
    if lay.dp % lay.ep:
        raise LayoutError(f"ep {lay.ep} must divide dp {lay.dp}: the expert ranks are dp ranks")
    if moe is not None and moe.n_expert % lay.ep:
        raise LayoutError(f"{moe.n_expert} experts do not split over ep {lay.ep}")
    if moe is not None and (lay.cp > 1 or sequence_parallel):
        raise LayoutError(
            "an MoE runs without CP and SP here: each rank would route part of a row and its "
            "load-balancing loss would count those tokens only"
        )
