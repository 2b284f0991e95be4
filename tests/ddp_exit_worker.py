"""A minimal DDP-on-gloo worker for the exit soak test: with `skip-cleanup` it exits the way most
scripts do (no barrier, no destroy_process_group), which is what makes gloo abort at exit."""

import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dtl import dist as dtl_dist

if __name__ == "__main__":
    dtl_dist.init()
    model = DDP(torch.nn.Linear(64, 64))
    for _ in range(3):
        model(torch.randn(8, 64)).sum().backward()
    if sys.argv[1:] != ["skip-cleanup"]:
        dtl_dist.cleanup()
