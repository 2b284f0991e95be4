"""Day 17: torch.nn.DataParallel, DDP's single-process ancestor, for comparison.

    torchrun --standalone --nproc_per_node=1 -m day17_ddp.dataparallel
One process on purpose (also on GPUs): DataParallel drives every visible GPU from one process with
one Python thread per GPU. On a machine with fewer than 2 GPUs it says why it cannot run, exit 0.

One DataParallel step (torch/nn/parallel/data_parallel.py, DataParallel.forward):
    scatter         split the batch along dim 0, one chunk per GPU
    replicate       copy the module from GPU 0 to every GPU, again on every step
    parallel_apply  one thread per GPU runs forward; the GIL serializes the Python in between
    gather          outputs (here the (B, T, vocab) logits too) come back to GPU 0
    backward        autograd sums the replicas' gradients back onto GPU 0's parameters
    optimizer       steps on GPU 0 only: the next replicate ships the new weights out again
GPU 0 does more work and holds more memory than the others (the first-GPU bottleneck).
DDP instead runs one process per GPU: no GIL sharing, no per-step replicate, and gradients are
all-reduced (evenly, by every rank) while backward runs.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from dtl import dist as dtl_dist
from dtl.data import get_batch, load_corpus
from dtl.model import GPT, loss_fn, preset

STEPS, B_PER_GPU, T = 6, 8, 128


def cannot_run_reason() -> str | None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= 2:
        return None
    return (
        f"DataParallel needs >= 2 CUDA GPUs in one process; this machine has {n}. It splits a "
        "batch over GPUs with threads, and has no CPU or gloo mode (use DDP: day17_ddp.train)"
    )


def step(model, opt, x, y) -> float:
    loss = loss_fn(model(x), y)  # logits of every chunk gathered on GPU 0, then one mean
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def run() -> str:
    n = torch.cuda.device_count()
    cfg = preset("small")
    tokens = load_corpus().train
    dp = nn.DataParallel(GPT(cfg, seed=0).cuda(0))  # parameters live on GPU 0 only
    ref = GPT(cfg, seed=0).cuda(0)  # the same step on one GPU, for the check
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (dp, ref)]
    times = []
    for s in range(STEPS):
        x, y = get_batch(tokens, T, B_PER_GPU * n, seed=0, step=s)
        x, y = x.cuda(0), y.cuda(0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(dp, opts[0], x, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        ref_loss = step(ref, opts[1], x, y)
    gap = max((a - b).abs().max().item() for a, b in zip(dp.module.parameters(), ref.parameters()))
    mem = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(n)]
    print("peak memory per GPU (GiB): " + ", ".join(f"cuda:{i} {m:.2f}" for i, m in enumerate(mem)))
    median_ms = sorted(times)[len(times) // 2] * 1e3
    return (
        f"summary: dataparallel on {n} GPUs: {median_ms:.0f} ms/step,"
        f" loss {loss:.4f} vs one GPU {ref_loss:.4f}, max param diff {gap:.1e}; GPU 0 peak "
        f"{mem[0]:.2f} GiB vs others {max(mem[1:]):.2f} GiB"
    )


def main() -> None:
    reason = cannot_run_reason()
    print(f"summary: dataparallel skipped: {reason}" if reason else run(), flush=True)
    dtl_dist.cleanup()  # no process group here: DataParallel needs none


if __name__ == "__main__":
    main()
