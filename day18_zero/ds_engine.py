"""Day 18: the same ZeRO stages with DeepSpeed's real engine, on a ds_config checked up front.

The shipped configs (day18_zero/ds_config_zero{0,1,2,3}.json) are plain DeepSpeed JSON, with
"auto" where the run's own config fills the value. Reading, filling and checking them, and
importing DeepSpeed on the run's device, is the kit's (dtl/deepspeed.py: load_ds_config,
import_deepspeed); this file is the trainer over DeepSpeed's engine and the per-rank bytes read
from its partitions.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

from day18_zero.trainer import Trainer
from dtl.deepspeed import DEEPSPEED, import_deepspeed
from dtl.state import StateBytes, nbytes, optimizer_state_bytes

HERE = os.path.dirname(os.path.abspath(__file__))


def default_ds_config_path(stage: int) -> str:
    return os.path.join(HERE, f"ds_config_zero{stage}.json")


class DeepSpeedZero(Trainer):
    """DeepSpeed's engine (`deepspeed.initialize` on the existing process group)."""

    impl = "deepspeed"
    support = DEEPSPEED  # its bf16 and fp16 sections cast the model; fp32 goes in

    def formula_stage(self):
        # DeepSpeed's stage 1 runs stage 2's code: its gradients, too, live only as partitions
        return 2 if self.stage == 1 else self.stage

    def state_precision(self, precision):
        # in fp32 DeepSpeed still keeps an fp32 "master" partition beside the fp32 parameters
        return precision if self.stage == 0 else precision.with_fp32_master()

    def __init__(self, gpt, stage, group, opt, no_sync, ds_config: dict):
        super().__init__(gpt, stage, group, opt, no_sync)
        if group is not None:
            raise ValueError("the DeepSpeed path trains over the whole world (no sub-group)")
        deepspeed = import_deepspeed(next(gpt.parameters()).device.type)  # the model's device

        self.ds_config = ds_config
        self.engine, *_ = deepspeed.initialize(
            model=gpt, config=ds_config, dist_init_required=False
        )
        self.model = self.engine
        self.label = f"DeepSpeed ZeRO-{stage}"
        if stage == 1:
            self.formula_note = "DeepSpeed's stage 1 keeps only its gradient partition, as stage 2"
        self._last = True

    def accumulating(self, last):
        self._last = last
        return nullcontext()

    def backward(self, loss, accum):
        # DeepSpeed divides by gradient_accumulation_steps itself and counts micro-steps: step()
        # after every backward, and only the one at the boundary updates the parameters
        self.engine.backward(loss)
        if not self._last:
            self.engine.step()

    def zero_grad(self):
        pass  # engine.step() at the boundary zeroes the gradients

    def optimizer_step(self):
        self.engine.step()

    def state_bytes(self):
        return ds_state_bytes(self.engine, self.stage)

    def padded_numel(self):
        o = self.engine.optimizer
        if self.stage in (1, 2):
            return sum(t.numel() for t in o.bit16_groups_flat)
        if self.stage == 3:
            return (
                sum(p.ds_tensor.numel() for p in self.engine.module.parameters())
                * self.engine.dp_world_size
            )
        return super().padded_numel()

    def full_parameters(self):
        import deepspeed

        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=self.stage == 3):
            return {n: p.detach().clone().float() for n, p in params}


def ds_state_bytes(engine, stage: int) -> StateBytes:
    """Per-rank bytes read from the engine's own partitions (attribute paths of 0.19.x)."""
    o = engine.optimizer
    module_params = list(engine.module.parameters())
    if stage == 0:
        if hasattr(o, "fp32_groups_flat"):  # bf16: FP16_Optimizer keeps flat bf16 + fp32 copies
            params = sum(nbytes(t) for t in o.fp16_groups_flat)
            master, inner = sum(nbytes(t) for t in o.fp32_groups_flat), o.optimizer
        else:  # fp32: the optimizer steps the parameters themselves
            params, master, inner = sum(nbytes(p) for p in module_params), 0, o
        grads = sum(nbytes(p.grad) for p in module_params)
    elif stage in (1, 2):
        params = sum(nbytes(t) for t in o.bit16_groups_flat)  # the module's params are views
        # my partition of the averaged gradients: views that cover exactly my slice (the buffer
        # under them also holds whole any parameter that straddles the slice's edge)
        grads = sum(nbytes(t) for ts in o.averaged_gradients.values() for t in ts)
        master, inner = sum(nbytes(t) for t in o.single_partition_of_fp32_groups), o.optimizer
    else:
        params = sum(nbytes(p.ds_tensor) for p in module_params)
        grads = nbytes(o.grad_partitions_flat_buffer)
        master, inner = sum(nbytes(t) for t in o.fp32_partitioned_groups_flat), o.optimizer
    return StateBytes(params=params, grads=grads, optim=master + optimizer_state_bytes(inner))
