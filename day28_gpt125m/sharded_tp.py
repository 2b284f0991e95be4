"""Day 28: FSDP2 on top of tensor parallelism, torchtitan's 2-D layout, as a strategy.

    fsdp2_tp   the course's TP layers over grid.tp_group (day 19: each rank a TP shard of every
               matrix, its own all-reduces in forward and backward), then fully_shard per block
               and on the root over the dp dimension of the grid's DeviceMesh (day 18's FSDP2):
               each TP shard's parameters, gradients and AdamW state sharded again over dp

The mesh is 2-D, (dp, tp), as torchtitan lays it out, TP inner (inside a node), FSDP outer. Two
things change from FSDP2 alone, both asked of dtl.reduction's table, never of a name: the loss
is day 19's vocab-parallel cross-entropy, and the gradient norm is summed from the shards on
every rank, each parameter counted where day 22's ZeRO-1 counts it (`distopt.counts_in_norm`:
its dp slice on every rank, a TP replica on tp rank 0), then all-reduced over the world.

Per rank, fp32: 16 P / dp bytes at rest (P = the TP shard's parameters, day 22's
params_per_rank), plus the largest block's TP shard gathered while it runs. Checkpoints: day
24's StackState over the TP shards gathered over dp (each dp group's copy the same: DCP writes
it once), loaded back and cut into this rank's dp shards; the keys are the stack's, so day 24
reshards them (a tp 2 x dp 2 checkpoint resumed at tp 1 x dp 4 continues the same losses: the
notes' run; the tests resume at the same layout). The TP layers are plain tensors, not
DTensors: FSDP2 shards each TP rank's local tensors over dp, a 1-D DTensor. sharded_tp_dtensor.py
builds the same mesh with torch's DTensor TP (parallelize_module), c_attn's rows reordered per
head so that DTensor's contiguous row split keeps whole heads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from day19_tp.formulas import block_params
from day19_tp.tp import apply_tp, full_tensors, tp_loss
from day22_megatron import formulas
from day22_megatron.distopt import counts_in_norm
from day22_megatron.layouts import Layout
from day24_checkpoint.ckpt import Checkpointer, Progress
from day24_checkpoint.sharded import StackState
from day28_gpt125m import sharded_tp_formulas as cost
from day28_gpt125m.recipe import make_adamw
from day28_gpt125m.strategy import Setup, Strategy, register
from dtl import profile as dtl_profile
from dtl.comm import CommCounter
from dtl.dist import clip_by_pieces
from dtl.grid import ParallelGrid
from dtl.model import GPT
from dtl.optim import set_lr
from dtl.reduction import gpt_reductions
from dtl.simulate import item, to_device
from dtl.state import live_state_bytes


@register
class FSDP2TP(Strategy):
    """FSDP2 over dp on the course's TP layers over tp: a (dp, tp) mesh."""

    name = "fsdp2_tp"
    model_parallel = True
    pipelines = False  # a (dp, tp) mesh: no pipeline here
    counts_sent = True  # tp, dp and the norm's bytes in the last step, beside its formulas
    no_recompute = "--recompute is not checked with fsdp2_tp here; use tp_pp or fsdp2"

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, ep=1, replicas=1, precision="fp32"):
        lay = Layout(tp=tp, dp=world // tp)
        tp_rank = sum(formulas.state_bytes(m, lay, 0).values())  # a TP rank's 16 bytes a param
        return tp_rank / lay.dp, formulas.FP32 * block_params(m, tp)  # + one block, gathered

    def __init__(self, s: Setup):
        self.r, self.grid = s.recipe, s.grid
        gpt = to_device(GPT(s.cfg, seed=s.seed), s.device)
        gpt.set_recompute(s.recompute)
        table = gpt_reductions(gpt, s.grid.axes)  # one-process names, before TP changes them
        apply_tp(gpt, s.grid)  # every rank: its TP shard of each matrix (day 19), plain tensors
        self.padded, self.root = cost.padded_counts(gpt, s.grid.dp_size)  # P', R' (formulas)
        self.predicted_sent = cost.comm_bytes(
            s.cfg, tp=s.grid.tp_size, dp=s.grid.dp_size, padded=self.padded, root=self.root,
            micro_batch_size=s.micro_batch, microbatches=s.accum, seq_len=s.seq_len,
        )  # fmt: skip
        dp_mesh = self.dp_mesh(s.grid, s.device.type)
        # the groups of the axes the formulas count in forward and backward: TP's all-reduces,
        # FSDP2's gathers and reduce-scatters (the mesh's first dimension). At tp 1 the dp group
        # is the world, the norm's group too: the norm is counted apart (step)
        self.axes = {"tp": s.grid.tp_group, "dp": dp_mesh.get_group(0)}
        for block in gpt.blocks.values():  # each block its own all-gather unit over dp
            fully_shard(block, mesh=dp_mesh)
        self.gpt = fully_shard(gpt, mesh=dp_mesh)  # the root: wte, wpe, ln_f (and the head)
        self.optimizer = make_adamw(self.gpt, s.recipe)
        # which parameters' shards enter the global norm on this rank (a TP replica: tp rank 0)
        self.counted = [
            p for n, p in self.gpt.named_parameters() if counts_in_norm(table[n], s.grid)
        ]

    @staticmethod
    def dp_mesh(grid: ParallelGrid, device_type: str) -> DeviceMesh:
        """What FSDP2 shards over: the dp dimension of the grid's (pp, dp, cp, tp) mesh."""
        return grid.device_mesh(device_type)["dp"]

    def step(self, micro_batches, lr: float) -> tuple[float | None, float]:
        total, k = 0.0, len(micro_batches)
        # the last step's bytes per axis are counted (kept out of the other steps)
        passes, clipping = self._counter(), self._counter()
        with passes:
            for i, (x, y) in enumerate(micro_batches):
                self.gpt.set_requires_gradient_sync(i == k - 1)  # reduce-scatter at the end
                with dtl_profile.range(dtl_profile.FORWARD):
                    loss = tp_loss(self.gpt, self.gpt(x), y) / k  # vocab-parallel cross-entropy
                with dtl_profile.range(dtl_profile.BACKWARD):
                    loss.backward()
                total += item(loss)
        with clipping:
            norm = clip_by_pieces(self.gpt.parameters(), self.counted, self.r.clip or None)
        if isinstance(passes, CommCounter) and isinstance(clipping, CommCounter):
            self.last_sent = {a: passes.ring_bytes_on(g) for a, g in self.axes.items()}
            self.last_sent["norm"] = clipping.ring_bytes_on(None)  # over the world
        set_lr(self.optimizer, lr)
        with dtl_profile.range(dtl_profile.OPTIMIZER):
            self.optimizer.step()  # AdamW on this rank's dp shard of its TP shard
        if self.measure_state:
            self.last_state = live_state_bytes(
                self.gpt.parameters(), self.optimizer, counters=False
            )
        self.optimizer.zero_grad(set_to_none=True)
        return total, norm

    def _counter(self) -> contextlib.AbstractContextManager:
        """A CommCounter in the step whose state and bytes are measured, else nothing."""
        return CommCounter() if self.measure_state else contextlib.nullcontext()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return full_tensors(self.gpt)  # gathered over dp, then joined over tp (day 19)

    def _app(self, step: int = 0) -> tuple[StackState, GatheredShards]:
        view = GatheredShards.of(self.gpt, self.optimizer, self.grid)
        return StackState(view, Progress(step=step)), view

    def save(self, folder: str, step: int) -> None:
        app, _ = self._app(step)
        Checkpointer(folder, keep=2).save(app, step)

    def load(self, folder: str) -> int:
        app, view = self._app()
        step = Checkpointer(folder, keep=2).load(app)
        view.scatter_back(self.gpt, self.optimizer)
        return step


@dataclass
class _Optimizer:
    """What StackState reads of an optimizer: the state of each (gathered) tensor, the groups."""

    state: dict
    param_groups: list


@dataclass
class _Model:
    cfg: object


@dataclass
class GatheredShards:
    """The stack-like view day 24's StackState saves: each parameter and AdamW moment gathered
    over dp into this TP rank's plain shard (a copy), under its one-process name."""

    grid: ParallelGrid
    gpt: _Model
    named: dict[str, torch.Tensor]
    optimizer: _Optimizer
    params: list = field(default_factory=list)

    @classmethod
    def of(
        cls, gpt: torch.nn.Module, optimizer: torch.optim.Optimizer, grid: ParallelGrid
    ) -> GatheredShards:
        named, state = {}, {}
        for name, p in gpt.named_parameters():
            full = p.detach().full_tensor().clone()  # (collective over dp)
            named[name] = full
            saved = optimizer.state.get(p, {})
            state[full] = {
                k: (v.full_tensor().clone() if isinstance(v, DTensor) else v.clone())
                for k, v in saved.items()
            }
        groups = optimizer.param_groups
        return cls(grid, _Model(gpt.cfg), named, _Optimizer(state, groups), list(named.values()))

    def scatter_back(self, gpt: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After a load: each gathered tensor cut into this rank's dp shard, into the FSDP2
        parameter and its AdamW state (created here for a fresh optimizer)."""
        # where AdamW keeps its step counters: on the parameters' device when fused or
        # capturable (a GPU run's fused AdamW), else on the host (not run on a GPU)
        on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                full = self.named[name]
                p.to_local().copy_(_shard_like(full, p).to_local())
                saved = self.optimizer.state[full]
                step_device = p.device if on_device else torch.device("cpu")
                optimizer.state[p] = {  # the moments shaped as p, sharded as p; the step whole
                    k: (_shard_like(v, p) if v.shape == full.shape else v.to(step_device).clone())
                    for k, v in saved.items()
                }


def _shard_like(full: torch.Tensor, like: DTensor) -> DTensor:
    """`full` sharded as `like` is (FSDP2's Shard(0) over dp)."""
    return distribute_tensor(full, like.device_mesh, like.placements)
