"""The optimizer settings of the course: one record, built into every AdamW the days make.

    opt = OptimConfig(lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, decay="matrices")
    optimizer = opt.make(model)              # torch.optim.AdamW on opt.groups(model)
    ds["optimizer"] = {"type": "AdamW", "params": opt.deepspeed_params()}   # DeepSpeed's
    megatron_kwargs = opt.megatron_kwargs()  # megatron-core's OptimizerConfig names
    set_lr(optimizer, lr * warmup_cosine(step, warmup=2, steps=8, min_ratio=0.1))

`decay` says which parameters weight decay applies to: "all" (torch's default: one group, every
parameter) or "matrices" (Megatron's and nanoGPT's rule, `optimizer_groups`: matrices and
embeddings decay, biases and LayerNorm weights do not). name="sgd" (momentum 0.9) is for tests:
Adam divides by sqrt(v), so a gradient off by a constant factor (a sum where a mean belongs) gives
the same update; SGD's update shows it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    eps: float = 1e-8
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    name: Literal["adamw", "sgd"] = "adamw"
    decay: Literal["all", "matrices"] = "all"

    @property
    def cls(self) -> type[torch.optim.Optimizer]:
        return torch.optim.SGD if self.name == "sgd" else torch.optim.AdamW

    def kwargs(self) -> dict[str, Any]:
        if self.name == "sgd":
            return dict(lr=self.lr, momentum=0.9)
        if self.decay == "matrices":  # the decay lives in the groups
            return dict(lr=self.lr, eps=self.eps, betas=self.betas)
        return dict(lr=self.lr, eps=self.eps, weight_decay=self.weight_decay, betas=self.betas)

    def groups(
        self, params: nn.Module | Iterable[torch.Tensor]
    ) -> list[torch.Tensor] | list[dict[str, Any]]:
        """What the optimizer is given: the parameters themselves, or the two decay groups."""
        if self.decay == "matrices":
            return optimizer_groups(params, self.weight_decay)
        return list(params.parameters() if isinstance(params, nn.Module) else params)

    def make(
        self,
        params: nn.Module | Iterable[torch.Tensor],
        *,
        fused: bool | None = None,
        foreach: bool | None = None,
    ) -> torch.optim.Optimizer:
        """The optimizer over a module or a list of parameters. `fused` (one kernel for every
        tensor, where the device has it) and `foreach` (torch's multi-tensor path, or its
        per-tensor loop) are passed on only when given: None leaves torch's default. (torch reads
        an explicit fused=False with foreach=None as the per-tensor loop, so False is dropped.)"""
        extra: dict[str, Any] = {}
        if fused:
            extra["fused"] = True
        if foreach is not None:
            extra["foreach"] = foreach
        return self.cls(self.groups(params), **self.kwargs(), **extra)

    def deepspeed_params(self) -> dict[str, Any]:
        """The ds_config's optimizer.params for AdamW (decay groups come with the parameters)."""
        wd = self.weight_decay
        return {"lr": self.lr, "eps": self.eps, "weight_decay": wd, "betas": list(self.betas)}

    def megatron_kwargs(self) -> dict[str, float]:
        """megatron-core's OptimizerConfig fields (it decays matrices only, its own rule)."""
        return dict(
            lr=self.lr,
            weight_decay=self.weight_decay,
            adam_eps=self.eps,
            adam_beta1=self.betas[0],
            adam_beta2=self.betas[1],
        )


def optimizer_groups(
    params: nn.Module | Iterable[torch.Tensor], weight_decay: float
) -> list[dict[str, Any]]:
    """AdamW parameter groups for a module (or a list of parameters): weight decay on matrices
    (and embeddings), none on biases and LayerNorm weights, the rule of Megatron
    (`len(param.shape) == 1 or name.endswith(".bias")` gets wd_mult 0) and nanoGPT (`p.dim() >= 2`
    decays). A tied weight is listed once."""
    if isinstance(params, nn.Module):
        params = params.parameters()
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def warmup_cosine(step: int, *, warmup: int, steps: int, min_ratio: float) -> float:
    """The learning-rate multiplier of step `step`: linear warm-up to 1 over `warmup` steps,
    then a cosine down to `min_ratio` at `steps` (GPT-3's and nanoGPT's schedule; days 24, 28)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s rule: the factor every gradient is multiplied by, 1 when
    the norm is within `max_norm` (or there is none)."""
    return min(1.0, max_norm / (norm + 1e-6)) if max_norm else 1.0


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """This step's learning rate on every parameter group (a schedule's value)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
