"""Day 24: checkpoints of model-parallel layouts that reshard: our TP, PP and TP x PP stack
(day 22's `build_stack`, on days 19 and 20) through DCP, with day 24's atomic commit.

DCP reshards what it can describe: a tensor every rank holds whole (replicated), or a DTensor,
whose placements say which piece of the full tensor a rank holds. Our TP shards are plain
tensors, so `StackState.state_dict` describes each one as a DTensor on the TP group's device
mesh, without copying (DTensor.from_local over the parameter's own memory):

    column-parallel weight / bias     Shard(0)    rows [r·n/t, (r+1)·n/t) of the full tensor
    row-parallel weight               Shard(1)    columns; its bias is whole on every TP rank
    vocab-parallel wte (and lm_head)  Shard(0)    rows of the vocabulary
    LayerNorms, wpe, row biases       a plain tensor (the same on every TP rank)

The fused QKV (`c_attn`, TP_PLAN's blocks = 3) is the one exception: a rank holds [Q_r; K_r;
V_r], which is not one contiguous block of rows of [Q; K; V]. It is saved as three tensors, its
name + ".q", ".k", ".v", each Shard(0): views of the parameter's three thirds.

Under PP each rank holds its stages' parameters under their one-process names (day 20's
stage_parameters), and under EP its experts (day 22's apply_ep keeps their names): DCP merges
the stages' and the experts' keys into one checkpoint, so an expert is a key of its own, saved
by a rank that holds it and loaded by every rank that will (ep 2 -> 1 in the tests). With tied
embeddings the last stage's copy of wte (its lm_head.weight) is not saved, and is loaded from
wte.weight.

AdamW's state follows its parameter: "optim.<name>.exp_avg" and ".exp_avg_sq" are described
like the parameter, ".step" is a plain scalar. A checkpoint written at one layout loads at any
other of the same model: tp 2 -> 1, pp 2 -> 1, tp 2 x dp 2 -> dp 4 (tests/test_day24_sharded.py,
bit for bit). What it does not reshard: the pipeline schedule's in-flight state (a checkpoint
is taken between steps, when there is none) and a vocabulary padded for another tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from day24_checkpoint.ckpt import Progress, RunState
from dtl.tp_plan import tp_shard_of

QKV = ("q", "k", "v")  # the fused c_attn's three blocks, saved apart


class StackState(RunState):
    """A day-22 stack's parameters, AdamW state, progress and RNG as one DCP-saveable object,
    every TP shard described as a DTensor; the same interface as ckpt.AppState (Checkpointer
    saves and loads either)."""

    def __init__(
        self,
        stack,
        progress: Progress | None = None,
        restore_rng: bool = True,
        scheduler=None,
    ):
        super().__init__(scheduler, progress, restore_rng)  # progress, scheduler, generators
        self.stack = stack
        grid = stack.grid
        self.mesh = (
            DeviceMesh.from_group(grid.tp_group, _device_type(stack)) if grid.tp_size > 1 else None
        )

    def state_dict(self) -> dict:
        model, optim = {}, {}
        tied = self.stack.gpt.cfg.tie_weights
        state = self.stack.optimizer.state
        for name, p in self.stack.named.items():
            key = _saved_name(name, tied)
            if key != name and "wte.weight" in self.stack.named:
                continue  # the tied head is wte itself: saved once, under wte.weight
            model.update(self._describe(key, name, p.data))
            for kind in ("exp_avg", "exp_avg_sq"):
                optim.update(self._describe(f"{key}.{kind}", name, _moment(state, p, kind)))
            optim[f"{key}.step"] = _step(state, p)
        # the groups' hyperparameters (lr as the schedule left it, betas, decay): one value each
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.stack.optimizer.param_groups
        ]
        return {"model": model, "optim": optim, "groups": groups, **self.run_state_dict()}

    def load_state_dict(self, state: dict) -> None:
        # DCP loaded every tensor in place, into the parameters' and moments' own memory;
        # what is left: the scalars, the progress and the generators
        tied = self.stack.gpt.cfg.tie_weights
        for name, p in self.stack.named.items():
            key = _saved_name(name, tied)
            self.stack.optimizer.state[p]["step"] = state["optim"][f"{key}.step"].clone()
        for group, saved in zip(self.stack.optimizer.param_groups, state["groups"]):
            group.update(saved)  # a scheduler sets lr only at its next step: this run's lr now
        self.load_run_state_dict(state)

    def _describe(self, key: str, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """{key: tensor} for this rank's piece of `name`: a DTensor where TP splits it."""
        module_name, _, kind = name.rpartition(".")
        shard = tp_shard_of(module_name)
        if shard is None or (shard.style == "row" and kind == "bias"):
            return {key: t}  # whole on every TP rank: a plain, replicated tensor
        dim = 1 if shard.style == "row" else 0
        if shard.blocks == 1:
            return {key: self._piece(t, dim)}
        # the fused QKV as three tensors at every tp (tp = 1 too: the keys must not depend on
        # the layout); views, so that DCP loads into the parameter's own memory
        parts = t.chunk(shard.blocks, dim)
        return {f"{key}.{b}": self._piece(part, dim) for b, part in zip(QKV, parts)}

    def _piece(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's piece: a DTensor sharded on `dim` over the TP group, or, without TP,
        the tensor itself (whole on every rank)."""
        if self.mesh is None:
            return local
        size = list(local.shape)
        size[dim] *= self.mesh.size()
        return DTensor.from_local(
            local,
            self.mesh,
            [Shard(dim)],
            run_check=False,
            shape=torch.Size(size),
            stride=_contiguous_stride(size),
        )


def full_state(app: StackState) -> dict[str, torch.Tensor]:
    """Every key of app's model and optimizer state as the full tensor, on every rank: TP
    pieces gathered (DTensor.full_tensor), the keys of other tensors gathered over the axes
    where ranks hold them (the stages' over pp, the experts' over ep: the reduction table's
    merge axes). What the tests compare across layouts. Collective."""
    sd = app.state_dict()
    mine = {}
    for section in ("model", "optim"):
        for key, t in sd[section].items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            mine[f"{section}.{key}"] = full.detach().cpu().clone()
    merge = app.stack.grid.group(*app.stack.reduction.merge_axes)
    pieces: list = [None] * dist.get_world_size(merge)
    dist.all_gather_object(pieces, mine, group=merge)
    return {k: v for piece in pieces for k, v in piece.items()}


def _saved_name(name: str, tied: bool) -> str:
    """The key a parameter is saved under: its one-process name, but a tied head's copy (the
    last pipeline stage's lm_head.weight) is wte.weight."""
    return "wte.weight" if tied and name == "lm_head.weight" else name


def _moment(state, p: torch.Tensor, kind: str) -> torch.Tensor:
    """AdamW's moment of p, created as zeros when the optimizer has not stepped yet (a fresh
    run about to load: DCP needs the tensor to load into)."""
    s = state[p]
    if kind not in s:
        s[kind] = torch.zeros_like(p)
    return s[kind]


def _step(state, p: torch.Tensor) -> torch.Tensor:
    s = state[p]
    if "step" not in s:
        s["step"] = torch.zeros((), dtype=torch.float32)  # host: AdamW keeps it on the CPU
    return s["step"]


def _contiguous_stride(size: list[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(size):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _device_type(stack) -> str:
    return stack.params[0].device.type
