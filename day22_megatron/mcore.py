"""Day 22: megatron-core's training pieces as a library: its model chunks from the dtl GPT, DDP,
optimizer and scheduler, and one optimizer step through its pipeline schedule.

    parts = build(gpt_cfg, grid, device, optim=OptimConfig(...), clip_grad=1.0, steps=4)
    step = make_forward_step(seq_len, device)
    loss, grad_norm = train_step(parts, step, micro_batches, seq_len=32, micro_batch_size=1)

Every argument is explicit: train_megatron.py (the lesson's script) and day 28's megatron strategy
both build from here. megatron-core's parallel_state must exist first (dtl.megatron).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import dtl.megatron as dm
from day22_megatron.megatron_gpt import build_model_chunks, load_dense
from dtl.grid import ParallelGrid
from dtl.model import GPT, GPTConfig
from dtl.optim import OptimConfig
from dtl.precision import ANY_DEVICE, GPU_ONLY, PRECISIONS, Precision, at_least_fp32, declare
from dtl.state import StateBytes, nbytes, optimizer_state_bytes


@dataclass
class Parts:
    """What build returns: the GPTModel chunks (this rank's stages), their DDP wrappers,
    megatron's optimizer and its scheduler (None: the caller sets each step's lr itself)."""

    chunks: list
    model: list
    optimizer: object
    scheduler: object | None


def causal_mask(T: int, device) -> torch.Tensor:
    """megatron's attention mask: True where a query may NOT look (the future), (1, 1, T, T)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(1).view(1, 1, T, T)


def loss_func(per_token_loss: torch.Tensor):
    """Mean cross-entropy of one micro-batch. The schedule divides it by the number of
    micro-batches and DDP by the DP size, so the gradient is the global batch's mean."""
    loss = per_token_loss.to(at_least_fp32(per_token_loss.dtype)).mean()
    return loss, {"lm loss": loss.detach().clone()}  # a copy: the schedule divides in place


def make_forward_step(T: int, device):
    """megatron's forward_step_func: a micro-batch from the iterator, the model's per-token loss."""
    mask = causal_mask(T, device)
    pos = torch.arange(T, device=device).unsqueeze(0)

    def forward_step(data_iterator, model):
        x, y = next(data_iterator)  # (b, T) token ids and targets of one micro-batch
        return model(x, pos.expand_as(x), mask, labels=y), loss_func

    return forward_step


# The precisions megatron-core trains in here: fp32 (the CPU run, checked against one process) and
# bf16 parameters with fp32 main parameters in its optimizer, on GPUs
MEGATRON = declare(
    "megatron-core",
    {"fp32": ANY_DEVICE, "bf16": GPU_ONLY},
    why=(
        "fp16 needs megatron's loss scaler, fp8 Transformer Engine's layers: neither is wired here"
    ),
)


def build(
    gpt_cfg: GPTConfig,
    grid: ParallelGrid,
    device: torch.device,
    *,
    optim: OptimConfig,
    clip_grad: float,
    steps: int,
    vpp: int | None = None,
    sequence_parallel: bool = False,
    distributed_optimizer: bool = False,
    precision: Precision = PRECISIONS["fp32"],
    seed: int = 0,
    scheduler: bool = True,
) -> Parts:
    """Megatron's model chunks, DDP wrappers, optimizer and (a constant) scheduler, from the dtl
    GPT(gpt_cfg, seed): one model for every layout. `vpp`: model chunks per pipeline rank
    (interleaved 1F1B); `distributed_optimizer`: Adam's state sharded over DP (ZeRO-1);
    `precision`: fp32, or bf16 parameters with fp32 main parameters in the optimizer."""
    from megatron.core import tensor_parallel as mtp
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    MEGATRON.require(precision.name, device.type)  # PrecisionError, one line
    dtype, bf16 = precision.storage, precision.storage == torch.bfloat16  # megatron's bf16 flag
    torch.manual_seed(seed)
    mtp.model_parallel_cuda_manual_seed(seed)  # megatron's per-TP-rank RNG streams
    chunks = build_model_chunks(
        gpt_cfg, grid, vpp=vpp, sequence_parallel=sequence_parallel, params_dtype=dtype, bf16=bf16
    )
    load_dense(chunks, GPT(gpt_cfg, seed=seed).state_dict(), gpt_cfg, grid)  # one model for all
    for chunk in chunks:
        chunk.to(device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
    )
    model = [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    opt_config = OptimizerConfig(
        optimizer="adam",
        min_lr=optim.lr,
        clip_grad=clip_grad,
        **optim.megatron_kwargs(),
        use_distributed_optimizer=distributed_optimizer,
        bf16=bf16,
        params_dtype=dtype,
    )
    with dm.optimizer_shim():
        optimizer = get_megatron_optimizer(opt_config, model)
    sched = None
    if scheduler:
        # The scheduler is what applies wd_mult: without it, torch's Adam would decay every
        # group, biases and LayerNorm weights too (megatron's groups only *record* wd_mult = 0).
        lr, wd = optim.lr, optim.weight_decay
        sched = OptimizerParamScheduler(
            optimizer,
            init_lr=lr,
            max_lr=lr,
            min_lr=lr,
            lr_warmup_steps=0,
            lr_decay_steps=steps,
            lr_decay_style="constant",
            start_wd=wd,
            end_wd=wd,
            wd_incr_steps=steps,
            wd_incr_style="constant",
        )
    return Parts(chunks, model, optimizer, sched)


def set_lr_and_decay(parts: Parts, lr: float, weight_decay: float) -> None:
    """What OptimizerParamScheduler.step writes, for a caller with its own schedule."""
    for group in parts.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


def train_step(parts: Parts, forward_step, mbs, *, seq_length: int, micro_batch_size: int):
    """One optimizer step: megatron's schedule runs every micro-batch's forward and backward.
    Without a scheduler the caller has written this step's lr and weight decay into the groups.
    Returns (the mean loss where this rank knows it (last stage), else 0.0; the global norm)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, optimizer = parts.model, parts.optimizer
    for m in model:
        m.zero_grad_buffer()  # the DDP buffers hold main_grad; zero them, not param.grad
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()  # by parallel_state's pp and vpp sizes
    iterators = [iter(list(mbs)) for _ in model]  # each chunk reads every micro-batch once
    outputs = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(mbs),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )  # finalize_model_grads ran at its end: grads synced over DP, tied embeddings summed
    with dm.optimizer_shim():
        _, grad_norm, _ = optimizer.step()  # clip by the global norm (over TP x PP), then Adam
    if parts.scheduler is not None:
        parts.scheduler.step(increment=1)
    # the loss exists on the last pipeline stage only (one dict per micro-batch)
    loss = sum(o["lm loss"].item() for o in outputs) / len(mbs) if outputs else 0.0
    return loss, grad_norm


def state_bytes(parts: Parts) -> StateBytes:
    """This rank's model state as megatron holds it: the chunks' parameters, their gradients
    (DDP's main_grad views into its fp32 grad buffer: grad_reduce_in_fp32) and the optimizer's
    tensors (Adam's m and v; with the distributed optimizer, over this rank's shard only; in
    fp32 its "main" parameters are views of the model's, no copy). Counted before the next
    step's zeroing, when all three exist."""
    params = [p for chunk in parts.chunks for p in chunk.parameters()]
    grads = sum(nbytes(p.main_grad) for p in params if getattr(p, "main_grad", None) is not None)
    inner = getattr(parts.optimizer, "optimizer", parts.optimizer)  # torch's Adam inside
    return StateBytes(
        params=sum(nbytes(p) for p in params),
        grads=grads,
        optim=optimizer_state_bytes(inner, counters=False),
    )


# megatron-core's buffer layout under its distributed optimizer (param_and_grad_buffer.py): each
# parameter starts at a multiple of 64 elements (128-byte aligned), each bucket ends at a
# multiple of lcm(d, 128) (256-byte aligned, and split evenly over the d ranks)
PARAM_ALIGN, BUCKET_ALIGN = 64, 128


def distopt_buffer_elements(layout: list[tuple[int, int]], dp: int) -> int:
    """The elements of one megatron-core buffer under the distributed optimizer over `dp`
    ranks: `layout` is (elements, bucket) of each parameter in the buffer's order (megatron lays
    a model's parameters out in reverse); the rule above, parameter by parameter, each bucket's
    end padded before the next begins."""
    unit = math.lcm(dp, BUCKET_ALIGN)
    end, bucket = 0, None
    for n, b in layout:
        if bucket is not None and b != bucket:
            end = math.ceil(end / unit) * unit  # the previous bucket's end
        end = math.ceil(end / PARAM_ALIGN) * PARAM_ALIGN + n
        bucket = b
    return math.ceil(end / unit) * unit


def buffers(parts: Parts) -> list:
    """megatron-core DDP's dense buffers (one per dtype and model chunk)."""
    return [b for m in parts.model for b in m.buffers]


def buffer_layouts(parts: Parts) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each buffer's grad-buffer elements and its parameters' (elements, bucket) in its order."""
    out = []
    for b in buffers(parts):
        order = sorted(b.params, key=lambda p: b.param_index_map[p][0])  # by start in the buffer
        out.append((b.grad_data.numel(), [(p.numel(), b.param_index_map[p][2]) for p in order]))
    return out
