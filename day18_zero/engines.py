"""Day 18: one interface over the three ways to train with ZeRO here: by hand, torch, DeepSpeed.

    trainer = build("hand", stage=2, gpt=gpt, group=None, opt=OptimConfig(lr=1e-3))
    loss = trainer.step([(x0, y0), (x1, y1)])   # zero grads, micro-steps, optimizer step
    trainer.state_bytes()                       # dtl.state.StateBytes: this rank, now
    trainer.full_parameters()                   # name -> full tensor (collective)

impl × stage:
    hand       0: day 17's BucketDDP + AdamW   1/2/3: zero.ZeroModel
    torch      0: DDP   1: DDP + ZeroRedundancyOptimizer   2: FSDP2 fully_shard with
               reshard_after_forward=False (SHARD_GRAD_OP)   3: FSDP2 fully_shard
    deepspeed  0/1/2/3: deepspeed.initialize with ds_config_zero<stage>.json (ds_engine.py)

The interface they share, Trainer, is trainer.py.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch.distributed as dist
import torch.nn as nn

from day18_zero.ds_engine import DeepSpeedZero
from day18_zero.trainer import Trainer
from dtl.optim import OptimConfig
from dtl.precision import ANY_DEVICE, declare
from dtl.state import StateBytes, live_state_bytes, nbytes

IMPLS = ("hand", "torch", "deepspeed")

# The precisions each engine trains in. The hand ZeRO stages keep fp32 masters of their slices and
# have no loss scaler; DDP, ZeroRedundancyOptimizer and plain FSDP2 step the parameters in the
# dtype they hold, so they train fp32 here. DeepSpeed's declaration is the kit's (dtl.deepspeed).
HAND_ZERO = declare(
    "hand ZeRO (stages 1-3)",
    {"fp32": ANY_DEVICE, "bf16": ANY_DEVICE},
    why=(
        "fp16 needs a loss scaler, which the hand engine lacks (use impl=deepspeed on a GPU); "
        "fp8 needs a conversion of the linears, which it does not apply"
    ),
)
NO_MASTER = declare(
    "day 17's DDP, torch DDP, ZeroRedundancyOptimizer, FSDP2",
    {"fp32": ANY_DEVICE},
    why="they keep no fp32 master copy; use impl=hand stages 1-3 or impl=deepspeed",
)


# --- by hand --------------------------------------------------------------------------------------


class HandZero(Trainer):
    impl = "hand"
    support = HAND_ZERO
    model_in_storage_dtype = True  # ZeroModel keeps fp32 masters of its slices

    def __init__(self, gpt, stage, group, opt, no_sync, bucket_cap_mb=25.0, prefetch=True):
        from day18_zero.zero import ZeroModel

        super().__init__(gpt, stage, group, opt, no_sync)
        self.model = ZeroModel(gpt, stage, opt.make, group, bucket_cap_mb, prefetch=prefetch)
        self.label = f"hand ZeRO-{stage}"

    def accumulating(self, last):
        return nullcontext() if last or not self.no_sync else self.model.no_sync()

    def zero_grad(self):
        self.model.zero_grad()

    def optimizer_step(self):
        self.model.step()

    def state_bytes(self):
        return self.model.state_bytes()

    def full_parameters(self):
        return self.model.full_parameters()

    def padded_numel(self):
        return self.model.padded_numel()


class HandDDP(Trainer):
    """Stage 0 by hand: day 17's bucketed all-reduce, then a full AdamW on every rank."""

    impl = "hand"
    support = NO_MASTER
    label = "hand DDP (day 17 BucketDDP)"
    formula_note = "day 17's buckets hold a second copy of the gradients (+4 B/param)"

    def __init__(self, gpt, stage, group, opt, no_sync, bucket_cap_mb=25.0, prefetch=True):
        from day17_ddp.ddp_manual import BucketDDP

        super().__init__(gpt, stage, group, opt, no_sync)
        self.model = BucketDDP(gpt, group, bucket_cap_mb, first_bucket_mb=bucket_cap_mb)
        self.optimizer = opt.make(self.model.parameters())

    def accumulating(self, last):
        return nullcontext() if last else self.model.no_sync()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self):
        self.optimizer.step()

    def state_bytes(self):
        buckets = sum(nbytes(b) for b in self.model.buffers)  # the buckets: a 2nd gradient copy
        return live_state_bytes(self.gpt.parameters(), self.optimizer) + StateBytes(grads=buckets)

    def full_parameters(self):
        return {n: p.detach().clone() for n, p in self.gpt.named_parameters()}


# --- torch's own ----------------------------------------------------------------------------------


class TorchDDP(Trainer):
    """Stage 0: torch DDP; stage 1: DDP + torch's ZeroRedundancyOptimizer."""

    impl = "torch"
    support = NO_MASTER

    def __init__(self, gpt, stage, group, opt, no_sync, bucket_cap_mb=25.0, prefetch=True):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__(gpt, stage, group, opt, no_sync)
        self.model = DDP(
            gpt, process_group=group, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True
        )  # .grad *is* the bucket: no 2nd copy
        # DDP's own all-reduce is issued from C++, invisible to CommCounter; its Python twin
        # (the same divide-by-N then sum) goes through dist.all_reduce, where it is counted
        self.model.register_comm_hook(group, allreduce_hook)
        if stage == 0:
            self.optimizer = opt.make(self.model.parameters())
            self.label = "torch DDP"
        else:
            self.optimizer = ZeroRedundancyOptimizer(
                self.model.parameters(),
                optimizer_class=opt.cls,
                process_group=group,
                **opt.kwargs(),
            )
            self.label = "torch DDP + ZeroRedundancyOptimizer"
            self.formula_note = (
                "ZeroRedundancyOptimizer gives each rank whole parameters (greedy by size), "
                "so the optimizer shards are uneven"
            )

    def accumulating(self, last):
        return nullcontext() if last else self.model.no_sync()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=False)  # keep the bucket views

    def optimizer_step(self):
        self.optimizer.step()  # ZeroRedundancyOptimizer: local step, then broadcast each shard

    def state_bytes(self):
        local = getattr(self.optimizer, "optim", self.optimizer)  # ZeRO's local AdamW
        return live_state_bytes(self.gpt.parameters(), local)

    def full_parameters(self):
        return {n: p.detach().clone() for n, p in self.gpt.named_parameters()}


class TorchFSDP2(Trainer):
    """Stage 3: FSDP2's fully_shard on every block, then on the root (bottom-up, so each block
    is its own all-gather unit); stage 2: the same with reshard_after_forward=False, which keeps
    the gathered parameters from forward to backward (FSDP's SHARD_GRAD_OP: ZeRO-2's traffic,
    but the parameters are sharded again between steps)."""

    impl = "torch"
    support = NO_MASTER

    def __init__(self, gpt, stage, group, opt, no_sync, bucket_cap_mb=25.0, prefetch=True):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        super().__init__(gpt, stage, group, opt, no_sync)
        device = next(gpt.parameters()).device.type
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, device)
        reshard = stage == 3
        from day18_zero.zero import default_units

        for unit in default_units(gpt):  # the GPT's blocks; none for a module without `blocks`
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        self.model = fully_shard(gpt, mesh=mesh, reshard_after_forward=reshard)
        self.optimizer = opt.make(self.model.parameters())
        if not reshard:
            self.formula_note = (
                "FSDP2 shards the parameters between steps too (full only from forward to "
                "the end of backward): stage 3's memory at rest, stage 2's traffic"
            )
        self.label = "torch FSDP2 fully_shard" + (
            "" if reshard else " (reshard_after_forward=False)"
        )

    def state_precision(self, precision):
        """torch's AdamW on parameters in the training dtype: m and v in that dtype, no master."""
        return replace(precision, name=f"{precision.name}, no master", optim=2 * precision.param)

    def formula_stage(self):
        return 3  # at rest (where state_bytes counts) both FSDP2 variants hold 1/N of everything

    def accumulating(self, last):
        self.model.set_requires_gradient_sync(last or not self.no_sync)
        return nullcontext()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self):
        self.optimizer.step()

    def state_bytes(self):
        # AdamW's step counters (one 0-dim tensor per parameter) are no per-parameter state
        return live_state_bytes(self.model.parameters(), self.optimizer, counters=False)

    def full_parameters(self):
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}

    def padded_numel(self):
        """FSDP2 cuts every parameter on dim 0 into N equal rows-slices: dim 0 padded to a
        multiple of N (a (50, 64) weight at N = 64 holds one row of 64 per rank)."""
        n = dist.get_world_size(self.group)
        return sum(
            -(-p.shape[0] // n) * n * (p.numel() // p.shape[0]) for p in self.model.parameters()
        )


# impl -> stage -> the trainer that runs it
KINDS: dict[str, dict[int, type[Trainer]]] = {
    "hand": {0: HandDDP, 1: HandZero, 2: HandZero, 3: HandZero},
    "torch": {0: TorchDDP, 1: TorchDDP, 2: TorchFSDP2, 3: TorchFSDP2},
    "deepspeed": dict.fromkeys((0, 1, 2, 3), DeepSpeedZero),
}


def trainer_class(impl: str, stage: int) -> type[Trainer]:
    """The class that trains (impl, stage): what it supports is asked before any is built."""
    return KINDS[impl][stage]


def build(
    impl: str,
    stage: int,
    gpt: nn.Module,
    group,
    opt: OptimConfig,
    *,
    no_sync=True,
    bucket_cap_mb=25.0,
    prefetch=True,
    ds_config: dict | None = None,
) -> Trainer:
    """The trainer for (impl, stage); arguments were validated by the caller's config."""
    if impl == "deepspeed":
        return DeepSpeedZero(gpt, stage, group, opt, no_sync, ds_config=ds_config)
    cls = trainer_class(impl, stage)
    return cls(gpt, stage, group, opt, no_sync, bucket_cap_mb=bucket_cap_mb, prefetch=prefetch)
