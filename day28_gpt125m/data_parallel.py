"""Day 28: torch's own data parallelism on the whole GPT, DDP (day 17) and FSDP2 (day 18).

    ddp     DistributedDataParallel: every rank holds the whole model, gradients all-reduced in
            buckets, AdamW's full state on every rank
    fsdp2   fully_shard per block, then the root: parameters, gradients and AdamW's state sharded
            over the ranks, each block all-gathered before use, gradients reduce-scattered

Both share one step (TorchData.step): the micro-batches accumulate with the gradient sync off
on all but the last, then the dense norm is clipped and AdamW updates. A subclass says how it
wraps the GPT (`wrap`) and how its gradients skip a sync (`sync_off`). Checkpoints: day 24's
Checkpointer (DCP: every rank writes its shards, an atomic commit, `latest`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from day19_tp.formulas import block_params
from day22_megatron import hsdp
from day24_checkpoint.ckpt import AppState, Checkpointer, Progress
from day28_gpt125m.recipe import AUTOCAST, autocast, make_adamw
from day28_gpt125m.strategy import Setup, Strategy, register
from dtl import profile as dtl_profile
from dtl.conversion import apply_conversion
from dtl.exercise_seam import exercise
from dtl.model import GPT, loss_fn, num_params
from dtl.optim import set_lr
from dtl.precision import PRECISIONS
from dtl.state import live_state_bytes


class TorchData(Strategy):
    """DDP or FSDP2 on the whole GPT: torch's own data parallelism."""

    support = AUTOCAST
    compile = True

    def __init__(self, s: Setup):
        self.r, self.device = s.recipe, s.device
        # its parameters: clipped, updated, gathered
        # the recipe's precision may change the linears (fp8: float8 matmuls), before any wrap
        self.gpt = apply_conversion(GPT(s.cfg, seed=s.seed), PRECISIONS[s.recipe.precision])
        self.gpt.to(s.device)
        self.gpt.set_recompute(s.recompute)  # before DDP or fully_shard wrap the blocks
        self.model = self.wrap(self.gpt, s.device)  # what forward runs
        self.optimizer = make_adamw(self.gpt, s.recipe)

    def wrap(self, gpt: GPT, device) -> torch.nn.Module:
        """`gpt` with its gradients synced over the ranks: the module forward runs."""
        raise NotImplementedError

    def sync_off(self) -> contextlib.AbstractContextManager:
        """A context whose forward and backward accumulate gradients without syncing them."""
        raise NotImplementedError

    @exercise("day28.strategy_step")
    def step(self, micro_batches, lr):
        # k micro-batches: loss_fn(self.model(x), y) / k each, under autocast(self.r, self.device);
        # gradients sync only in the last one (the others inside self.sync_off(): DDP decides in
        # forward). Then the global norm clipped at self.r.clip, the lr, the update -> total, norm
        # exercise day28.strategy_step: begin
        total, k = 0.0, len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            with self.sync_off() if i < k - 1 else contextlib.nullcontext():
                with dtl_profile.range(dtl_profile.FORWARD), autocast(self.r, self.device):
                    loss = loss_fn(self.model(x), y) / k
                with dtl_profile.range(dtl_profile.BACKWARD):
                    loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(self.gpt.parameters(), self.r.clip or float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor of the global norm
            norm = norm.full_tensor()
        set_lr(self.optimizer, lr)
        with dtl_profile.range(dtl_profile.OPTIMIZER):
            self.optimizer.step()
        # exercise day28.strategy_step: end
        if self.measure_state:
            # an FSDP2 parameter counts its local shard only: what is in this rank's memory;
            # AdamW's 4-byte step counters are no per-parameter state (the formula's 16 Ψ)
            self.last_state = live_state_bytes(
                self.gpt.parameters(), self.optimizer, counters=False
            )
        self.optimizer.zero_grad(set_to_none=True)
        return total, float(norm)

    def _app(self, step: int = 0) -> AppState:
        return AppState(self.model, self.optimizer, progress=Progress(step=step))

    def save(self, folder, step):
        # day 24: DCP, every rank writing its shards, an atomic commit, `latest`
        Checkpointer(folder, keep=2).save(self._app(step), step)

    def load(self, folder):
        return Checkpointer(folder, keep=2).load(self._app())

    def full_parameters(self):
        out = {}
        for name, p in self.gpt.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shards: gathered
            out[name] = t.detach().float().cpu().clone()
        return out


@register
class DDP(TorchData):
    name = "ddp"

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, ep=1, replicas=1, precision="fp32"):
        return 16 * num_params(m), 0.0  # 4 param + 4 grad + 8 Adam, on every rank (day 18)

    def wrap(self, gpt, device):
        self.ddp = DistributedDataParallel(
            gpt, device_ids=[device.index] if device.type == "cuda" else None
        )
        return self.ddp

    def sync_off(self):
        return self.ddp.no_sync()  # no all-reduce until the last micro-batch


@register
class FSDP2(TorchData):
    name = "fsdp2"
    suggested_when_short = True
    replicates = True  # --replicas=r: HSDP, sharded over world / r ranks, replicated r times

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, ep=1, replicas=1, precision="fp32"):
        shard = world // replicas  # the ranks each parameter is cut over
        return 16 * num_params(m) / shard, 4 * block_params(m, 1)  # + the largest block, full

    def __init__(self, s: Setup):
        self.replicas = s.replicas
        super().__init__(s)

    def wrap(self, gpt, device):
        # the run's device type, said: FSDP2's default mesh is torch's accelerator (CUDA on any
        # GPU machine), which under gloo would shard onto cuda:0 beside CPU batches. A
        # (replicate, shard) mesh (day 22's hsdp.py): at replicas 1, FSDP over every rank
        mesh = hsdp.hsdp_mesh(self.replicas, device.type)
        for block in gpt.blocks.values():  # bottom-up: each block its own all-gather unit
            fully_shard(block, mesh=mesh)
        return fully_shard(gpt, mesh=mesh)  # gpt itself, its parameters now this rank's shards

    @contextlib.contextmanager
    def sync_off(self):
        self.gpt.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.gpt.set_requires_gradient_sync(True)
