"""Day 17's hand-written syncs in a plain script that ends the way most scripts do: a barrier and
destroy_process_group(), no gc.collect(). The exit soak runs it many times per sync."""

import sys

import torch
import torch.distributed as dist

from day17_ddp.ddp_manual import wrap
from dtl.model import GPT, loss_fn, preset

if __name__ == "__main__":
    dist.init_process_group("gloo")  # what a plain script does (not dtl.dist.init)
    model = wrap(GPT(preset("tiny"), seed=0), sys.argv[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(step))
        loss_fn(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()
