"""Day 17's hand-written syncs in a plain script that ends the way most scripts do: a barrier and
destroy_process_group(), no gc.collect(). The exit soak runs it many times per sync.

After destroy_process_group() it prints how many gloo threads this process still runs: 0 when
the group was freed (freeing it joins gloo's workers), more when something still holds it (torch's
DDP module holds its group until the module is freed). A worker left running can still be
releasing the barrier's work when the interpreter shuts down, which aborts about 1 exit in 100;
the count shows the exposure in every run."""

import os
import sys

import torch
import torch.distributed as dist

from day17_ddp.ddp_manual import wrap
from dtl.model import GPT, loss_fn, preset

GLOO_THREADS = "gloo threads after destroy_process_group:"  # tests/test_day17_ddp.py reads it


def live_gloo_threads() -> int:
    """Threads of a gloo process group alive in this process (gloo_tcp_loop, pt_gloo_runloop):
    Linux names them in /proc/self/task/<tid>/comm; -1 where there is no /proc."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return -1
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, tid, "comm")) as f:
                names.append(f.read())
        except OSError:  # the thread ended while the directory was read
            pass
    return sum("gloo" in name for name in names)


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
    # one write per line: the two ranks share torchrun's stdout
    os.write(sys.stdout.fileno(), f"{GLOO_THREADS} {live_gloo_threads()}\n".encode())
