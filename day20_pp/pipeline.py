"""Day 20: one pipeline runtime that executes any schedule's action list on real GPT stages.

    plan = schedules.make("1f1b", p, m)                 # the action lists and their placement
    stages = build_stages(cfg, grid, plan.placement)    # this rank's stages, cut by it
    runner = PipelineRunner(stages, grid, cfg, micro_batch_shape, placement=plan.placement)
    loss, record = runner.step(plan[grid.pp_rank], micro_batches)  # grads in the stages

Stage s of S = p·v holds blocks [s·L/S, (s+1)·L/S) of the shared GPT (dtl.model: a stage is the
GPT with the other blocks deleted and wte/wpe or ln_f/lm_head set to None, `keep_stage`); which
rank holds it, as which chunk, is the schedule's placement (placement.py): the loop puts stage s
on rank s % p, a V puts the first and the last stage on rank 0. Stage 0 embeds the tokens,
stage S-1 computes the loss.

Per action, on this rank:
    F(mb, c)  input: the tokens (stage 0) or recv (B_mb, T, C) from the previous stage's rank;
              run the stage; send the output to the next stage's rank, or (last stage) keep
              loss / m for the backward
    B(mb, c)  recv dL/d(output) from the next stage's rank (or start from the loss); backward;
              send dL/d(input) to the previous stage's rank
    I, W      B split: I computes only dL/d(input) (torch.autograd.grad, graph kept) and sends
              it; W then computes the weight gradients (torch.autograd.backward(inputs=weights))
Sends are isend (waited at the end of the step); a receive waits until its data is there, so a
valid schedule (checked by schedules.simulate) cannot deadlock on gloo. NCCL adds a rule: it
queues every p2p operation between two ranks of a group on one stream, in posting order, and a
large send waits there until the peer's matching receive runs, holding up everything behind it.
So messages travel on four process groups of the same ranks, one per direction and kind
("lanes": activations toward a higher pipeline rank, gradients toward it, and the same toward a
lower one, p2p.p2p_lane): each stream carries one-way traffic of one kind, in the same order on
both ends (p2p.message_orders), and p2p.play_p2p replays every schedule's posts under those
rules. Two stages on one rank (a V's turn) exchange their tensor in memory: no post, no process
group. Fewer lanes would not do: by kind alone, interleaved at pp = 2 sends activations both
ways between the same two ranks, and each rank's receive would sit behind its own send, which
waits for that receive on the other rank (a hang once messages outgrow NCCL's buffers); by
direction alone, a V sends one chunk's activations and the other's gradients up the same lane
in an order its neighbour does not wait for them in. NCCL ignores tags; gloo matches by
tag: (micro-batch, receiving stage, direction). Every buffer's shape comes from the config: no
handshake. On a GPU each action's span ends when its kernels have run (the host synchronizes),
so the timeline's spans and idle time are the device's, not the launches'.
After the last action, the tied embedding's two copies (wte on the first stage, lm_head on the
last) get their gradients summed, as Megatron does: over a group of the two ranks holding those
stages (Placement.tied_ranks), or in place when one rank holds both.
Named ranges (dtl.profile.range): each action is one (`F3`, `B3`, `I3`, `W3`; `F3.1` on chunk
1: the schedule's names), and inside it `recv F3` / `send F3` for its messages, so a CPU trace
and an Nsight Systems report show the schedule by name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from day20_pp import schedules
from day20_pp.in_flight import LiveActivations, StepRecord
from day20_pp.p2p import LANES, p2p_lane
from day20_pp.placement import Placement
from day20_pp.schedules import Action
from dtl import profile as dtl_profile
from dtl import simulate
from dtl.exercise_seam import exercise
from dtl.grid import ParallelGrid
from dtl.model import GPT, GPTConfig, loss_fn

T = TypeVar("T")  # what _for_every_pipeline makes per pipeline
# the range around one runner step: day 27 reads a trace's idle inside it by the runtime's rule
SCHEDULE_RANGE = "schedule"


class PipelineError(ValueError):
    """Sizes the pipeline cannot take; a one-line message."""


def check_pipeline(cfg: GPTConfig, p: int, v: int = 1) -> None:
    if v > 1 and p < 2:
        raise PipelineError(f"{v} model chunks need pp >= 2 (on one rank they are one stage)")
    if cfg.n_layer < p * v:
        raise PipelineError(f"{p * v} stages (pp {p} x chunks {v}) but only {cfg.n_layer} layers")
    if cfg.n_layer % (p * v):
        raise PipelineError(f"n_layer {cfg.n_layer} is not divisible by pp {p} x chunks {v}")


def keep_stage(gpt: GPT, stage: int, n_stages: int) -> GPT:
    """Cut `gpt` (a fresh model or a copy: it is changed in place) down to stage `stage` of
    `n_stages`: its blocks only; embeddings on the first, head on the last. Parameters keep their
    one-process names (blocks.5.mlp.c_fc.weight), values and init."""
    per = gpt.cfg.n_layer // n_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in [k for k in gpt.blocks if k not in keep]:
        del gpt.blocks[name]
    if stage > 0:
        gpt.wte = gpt.wpe = None
    if stage < n_stages - 1:
        gpt.ln_f = gpt.lm_head = None  # a tied lm_head on the last stage keeps wte's values
    return gpt


def build_stages(
    cfg: GPTConfig, grid: ParallelGrid, placement: Placement, seed: int = 0
) -> list[GPT]:
    """This rank's stages, chunk by chunk, as the schedule's placement puts them."""
    if placement.p != grid.pp_size:
        raise PipelineError(f"a placement over {placement.p} ranks on pp {grid.pp_size}")
    check_pipeline(cfg, placement.p, placement.v)
    return [
        keep_stage(GPT(cfg, seed=seed), placement.stage(grid.pp_rank, c), placement.n_stages)
        for c in range(placement.v)
    ]


class PipelineRunner:
    def __init__(
        self,
        stages: list[GPT],
        grid: ParallelGrid,
        cfg: GPTConfig,
        micro_shape: tuple[int, int],
        loss=loss_fn,
        *,
        placement: Placement,
    ):
        self.stages, self.grid, self.cfg, self.loss_fn = stages, grid, cfg, loss
        self.p, self.r, self.v = grid.pp_size, grid.pp_rank, len(stages)
        if (placement.p, placement.v) != (self.p, self.v):
            raise PipelineError(
                f"placement of {placement.v} stage(s) on {placement.p} ranks; this rank has "
                f"{self.v} on pp {self.p}"
            )
        self.placement = placement  # where the stages live: the schedule's
        self.n_stages = placement.n_stages
        self.micro_shape = micro_shape  # (B_mb, T) of every micro-batch
        first = next(p for s in stages for p in s.parameters())
        self.device, self.dtype = first.device, first.dtype  # recv buffers: as the stages
        self.pp_ranks = grid.ranks_along("pp")  # global ranks of my pipeline, by stage index
        self.lane_groups = _lane_groups(grid)  # p2p.LANES: one group per direction and kind
        self.tied_group = _tied_group(grid, placement) if cfg.tie_weights else None
        self.handed: dict[int, torch.Tensor] = {}  # tag -> a tensor between two of my stages
        self._name = ""  # the running action's name (F3, B3.1): its messages' ranges say it

    # --- where things live --------------------------------------------------------------------

    def _stage(self, chunk: int) -> int:
        return self.placement.stage(self.r, chunk)

    def _rank_of(self, stage: int) -> int:
        return self.pp_ranks[self.placement.rank(stage)]

    def _lane(self, src_stage: int, dst_stage: int):
        """The process group of a message between two stages' ranks (by their pipeline index):
        an activation goes to the next stage, a gradient to the previous one."""
        rank, kind = self.placement.rank, "act" if dst_stage > src_stage else "grad"
        return self.lane_groups[p2p_lane(rank(src_stage), rank(dst_stage), kind)]

    def _tag(self, mb: int, stage: int, backward: bool) -> int:
        return (mb * self.n_stages + stage) * 2 + int(backward)

    def _hidden(self) -> torch.Tensor:
        b, t = self.micro_shape
        return torch.empty(b, t, self.cfg.n_embd, device=self.device, dtype=self.dtype)

    # --- one step -----------------------------------------------------------------------------

    def step(self, actions: list[Action], micro_batches: list[tuple[torch.Tensor, torch.Tensor]]):
        """Run this rank's actions for one optimizer step; returns the summed loss / m on the
        last stage (None elsewhere) and the StepRecord. Gradients accumulate in the stages."""
        self.m = len(micro_batches)
        self.batches = micro_batches
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # (mb, chunk) -> stage input
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # (mb, chunk) -> output / loss
        self.out_grads: dict[tuple[int, int], torch.Tensor | None] = {}
        self.sends: list = []
        self.loss = 0.0
        rec = StepRecord()
        with dtl_profile.range(SCHEDULE_RANGE):  # the step as its caller times it
            self._run(actions, rec)
            with dtl_profile.range(dtl_profile.comm_name("send", wait=True)):
                for work in self.sends:  # every isend must complete before its buffer is reused
                    work.wait()
            self._sum_tied_embedding_grads()
            _done(self.device)  # the step's host time includes its GPU work (callers time it)
        last = self._stage(self.v - 1) == self.n_stages - 1
        return (self.loss if last else None), rec

    def _run(self, actions: list[Action], rec: StepRecord) -> None:
        """The actions in order, each in its named range; its span and the in-flight count."""
        live = LiveActivations(p for s in self.stages for p in s.parameters())
        with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
            for a in actions:
                self._t_ready = None  # set when the action's input has arrived (after its recv)
                t0 = time.perf_counter()
                live.key = (a.mb, a.chunk)
                self._name = str(a)  # F3, B3.1: the action's range, and its messages' names
                with dtl_profile.range(self._name):
                    getattr(self, f"_{a.kind}")(a.mb, a.chunk)
                # the span is the work, not the wait for the neighbour: that wait is the bubble
                rec.spans.append((self._t_ready or t0, _done(self.device), a))
                rec.peak_in_flight = max(rec.peak_in_flight, live.in_flight())

    def _recv(self, src_stage: int, dst_stage: int, mb: int) -> torch.Tensor:
        """A (B_mb, T, C) tensor from src_stage's rank to this rank's dst_stage: an activation
        (src = dst - 1) or a gradient (src = dst + 1). Blocks until it has arrived; from a stage
        of this rank it is already here (handed over by _send)."""
        backward = src_stage > dst_stage
        if self.placement.rank(src_stage) == self.r:
            self._t_ready = time.perf_counter()
            return self.handed.pop(self._tag(mb, dst_stage, backward))
        buf = self._hidden()
        with dtl_profile.range(f"recv {self._name}"):
            dist.irecv(
                buf,
                src=self._rank_of(src_stage),
                group=self._lane(src_stage, dst_stage),
                tag=self._tag(mb, dst_stage, backward),
            ).wait()
        self._t_ready = _done(buf.device)  # the action's span starts once its input is here
        return buf

    def _send(self, t: torch.Tensor, src_stage: int, dst_stage: int, mb: int) -> None:
        """Post `t` from this rank's src_stage to dst_stage's rank (isend: waited at step end),
        or hand it over in memory when this rank holds dst_stage too (a V's turn)."""
        if self.placement.rank(dst_stage) == self.r:
            self.handed[self._tag(mb, dst_stage, dst_stage < src_stage)] = t.detach().clone()
            return
        with dtl_profile.range(f"send {self._name}"):
            self.sends.append(
                dist.isend(
                    t.contiguous(),
                    dst=self._rank_of(dst_stage),
                    group=self._lane(src_stage, dst_stage),
                    tag=self._tag(mb, dst_stage, dst_stage < src_stage),
                )
            )

    @exercise("day20.forward_step")
    def _F(self, mb: int, chunk: int) -> None:
        """Forward micro-batch `mb` through this rank's chunk `chunk` (stage self._stage(chunk)).
        Stage 0 reads the tokens self.batches[mb][0]; every other stage receives the previous
        stage's output (self._recv). The last stage turns its logits into this micro-batch's
        share of the step's loss, the mean over the self.m micro-batches (targets:
        self.batches[mb][1]; self.loss sums the shares, read by simulate.item); every other stage
        sends its output on (self._send). Left for B, I and W under (mb, chunk): self.inputs, the
        stage's input, whose .grad B sends back; self.outputs, what the backward starts from."""
        stage, model = self._stage(chunk), self.stages[chunk]
        # exercise day20.forward_step: begin
        if stage == 0:
            x = self.batches[mb][0]
        else:  # (B_mb, T, C) activations from the previous stage, a leaf that collects dL/dx
            x = self._recv(stage - 1, stage, mb)
            x.requires_grad_()
        out = model(x)
        self.inputs[(mb, chunk)] = x
        if stage == self.n_stages - 1:
            out = self.loss_fn(out, self.batches[mb][1]) / self.m  # mean over micro-batches
            self.loss += simulate.item(out)  # (nan under dtl.simulate: no values there)
        else:  # detached: the graph stays on this rank, B sends dL/d(output) back
            self._send(out.detach(), stage, stage + 1, mb)
        self.outputs[(mb, chunk)] = out
        # exercise day20.forward_step: end

    def _grad_of_output(self, mb: int, chunk: int) -> torch.Tensor | None:
        stage = self._stage(chunk)
        if stage == self.n_stages - 1:
            return None  # the loss: backward starts here
        return self._recv(stage + 1, stage, mb)

    def _send_input_grad(self, mb: int, chunk: int, grad: torch.Tensor | None) -> None:
        stage = self._stage(chunk)
        if stage > 0:
            self._send(grad, stage, stage - 1, mb)

    def _B(self, mb: int, chunk: int) -> None:
        out, x = self.outputs.pop((mb, chunk)), self.inputs.pop((mb, chunk))
        out.backward(self._grad_of_output(mb, chunk))  # weights' grads accumulate; x.grad too
        self._send_input_grad(mb, chunk, x.grad if x.requires_grad else None)

    def _I(self, mb: int, chunk: int) -> None:
        out, x = self.outputs[(mb, chunk)], self.inputs[(mb, chunk)]
        g = self._grad_of_output(mb, chunk)
        self.out_grads[(mb, chunk)] = g
        if x.requires_grad:  # dL/d(input) only; the graph is kept for W
            (dx,) = torch.autograd.grad(out, x, g, retain_graph=True)
            self._send_input_grad(mb, chunk, dx)

    def _W(self, mb: int, chunk: int) -> None:
        out, _ = self.outputs.pop((mb, chunk)), self.inputs.pop((mb, chunk))
        weights = [p for p in self.stages[chunk].parameters() if p.requires_grad]
        # the weight gradients: a second walk of the kept graph, accumulating into .grad only
        torch.autograd.backward(out, self.out_grads.pop((mb, chunk)), inputs=weights)

    def _sum_tied_embedding_grads(self) -> None:
        """wte (first stage) and lm_head (last stage) are one weight in the model: sum their
        gradients so both copies take the same step. The placement says who holds them: one
        stage holding both (p = 1) has one tensor; two stages of this rank (a V) are summed in
        place; two ranks all-reduce over their group (self.tied_group)."""
        if not self.cfg.tie_weights or self.n_stages == 1:
            return
        chunks = {0: "wte", self.n_stages - 1: "lm_head"}  # stage -> the copy it holds
        mine = [
            getattr(self.stages[self.placement.chunk(s)], name).weight
            for s, name in chunks.items()
            if self.placement.rank(s) == self.r
        ]
        if len(mine) == 2:  # both copies on this rank: one sum, no message
            total = mine[0].grad + mine[1].grad
            for w in mine:
                w.grad.copy_(total)
        elif mine:
            with dtl_profile.range(dtl_profile.comm_name("all_reduce", "tied embedding")):
                dist.all_reduce(mine[0].grad, group=self.tied_group)


class Pipeline:
    """What apply_pp returns: this rank's stages, its action list and the runner."""

    def __init__(
        self,
        stages,
        grid: ParallelGrid,
        cfg: GPTConfig,
        plan: schedules.Schedule,
        micro_shape: tuple[int, int],
        loss=loss_fn,
    ):
        self.stages, self.grid = stages, grid
        self.actions = plan[grid.pp_rank]  # this rank's list
        self.runner = PipelineRunner(stages, grid, cfg, micro_shape, loss, placement=plan.placement)

    def parameters(self):
        return unique_parameters(self.stages)

    def step(self, micro_batches):
        """Forward and backward of every micro-batch by the schedule; grads in the stages."""
        return self.runner.step(self.actions, micro_batches)


def apply_pp(
    model: GPT,
    grid: ParallelGrid,
    schedule: str,
    microbatches: int,
    micro_shape: tuple[int, int],
    chunks: int = 1,
    loss=loss_fn,
) -> Pipeline:
    """Split `model` (the one-process GPT, or one already changed by apply_tp: pass its loss,
    e.g. lambda logits, y: tp_loss(model, logits, y)) into this rank's `chunks` stages of
    grid.pp_size x chunks, by deep copies with the other blocks deleted (process groups the
    modules hold are shared, not copied); returns the Pipeline that runs `schedule`. The model
    itself is left untouched. `micro_shape` = (B_mb, T): the shape of every micro-batch."""
    import copy

    cfg, p = model.cfg, grid.pp_size
    check_pipeline(cfg, p, chunks)
    plan = schedules.make(schedule, p, microbatches, chunks)  # first: it places the stages
    place = plan.placement
    shared = {id(g): g for m in model.modules() for g in [getattr(m, "group", None)] if g}
    if hasattr(model, "tp"):
        shared[id(model.tp)] = model.tp  # TPInfo: holds a process group, not tensors
    stages = [
        keep_stage(copy.deepcopy(model, dict(shared)), place.stage(grid.pp_rank, c), place.n_stages)
        for c in range(place.v)
    ]
    return Pipeline(stages, grid, cfg, plan, micro_shape, loss)


def _done(device: torch.device) -> float:
    """The host time the work queued so far on `device` is done: a received buffer usable, an
    action's kernels run. On NCCL, wait() only orders the GPU stream and kernels run after the
    host queued them: synchronize, so the timeline's spans and idle time are real (not run on a
    GPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


def _tied_group(grid: ParallelGrid, placement: Placement):
    """The process group of the ranks holding the tied embedding's two copies (the placement's
    first and last stage), or None where one rank holds both. A new group is collective: every
    rank creates it for every pipeline, in the same order."""
    ends = placement.tied_ranks()
    if len(ends) == 1:
        return None
    if ends == (0, grid.pp_size - 1):  # the pipeline's two ends: the group the grid built
        return grid.embedding_group
    return _for_every_pipeline(grid, lambda ranks: dist.new_group([ranks[e] for e in ends]))


def _lane_groups(grid: ParallelGrid) -> dict:
    """One process group over this rank's pipeline per lane (p2p.LANES: direction and kind).
    Creating a group is collective, so every rank creates the four for every pipeline, in the
    same order."""
    return _for_every_pipeline(grid, lambda ranks: {ln: dist.new_group(ranks) for ln in LANES})


def _for_every_pipeline(grid: ParallelGrid, make: Callable[[list[int]], T]) -> T:
    """`make(ranks)` for every pipeline of the grid, in the same order on every rank (making a
    process group is collective: every rank takes part in each); this rank's pipeline's."""
    mine = None
    for ranks in grid.group_ranks("pp"):
        made = make(ranks)
        if grid.rank in ranks:
            mine = made
    assert mine is not None, "every rank is on one pipeline"
    return mine


def unique_parameters(stages: list[GPT]) -> list[nn.Parameter]:
    """Each parameter once (one stage holding wte and its tied lm_head has them as one)."""
    return list({id(p): p for p in stage_parameters(stages).values()}.values())


def stage_parameters(stages: list[GPT]) -> dict[str, nn.Parameter]:
    """name -> parameter over this rank's chunks, by one-process name (lm_head on the last
    stage included: with tied weights it is a copy of wte)."""
    out = {}
    for s in stages:
        for name, p in s.named_parameters(remove_duplicate=False):
            out[name] = p
    return out
