"""A worker for the torchrun restart test: rank 1 dies on attempt 0, the agent restarts both
workers, and attempt 1 must form a fresh process group and finish."""

import os

import torch
import torch.distributed as dist

from dtl import dist as dtl_dist

if __name__ == "__main__":
    info = dtl_dist.init()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    t = torch.ones(1)
    dist.all_reduce(t)
    if attempt == 0 and info.rank == 1:
        os._exit(1)  # a crash: no cleanup, the agent sees exit code 1 and restarts everyone
    dtl_dist.print_rank(f"attempt {attempt}: all_reduce -> {t.item():.0f}, ok")
    dtl_dist.cleanup()
