"""Day 18: the interface every ZeRO trainer fills in (engines.py: by hand and torch; ds_engine.py:
DeepSpeed). `step` is the loop they share: zero the gradients, the micro-steps (communication
held back until the last where the trainer can), the state counted, the optimizer step.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from dtl import profile as dtl_profile
from dtl.model import loss_fn
from dtl.optim import OptimConfig
from dtl.precision import Precision, Support
from dtl.state import StateBytes


class Trainer:
    """Drives one implementation: subclasses fill in the four hooks below."""

    impl = ""
    label = ""
    support: Support  # the precisions it trains in (dtl.precision.declare), asked by the config
    # the caller casts the model to the precision's storage dtype first (else fp32 goes in, and
    # the engine casts it itself, as DeepSpeed's bf16 and fp16 sections do)
    model_in_storage_dtype = False
    # which row of the paper's table this implementation's memory follows, and why not if not
    formula_note = ""

    def formula_stage(self) -> int:
        return self.stage

    def state_precision(self, precision: Precision) -> Precision:
        """The bytes per parameter this implementation holds when it trains in `precision`."""
        return precision

    def __init__(self, gpt: nn.Module, stage: int, group, opt: OptimConfig, no_sync: bool):
        self.gpt, self.stage, self.group, self.opt_cfg = gpt, stage, group, opt
        self.no_sync = no_sync  # accumulate micro-steps without communication
        self.bytes_before_step = StateBytes()

    def step(self, micro_batches) -> float:
        """One optimizer step over the micro-batches; returns this rank's mean loss over them
        (dtl.dist.all_reduce_scalar(..., average=True) makes it the global batch's loss).

        The model state is counted just before the optimizer step, when all three kinds exist:
        the gradients of this step and the optimizer state of the previous ones.
        """
        with dtl_profile.range(dtl_profile.STEP):  # named ranges: see dtl.profile
            return self.run_step(micro_batches).item()

    def run_step(self, micro_batches) -> torch.Tensor:
        """step() without reading the loss back to the host: the mean loss as a 0-dim tensor.
        Under fake tensors (dtl.simulate: shapes, no data) this is the step that runs."""
        self.zero_grad()
        total, k = 0.0, len(micro_batches)
        for m, (x, y) in enumerate(micro_batches):
            last = m == k - 1
            with self.accumulating(last):
                # named ranges (dtl.profile): a torch.profiler trace and Nsight Systems see them
                with dtl_profile.range(dtl_profile.FORWARD):
                    loss = loss_fn(self.forward(x), y)
                with dtl_profile.range(dtl_profile.BACKWARD):
                    self.backward(loss, k)
            total = total + loss.detach()
        self.bytes_before_step = self.state_bytes()
        with dtl_profile.range(dtl_profile.OPTIMIZER):
            self.optimizer_step()
        return total / k

    def forward(self, x):
        return self.model(x)

    def backward(self, loss, accum: int) -> None:
        (loss / accum).backward()

    def accumulating(self, last: bool):
        return nullcontext()

    def zero_grad(self) -> None:
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def state_bytes(self) -> StateBytes:
        raise NotImplementedError

    def full_parameters(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def padded_numel(self) -> int:
        """Elements the collectives move per pass (Ψ plus the implementation's padding)."""
        return sum(p.numel() for p in self.gpt.parameters())
