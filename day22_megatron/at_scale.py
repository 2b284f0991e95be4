"""Day 22 at scale: the planner's pick for a model and a cluster, run as one rank of it,
simulated. scale.py prints it; day 28's scale.py uses it as a library.

planner.py picks a (tp, pp, dp) layout by formula. Here our own 4-D stack (stack.py: apply_tp,
apply_pp, DP by all-reduce) is built at that layout for the real model, as one rank of the real
world size, under dtl.simulate.fake_world (a fake process group, fake tensors: shapes, no data),
in bf16, and runs `k` micro-batches of the pick's size through its 1F1B schedule, the DP sync and
an optimizer step. The rank simulated is TP rank 0, DP rank 0 of the stage that holds the most
parameters (the formula's max over stages, read from the right rank). Side by side, per GPU:

    params      the elements this rank holds      formulas.params_per_rank (exact)
    TP / micro  ring bytes on the TP group        plan: 8(t-1)/t (L/p) s b h x 2 B (4 all-reduces
                per micro-batch                   per layer, or SP's gathers and scatters); the
                                                  ends add one each, which plan leaves out: the
                                                  vocab-parallel embedding's in forward (first
                                                  stage), the tied head's in backward (last):
                                                  a gap of 1/(4 L/p) per end; and the last
                                                  stage's vocab-parallel loss, 3 all-reduces
                                                  of s b fp32: 3/(2 (L/p) h) more
    PP / micro  bytes sent + received on the      plan: one (s, b, h) activation and one gradient
                pipeline group per micro-batch    per boundary, 2 s b h x 2 B
    DP / step   ring bytes on the DP group        what this stack does: all-reduce of the bf16
                                                  gradients, 2(d-1)/d x 2 B x params; plan's row
                                                  assumes Megatron's distributed optimizer,
                                                  6(d-1)/d x params (printed beside)
    state       parameters, gradients, Adam's m   this stack in bf16: (2 + 2 + 4) x params; plan's
                and v this rank holds             row: Megatron's (6 + 12/d) x params (beside)

Activations are not in the table: planner.py counts them with sequence parallelism, which this stack
does not run under PP (stack.py says why); days 19-21 measure them at N <= 8. The simulation
cannot see: dtl.simulate.CANNOT_SEE.
"""

from __future__ import annotations

import time

import torch

from day18_zero.formulas import comm_bytes_per_rank
from day22_megatron import formulas, planner
from day22_megatron.distopt import padding_of
from day22_megatron.layouts import Layout, tp_vocab
from day22_megatron.planner import BF16
from day22_megatron.stack import build_stack, forward_backward, stack_state_bytes, sync_gradients
from day22_megatron.step_model import GB
from dtl.comm import CommCounter
from dtl.grid import ParallelGrid
from dtl.simulate import fake_world


def picks(name: str, gpus: int) -> list[tuple[str, Layout, dict]]:
    """planner.py's pick for `name` on `gpus` GPUs (its notes' defaults), and its fastest layouts
    that fit with PP and with TP, where those differ: (which, layout, plan's row) each."""
    cfg = planner.MODELS[name]
    defaults = planner.PlanConfig()  # the notes' batch, usable memory and step model
    _, rows, best = planner.plan_for(defaults, name, gpus)
    assert best is not None, "Config.validate refuses a model and size with no fitting layout"
    layouts = {x.name(): x for x in planner.layouts_of(cfg, gpus, defaults.gpus_per_node)}
    fits = [r for r in rows if r["memory_gb"] <= defaults.usable_gb]
    out = {best["layout"]: ("pick", best)}
    for which, axis in (("fastest with PP", "pp"), ("fastest with TP", "tp")):
        using = [r for r in fits if getattr(layouts[r["layout"]], axis) > 1]
        if using:
            r = min(using, key=lambda r: r["step_s"])
            out.setdefault(r["layout"], (which, r))
    return [(which, layouts[lay], r) for lay, (which, r) in out.items()]


def fullest_stage(cfg, lay: Layout) -> int:
    return max(range(lay.pp), key=lambda r: formulas.params_per_rank(cfg, lay, r))


def simulate(
    cfg, lay: Layout, b: int, k: int, stage: int, distributed_optimizer: bool = False
) -> dict:
    """TP rank 0, DP rank 0 of pipeline stage `stage`, simulated: what `measure` reads there."""
    rank = stage * (lay.world // lay.pp)  # ParallelGrid: pp outermost, then dp, cp, tp
    with fake_world(lay.world, rank):
        return measure(cfg, lay, b, k, distributed_optimizer)


def measure(cfg, lay: Layout, b: int, k: int, distributed_optimizer: bool = False) -> dict:
    """This rank in `lay`: k micro-batches of b sequences through the stack, the DP sync and an
    optimizer step, in bf16; what it holds and moves. A simulation and a real run share it.
    `distributed_optimizer`: ZeRO-1 (distopt.py); `padding` is what its flats add (0 without)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # fake parameters cannot be cast in place: made so
    try:
        grid = ParallelGrid(tp=lay.tp, pp=lay.pp, dp=lay.dp)
        stack = build_stack(cfg, grid, micro_batch_size=b, microbatches=k, seq_len=cfg.block_size,
                            distributed_optimizer=distributed_optimizer)  # fmt: skip
    finally:
        torch.set_default_dtype(default)
    x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size + 1), device=stack.params[0].device)
    with CommCounter() as comm:
        forward_backward(stack, [(x[:, :-1], x[:, 1:])] * k)
    with CommCounter() as dp_comm:
        sync_gradients(stack)
        stack.optimizer.step()  # Adam's m and v exist from here; ZeRO-1's all-gather is in it
    opt = stack.optimizer
    return dict(
        params=sum(p.numel() for p in stack.params),
        tp=comm.ring_bytes_on(grid.tp_group) / k if lay.tp > 1 else 0.0,
        pp=(comm.bytes["send"] + comm.bytes["recv"]) / k,
        dp=dp_comm.ring_bytes_per_rank(),
        state=sum(stack_state_bytes(stack).values()),
        padding=padding_of(opt),
    )


def row(name: str, gpus: int, which: str, lay: Layout, best: dict, k: int) -> dict:
    """One table row: planner.py's row `best` for `name` at `lay`, simulated beside its formulas."""
    return dict(model=name, gpus=gpus, which=which, **row_at(planner.MODELS[name], lay, best, k))


def row_at(cfg, lay: Layout, best: dict, k: int) -> dict:
    """The stack at `lay` simulated on its fullest stage (k micro-batches, 0: pp) beside
    planner.py's row `best` for it (its b, m and bytes) and this stack's own formulas."""
    cfg = tp_vocab(cfg, lay.tp)  # padded as Megatron pads where tp does not divide it
    stage = fullest_stage(cfg, lay)
    t0 = time.perf_counter()
    sim = simulate(cfg, lay, best["b"], k or lay.pp, stage)
    params = formulas.params_per_rank(cfg, lay, stage)
    d = lay.dp
    want = dict(
        params=params,
        tp=best["tp_gb"] * GB / best["m"],
        pp=best["pp_gb"] * GB / best["m"],
        dp=comm_bytes_per_rank(params, d, 0, BF16),  # this stack: all-reduce of bf16 gradients
        state=(2 + 2 + 4) * params,  # bf16 params, grads, Adam m and v (torch AdamW, no master)
    )
    return dict(
        layout=lay.name(),
        stage=stage,
        b=best["b"],
        m=best["m"],
        **{f"{key}_sim": sim[key] for key in want},
        **{f"{key}_formula": want[key] for key in want},
        megatron_dp=best["dp_gb"] * GB,
        megatron_state=best["states_gb"] * GB,
        seconds=time.perf_counter() - t0,
    )


def gap(r: dict, key: str) -> float:
    """|simulated - formula| / formula (0 where both are 0)."""
    want = r[f"{key}_formula"]
    return abs(r[f"{key}_sim"] - want) / want if want else float(r[f"{key}_sim"] != 0)


KEYS = ("params", "tp", "pp", "dp", "state")
