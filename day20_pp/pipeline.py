"""Day 20: one pipeline runtime that executes any schedule's action list on real GPT stages.

    stages = build_stages(cfg, grid, v)                 # this rank's v model chunks
    runner = PipelineRunner(stages, grid, cfg, micro_batch_shape)
    loss, record = runner.step(schedule[grid.pp_rank], micro_batches)  # grads in the stages

Stage s of S = p·v holds blocks [s·L/S, (s+1)·L/S) of the shared GPT (dtl.model: a stage is the
GPT with the other blocks deleted and wte/wpe or ln_f/lm_head set to None); stage s lives on
rank s % p as its chunk s // p. Stage 0 embeds the tokens, stage S-1 computes the loss.

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
So messages travel on two process groups of the same ranks, one per direction ("lanes":
toward a higher pipeline rank, toward a lower one, schedules.p2p_lane): each stream carries
one-way traffic, in the same order on both ends (schedules.message_orders), and
schedules.play_p2p replays every schedule's posts under those rules. One group per
message kind would not do: interleaved at pp = 2 sends activations both ways between the same two
ranks, and each rank's receive would sit behind its own send, which waits for that receive on
the other rank (a hang once messages outgrow NCCL's buffers). NCCL ignores tags; gloo matches by
tag: (micro-batch, receiving stage, direction). Every buffer's shape comes from the config: no
handshake. On a GPU each action's span ends when its kernels have run (the host synchronizes),
so the timeline's spans and idle time are the device's, not the launches'.
After the last action, the tied embedding's two copies (wte on the first stage, lm_head on the
last) get their gradients summed over the embedding group, as Megatron does.
Named ranges (dtl.profile.range): each action is one (`F3`, `B3`, `I3`, `W3`; `F3.1` on chunk
1: the schedule's names), and inside it `recv F3` / `send F3` for its messages, so a CPU trace
and an Nsight Systems report show the schedule by name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from day20_pp.schedules import Action, Placement, p2p_lane
from dtl import profile as dtl_profile
from dtl import simulate
from dtl.exercise_seam import exercise
from dtl.grid import ParallelGrid
from dtl.model import GPT, GPTConfig, loss_fn
from dtl.state import storage_key


class PipelineError(ValueError):
    """Sizes the pipeline cannot take; a one-line message."""


def check_pipeline(cfg: GPTConfig, p: int, v: int = 1) -> None:
    if v > 1 and p < 2:
        raise PipelineError(f"{v} model chunks need pp >= 2 (one rank would send to itself)")
    if cfg.n_layer < p * v:
        raise PipelineError(f"{p * v} stages (pp {p} x chunks {v}) but only {cfg.n_layer} layers")
    if cfg.n_layer % (p * v):
        raise PipelineError(f"n_layer {cfg.n_layer} is not divisible by pp {p} x chunks {v}")


def build_stage(cfg: GPTConfig, stage: int, n_stages: int, seed: int) -> GPT:
    """The GPT with only stage `stage`'s blocks; embeddings on the first, head on the last.
    Parameters keep their one-process names (blocks.5.mlp.c_fc.weight), values and init."""
    gpt = GPT(cfg, seed=seed)
    per = cfg.n_layer // n_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in [k for k in gpt.blocks if k not in keep]:
        del gpt.blocks[name]
    if stage > 0:
        gpt.wte = gpt.wpe = None
    if stage < n_stages - 1:
        gpt.ln_f = gpt.lm_head = None  # a tied lm_head on the last stage keeps wte's values
    return gpt


def build_stages(cfg: GPTConfig, grid: ParallelGrid, v: int, seed: int = 0) -> list[GPT]:
    place = Placement(grid.pp_size, v)
    check_pipeline(cfg, place.p, v)
    return [build_stage(cfg, place.stage(grid.pp_rank, c), place.n_stages, seed) for c in range(v)]


@dataclass
class StepRecord:
    """What one step did on this rank: the actions' host times and the in-flight high-water:
    the most micro-batches whose activations autograd held at once, counted from the tensors
    alive (LiveActivations), not from the action list."""

    spans: list[tuple[float, float, Action]] = field(default_factory=list)
    peak_in_flight: int = 0


class LiveActivations:
    """Which (micro-batch, chunk) pairs have activations alive right now. Every tensor autograd
    saves for backward during a forward passes through `pack` (torch's saved_tensors_hooks) and
    is wrapped in a _Held tagged with the action running; the wrapper dies when autograd frees
    its graph (after B, or after W for zero-bubble's kept graph), and its count with it. A
    runtime that kept a graph longer than its schedule says shows here; parameters are skipped
    (autograd saves the weights too, and they are alive all the time)."""

    def __init__(self, params):
        self.params = {storage_key(p) for p in params}
        self.count: dict[tuple[int, int], int] = {}
        self.key: tuple[int, int] | None = None  # the action running: (mb, chunk)

    def pack(self, t: torch.Tensor):
        if self.key is None or storage_key(t) in self.params:
            return t
        return _Held(t, self)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def in_flight(self) -> int:
        return sum(1 for n in self.count.values() if n > 0)


class _Held:
    __slots__ = ("tensor", "live", "key")

    def __init__(self, tensor: torch.Tensor, live: LiveActivations):
        self.tensor, self.live, self.key = tensor, live, live.key
        live.count[self.key] = live.count.get(self.key, 0) + 1

    def __del__(self):
        self.live.count[self.key] -= 1


class PipelineRunner:
    def __init__(
        self,
        stages: list[GPT],
        grid: ParallelGrid,
        cfg: GPTConfig,
        micro_shape: tuple[int, int],
        loss=loss_fn,
        placement: Placement | None = None,
    ):
        self.stages, self.grid, self.cfg, self.loss_fn = stages, grid, cfg, loss
        self.p, self.r, self.v = grid.pp_size, grid.pp_rank, len(stages)
        # where the stages live: the schedule's placement (the loop over ranks by default)
        self.placement = placement or Placement(self.p, self.v)
        self.n_stages = self.placement.n_stages
        self.micro_shape = micro_shape  # (B_mb, T) of every micro-batch
        first = next(p for s in stages for p in s.parameters())
        self.device, self.dtype = first.device, first.dtype  # recv buffers: as the stages
        self.pp_ranks = grid.ranks_along("pp")  # global ranks of my pipeline, by stage index
        self.lane_groups = _lane_groups(grid)  # "up" / "down": one process group per direction
        self._name = ""  # the running action's name (F3, B3.1): its messages' ranges say it

    # --- where things live --------------------------------------------------------------------

    def _stage(self, chunk: int) -> int:
        return self.placement.stage(self.r, chunk)

    def _rank_of(self, stage: int) -> int:
        return self.pp_ranks[self.placement.rank(stage)]

    def _lane(self, src_stage: int, dst_stage: int):
        """The process group of a message between two stages' ranks (by their pipeline index)."""
        rank = self.placement.rank
        return self.lane_groups[p2p_lane(rank(src_stage), rank(dst_stage))]

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
        with dtl_profile.range(dtl_profile.comm_name("send", wait=True)):
            for work in self.sends:  # every isend must complete before its buffer is reused
                work.wait()
        self._sum_tied_embedding_grads()
        _done(self.device)  # the step's host time includes its GPU work (callers time it)
        last = self._stage(self.v - 1) == self.n_stages - 1
        return (self.loss if last else None), rec

    def _recv(self, src_stage: int, dst_stage: int, mb: int) -> torch.Tensor:
        """A (B_mb, T, C) tensor from src_stage's rank to this rank's dst_stage: an activation
        (src = dst - 1) or a gradient (src = dst + 1). Blocks until it has arrived."""
        buf, backward = self._hidden(), src_stage > dst_stage
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
        """Post `t` from this rank's src_stage to dst_stage's rank (isend: waited at step end)."""
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
        gradients over the embedding group so both copies take the same step."""
        if self.p == 1 or not self.cfg.tie_weights:
            return
        first, last = self.stages[0], self.stages[-1]
        weight = None
        if self._stage(0) == 0:
            weight = first.wte.weight
        elif self._stage(self.v - 1) == self.n_stages - 1:
            weight = last.lm_head.weight
        if weight is not None:
            with dtl_profile.range(dtl_profile.comm_name("all_reduce", "tied embedding")):
                dist.all_reduce(weight.grad, group=self.grid.embedding_group)


class Pipeline:
    """What apply_pp returns: this rank's stages, its action list and the runner."""

    def __init__(
        self,
        stages,
        grid: ParallelGrid,
        cfg: GPTConfig,
        schedule: str,
        microbatches: int,
        micro_shape: tuple[int, int],
        loss=loss_fn,
    ):
        from day20_pp import schedules

        self.stages, self.grid = stages, grid
        plan = schedules.make(schedule, grid.pp_size, microbatches, len(stages))
        self.actions = plan[grid.pp_rank]  # this rank's list
        self.runner = PipelineRunner(stages, grid, cfg, micro_shape, loss, plan.placement)

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
    place = Placement(p, chunks)
    n_stages, per = place.n_stages, cfg.n_layer // place.n_stages
    stages = []
    for c in range(chunks):
        s = place.stage(grid.pp_rank, c)
        shared = {id(g): g for m in model.modules() for g in [getattr(m, "group", None)] if g}
        if hasattr(model, "tp"):
            shared[id(model.tp)] = model.tp  # TPInfo: holds a process group, not tensors
        stage = copy.deepcopy(model, shared)
        keep = {str(i) for i in range(s * per, (s + 1) * per)}
        for name in [k for k in stage.blocks if k not in keep]:
            del stage.blocks[name]
        if s > 0:
            stage.wte = stage.wpe = None
        if s < n_stages - 1:
            stage.ln_f = stage.lm_head = None
        stages.append(stage)
    return Pipeline(stages, grid, cfg, schedule, microbatches, micro_shape, loss)


def _done(device: torch.device) -> float:
    """The host time the work queued so far on `device` is done: a received buffer usable, an
    action's kernels run. On NCCL, wait() only orders the GPU stream and kernels run after the
    host queued them: synchronize, so the timeline's spans and idle time are real (not run on a
    GPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


def _lane_groups(grid: ParallelGrid) -> dict:
    """Two process groups over this rank's pipeline: messages toward a higher pipeline rank
    ("up") and toward a lower one ("down"). Creating a group is collective, so every rank
    creates the pair for every pipeline, in the same order."""
    mine = None
    for ranks in grid.group_ranks("pp"):
        pair = {"up": dist.new_group(ranks), "down": dist.new_group(ranks)}
        if grid.rank in ranks:
            mine = pair
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
