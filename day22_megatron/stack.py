"""Our own 4-D stack: the earlier days' `apply_<x>` functions composed on the shared GPT (TP,
then SP or CP, then PP cutting the changed model into stages, then DP), over one
ParallelGrid(dp, pp, cp, tp).

    stack = build_stack(cfg, grid, micro_batch_size=1, microbatches=4, seq_len=32)
    loss = forward_backward(stack, micro_batches)     # grads in the parameters, per rank
    sync_gradients(stack)                             # DP: each over its reduction axes
    norm = clip_gradients(stack, 1.0)                 # the dense model's norm, from the shards
    stack.optimizer.step(); stack.optimizer.zero_grad(set_to_none=True)

The order and what each step leaves for the next:
    1. apply_tp (day 19)   the TP plan's modules become column/row/vocab-parallel shards over
                           grid.tp_group; the loss becomes the vocab-parallel cross-entropy
    2. apply_sp (day 21)   optional: TP's replicated activations split over the same group
    3. apply_cp (day 21)   attention becomes ring (or Ulysses) attention over grid.cp_group; a
                           batch row is cut into this rank's T/cp tokens and their positions
       apply_ep (ep.py)    where the grid has an ep axis: each MoE layer keeps its E/ep
                           experts and moves tokens to them by all-to-all over grid.ep_group
    4. apply_pp (day 20)   the model is cut into this rank's stages; a schedule's action list
                           runs every micro-batch's forward and backward, p2p between stages
    5. DP                  every gradient averaged over the axes its parameter's record names
                           (dp x cp, and ep for all but the experts), once per step, after the
                           last backward
       ZeRO-1 (distopt.py)  optional (`distributed_optimizer`): the same axes, but each gradient
                           reduce-scattered, AdamW on this rank's slice, the weights all-gathered
The reduction table (dtl.reduction, `stack.reduction`) says, parameter by parameter, which grid
axes hold its replicas, its pieces, its stages and (for an expert) the ranks routing to it: the
DP average, the global norm and the full state read it, never a parameter's name.
Two combinations are refused: CP or SP under PP. Day 20's runner allocates (B, T, C) receive
buffers and passes no position ids, so a stage cannot take T/cp (or T/tp) tokens; megatron-core
(train_megatron.py) runs SP with PP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from day19_tp.tp import apply_tp, full_tensors, tp_loss
from day20_pp.pipeline import Pipeline, apply_pp, stage_parameters
from day21_sp_cp.cp import apply_cp, check_cp, cp_batch
from day21_sp_cp.sp import apply_sp
from day22_megatron.distopt import DistributedOptimizer
from day22_megatron.ep import EP_AXES, EP_AXIS, EP_COMBOS, apply_ep
from day22_megatron.layouts import Layout, LayoutError, check_experts
from dtl import profile as dtl_profile
from dtl import simulate
from dtl.dist import average_gradients
from dtl.exercise_seam import exercise
from dtl.grid import AXES, ParallelGrid
from dtl.model import GPT, GPTConfig, loss_fn
from dtl.moe import set_aux_loss_scale
from dtl.optim import OptimConfig, clip_coefficient
from dtl.reduction import ReductionTable, gpt_reductions
from dtl.state import StateBytes, live_state_bytes

# Megatron's AdamW: decay on the matrices only, at 0.1 (the stack's default)
MEGATRON_ADAMW = OptimConfig(weight_decay=0.1, decay="matrices")


@dataclass
class Stack:
    grid: ParallelGrid
    gpt: GPT  # the model after TP / SP / CP (every stage is a copy of it, cut)
    pipeline: Pipeline | None  # None when pp == 1
    params: list  # this rank's parameters, each once
    named: dict  # one-process name -> parameter, this rank's (a tied lm_head under its name)
    loss: Callable  # (logits, targets) -> mean loss: vocab-parallel under TP
    optimizer: torch.optim.Optimizer | DistributedOptimizer  # ZeRO-1: distopt.py
    reduction: ReductionTable  # name -> the grid axes of its replicas, pieces and stages
    record: object = None  # the pipeline's StepRecord of the last step (spans, in-flight)


def grid_for(lay: Layout) -> ParallelGrid:
    """The layout's grid: with expert parallelism, an ep axis inside dp (megatron-core's order)
    and the groups the expert reductions need. Collective (it builds the groups)."""
    axes, combos = (EP_AXES, EP_COMBOS) if lay.ep > 1 else (AXES, ())
    return ParallelGrid(
        dp=lay.dp // lay.ep, ep=lay.ep, pp=lay.pp, cp=lay.cp, tp=lay.tp, axes=axes, combos=combos
    )


def check_stack(
    cfg: GPTConfig, *, tp: int, pp: int, cp: int, seq_len: int, attn: str, sp: bool
) -> None:
    """What this stack refuses (LayoutError, CPError), from the sizes alone: train_4d's config
    checks it before any process group exists, build_stack again on the grid."""
    if pp > 1 and (cp > 1 or sp):
        raise LayoutError(
            "this stack runs CP and SP without PP only: day 20's pipeline passes (B, T, C) "
            "activations and no position ids (megatron-core's train_megatron.py has SP x PP)"
        )
    check_cp(cfg.n_head, tp, cp, seq_len, attn, sp)
    check_experts(Layout(tp=tp, pp=pp, cp=cp), cfg, sp)


def build_stack(
    cfg: GPTConfig,
    grid: ParallelGrid,
    *,
    micro_batch_size: int,
    microbatches: int,
    seq_len: int,
    schedule: str = "1f1b",
    chunks: int = 1,
    attn: str = "ring_zigzag",
    sp: bool = False,
    seed: int = 0,
    optim: OptimConfig = MEGATRON_ADAMW,
    device="cpu",
    recompute: str = "none",
    distributed_optimizer: bool = False,
) -> Stack:
    sizes = dict(tp=grid.tp_size, pp=grid.pp_size, cp=grid.cp_size)
    check_stack(cfg, **sizes, seq_len=seq_len, attn=attn, sp=sp)
    if distributed_optimizer and cfg.moe is not None:
        raise LayoutError("the distributed optimizer runs on dense models here (no experts)")
    gpt = GPT(cfg, seed=seed)
    gpt.set_recompute(recompute)  # dtl.model: every block, so every stage's copy of it
    gpt = simulate.to_device(gpt, device)
    reduction = gpt_reductions(gpt, grid.axes)  # one-process names, before a layer changes them
    unplaced = reduction.unplaced(a for a in grid.axes if grid.group_size(a) > 1)
    if unplaced:  # a grid axis no record places: its ranks would never be reduced together
        raise ValueError(f"the reduction table gives the grid axis {unplaced} no role")
    if grid.tp_size > 1:
        apply_tp(gpt, grid)
    if sp:
        apply_sp(gpt)
    if grid.pp_size == 1:  # (under PP, cp = 1: nothing to do)
        apply_cp(gpt, grid, attn)  # cp = 1: the fused kernel stays; it only records model.cp
    if grid.sizes.get(EP_AXIS, 1) > 1:
        apply_ep(gpt, grid.group(EP_AXIS))  # my experts only; tokens by all-to-all
    set_aux_loss_scale(gpt, 1 / microbatches)  # the loss is divided by m: so is the aux's
    loss = (lambda logits, y: tp_loss(gpt, logits, y)) if grid.tp_size > 1 else loss_fn
    pipeline = None
    if grid.pp_size > 1:
        pipeline = apply_pp(
            gpt, grid, schedule, microbatches, (micro_batch_size, seq_len), chunks, loss
        )
        named = stage_parameters(pipeline.stages)
        params = pipeline.parameters()
    else:
        named = dict(gpt.named_parameters(remove_duplicate=False))
        params = list(gpt.parameters())
    optimizer = (
        DistributedOptimizer(named, reduction, grid, optim)  # ZeRO-1: Adam's state sliced
        if distributed_optimizer
        else optim.make(params)
    )
    return Stack(grid, gpt, pipeline, params, named, loss, optimizer, reduction)


def stack_modules(stack: Stack) -> list:
    """The modules this rank runs: its pipeline stages, or the whole (TP/CP/EP) model."""
    return list(stack.pipeline.stages) if stack.pipeline is not None else [stack.gpt]


def stack_state_bytes(stack: Stack) -> StateBytes:
    """What this rank holds after an optimizer step (before zero_grad): its shards' and stages'
    parameters, their gradients, Adam's moments (not its step counters, as the formula); under
    ZeRO-1, its buffers (padding included) and its slices' moments."""
    if isinstance(stack.optimizer, DistributedOptimizer):
        return stack.optimizer.state_bytes()
    return live_state_bytes(stack.params, stack.optimizer, counters=False)


def forward_backward(stack: Stack, micro_batches) -> float | None:
    """Every micro-batch's forward and backward; gradients accumulate in this rank's params.
    Returns the step's mean loss where it is known (last pipeline stage), else None."""
    if stack.pipeline is not None:
        loss, stack.record = stack.pipeline.step(micro_batches)
        return loss
    total = 0.0
    for x, y in micro_batches:
        x, y, pos = cp_batch(stack.gpt, x, y)  # (b, T) -> my (b, T/cp) tokens and positions
        with dtl_profile.range(dtl_profile.FORWARD):  # named ranges (the pipeline: F0, B0, ...)
            loss = stack.loss(stack.gpt(x, pos), y) / len(micro_batches)
        with dtl_profile.range(dtl_profile.BACKWARD):
            loss.backward()
        total += simulate.item(loss)  # (a fake loss under dtl.simulate has no value)
    return total


def sync_gradients(stack: Stack) -> int:
    """DP: each gradient averaged over the ranks that hold its replicas and saw other tokens,
    the axes its record names (dp x cp, CP ranks saw other parts of the same rows; and ep for
    every parameter but the experts, whose sum is divided by their routed axes too); one
    all-reduce per set of axes. Returns the bytes reduced."""
    if isinstance(stack.optimizer, DistributedOptimizer):  # ZeRO-1: slices, not replicas
        return stack.optimizer.reduce_scatter_gradients()
    groups = stack.reduction.average_groups(stack.named)  # axes -> this rank's parameters
    table, grid = stack.reduction, stack.grid
    return sum(
        average_gradients(
            params, grid.group(*axes), grid.group_size(*table.divisor_axes(axes))
        )  # an expert's sum over its ep ranks' tokens is divided by their count too
        for axes, params in groups.items()
        if axes  # (a parameter with no replica to average with: nothing to send)
    )


@exercise("day22.grad_norm")
def _counted_once(name: str, stack: Stack) -> bool:
    """Does this rank's copy of `name` enter the global gradient norm? `stack.reduction[name]`
    (a dtl.reduction.Reduction) says how the tensor lies on the grid: along its `shard`,
    `stage` and `routed` axes the ranks hold other numbers (count it on every rank along them);
    along any other axis the norm sums over (`stack.reduction.norm_axes`) they hold the same
    tensor: a replica, or an average (a dense parameter along ep, where other ranks hold other
    experts) (count it where this rank's coordinate, `stack.grid.coords[axis]`, is 0); and a
    `copy_of` another parameter (a tied lm_head) never counts: that one stands for both.
    Megatron's `param_is_not_tensor_parallel_duplicate` and `param_is_not_shared`."""
    # exercise day22.grad_norm: begin
    record = stack.reduction[name]
    others = record.shard + record.stage + record.routed
    same = [axis for axis in stack.reduction.norm_axes if axis not in others]
    at_first = all(stack.grid.coords[axis] == 0 for axis in same)
    return record.copy_of is None and at_first
    # exercise day22.grad_norm: end


@exercise("day22.grad_norm")
def global_grad_norm(stack: Stack) -> float:
    """The dense model's gradient norm, computed from the shards: squares summed on each rank
    over the tensors it counts once, then all-reduced over the table's norm axes
    (`stack.reduction.norm_axes`: tp x pp, Megatron's model-parallel group, and ep where
    experts are; the DP and CP ranks hold copies of the same averaged gradients).
    `stack.named` maps each one-process name to this rank's parameter; sum in float64.
    -> a float, on every rank"""
    # exercise day22.grad_norm: begin
    sq = torch.zeros(1, dtype=torch.float64, device=stack.params[0].device)
    for name, p in stack.named.items():
        if p.grad is not None and _counted_once(name, stack):
            sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, group=stack.grid.group(*stack.reduction.norm_axes))
    return sq.sqrt().item()
    # exercise day22.grad_norm: end


@torch.no_grad()
def clip_gradients(stack: Stack, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s rule on the global norm; returns the norm before."""
    if isinstance(stack.optimizer, DistributedOptimizer):  # the norm of the reduced slices
        return stack.optimizer.clip(max_norm)
    norm = global_grad_norm(stack)
    coef = clip_coefficient(norm, max_norm)
    if coef < 1.0:
        for p in stack.params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def full_state(stack: Stack, grads: bool = False) -> dict[str, torch.Tensor]:
    """name -> the full dense tensor (or gradient), on every rank, keyed as the one-process GPT's
    state dict (a tied lm_head.weight is wte.weight). The table says what to gather: pieces over
    its shard axes (day 19's full_tensors joins them by the TP plan), then the tensors of its
    stage axes merged; a copy is dropped and given its source's tensor. Collective."""
    table, grid = stack.reduction, stack.grid
    mine: dict[str, torch.Tensor] = {}
    modules = stack_modules(stack)
    for m in modules:
        if grid.group_size(*table.shard_axes) > 1:  # pieces on several ranks: joined
            part = full_tensors(m, grads=grads)
        else:
            part = {n: (p.grad if grads else p).detach() for n, p in m.named_parameters()}
        mine.update({n: t.cpu().clone() for n, t in part.items()})
    copies = table.copies()  # name -> its source (a last stage's copy of the tied weight)
    mine = {n: t for n, t in mine.items() if n not in copies}
    pieces: list = [mine]
    if table.merge_axes:  # each rank along them holds other tensors: every rank's dict
        stages = grid.group(*table.merge_axes)
        pieces = [None] * dist.get_world_size(stages)
        dist.all_gather_object(pieces, mine, group=stages)
    merged = {k: v for piece in pieces for k, v in piece.items()}
    merged.update({n: merged[src] for n, src in copies.items()})  # as a state dict lists it
    return merged
