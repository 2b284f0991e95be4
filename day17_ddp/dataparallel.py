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
from dataclasses import dataclass

import torch
import torch.nn as nn

from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.data import get_batch, load_corpus
from dtl.model import GPT, loss_fn, preset
from dtl.reference import params_gap
from dtl.registry import SKIP_PREFIX


@dataclass
class Config:
    steps: int = 6  # SGD steps, timed one by one
    batch_size: int = 8  # sequences per GPU per step
    seq_len: int = 128  # tokens per sequence
    lr: float = 0.1  # SGD learning rate
    # the largest parameter difference allowed against one GPU after all steps: both runs are
    # fp32 and differ only in the order DataParallel sums the replicas' gradients
    tolerance: float = 1e-4


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


def run(cfg: Config) -> tuple[str, bool]:
    n = torch.cuda.device_count()
    model_cfg = preset("small")
    tokens = load_corpus().train
    dp = nn.DataParallel(GPT(model_cfg, seed=0).cuda(0))  # parameters live on GPU 0 only
    ref = GPT(model_cfg, seed=0).cuda(0)  # the same step on one GPU, for the check
    opts = [torch.optim.SGD(m.parameters(), lr=cfg.lr) for m in (dp, ref)]
    times = []
    for s in range(cfg.steps):
        x, y = get_batch(tokens, cfg.seq_len, cfg.batch_size * n, seed=0, step=s)
        x, y = x.cuda(0), y.cuda(0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(dp, opts[0], x, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        ref_loss = step(ref, opts[1], x, y)
    gap = params_gap(dp.module, ref)
    mem = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(n)]
    print("peak memory per GPU (GiB): " + ", ".join(f"cuda:{i} {m:.2f}" for i, m in enumerate(mem)))
    median_ms = sorted(times)[len(times) // 2] * 1e3
    ok = gap <= cfg.tolerance
    return (
        f"summary: dataparallel on {n} GPUs: {median_ms:.0f} ms/step,"
        f" loss {loss:.4f} vs one GPU {ref_loss:.4f}, max param diff {gap:.1e} "
        f"({'<=' if ok else 'ABOVE'} tolerance {cfg.tolerance:.0e}); GPU 0 peak "
        f"{mem[0]:.2f} GiB vs others {max(mem[1:]):.2f} GiB"
    ), ok


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    reason = cannot_run_reason()
    if reason:  # a skip, said as one: the tour and the tests show SKIP with this reason
        print(f"{SKIP_PREFIX} {reason}", flush=True)
        return
    line, ok = run(cfg)
    print(line, flush=True)
    dtl_dist.finish(ok)  # no process group here: DataParallel needs none


if __name__ == "__main__":
    main()
