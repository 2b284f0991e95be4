"""Day 28: megatron-core itself as a strategy (day 22's mcore library).

    megatron   GPTModel, its pipeline schedule, its DDP and DistributedOptimizer (Adam's m and v
               sharded over dp); the recipe's lr and weight decay written into its groups each
               step instead of its OptimizerParamScheduler

Its state per stage is Pipelined's (model_parallel.py) with the distributed optimizer.
megatron-core is an optional extra (`extras = ("megatron",)`): dtl.megatron and day 22's mcore
import it inside their functions, so this module imports without it. Its checkpoints
(dist_checkpointing) are not wired here: train.py refuses --resume and --save_every.
"""

from __future__ import annotations

import contextlib

import dtl.megatron as dm
from day22_megatron import mcore
from day22_megatron.megatron_gpt import gather_dense
from day28_gpt125m.model_parallel import Pipelined, untied
from day28_gpt125m.strategy import Setup, register


@register
class Megatron(Pipelined):
    """megatron-core itself (day 22's mcore library), the recipe's lr set per step."""

    name = "megatron"
    extras = ("megatron",)
    distributed_optimizer = True  # its DistributedOptimizer: Adam's m and v sharded over dp
    no_checkpoints = "megatron-core checkpoints (dist_checkpointing) are not wired into day 28"
    no_recompute = "--recompute is not wired for megatron (its recompute_granularity); use tp_pp"

    def __init__(self, s: Setup):
        self.r, self.grid, self.cfg = s.recipe, s.grid, s.cfg
        self.seq_len, self.micro_batch = s.seq_len, s.micro_batch
        self._shim = contextlib.ExitStack()
        dm.init_parallel_state(s.grid)
        self._shim.enter_context(dm.cpu_shim())
        self.parts = mcore.build(
            s.cfg,
            s.grid,
            s.device,
            optim=s.recipe.optim,
            clip_grad=s.recipe.clip,
            steps=s.steps,
            distributed_optimizer=self.distributed_optimizer,  # what predicted_state assumes
            seed=s.seed,
            scheduler=False,
        )
        self.forward_step = mcore.make_forward_step(s.seq_len, s.device)

    def step(self, micro_batches, lr):
        # the recipe's schedule instead of megatron's OptimizerParamScheduler
        mcore.set_lr_and_decay(self.parts, lr, self.r.weight_decay)
        loss, norm = mcore.train_step(
            self.parts,
            self.forward_step,
            micro_batches,
            seq_length=self.seq_len,
            micro_batch_size=self.micro_batch,
        )
        if self.measure_state:  # after the step: main_grad and Adam's state both still held
            self.last_state = mcore.state_bytes(self.parts)
        return loss, float(norm)

    def full_parameters(self):
        return untied(gather_dense(self.parts.chunks, self.cfg, self.grid), self.cfg)

    def close(self):
        self._shim.close()
        dm.destroy_parallel_state()
