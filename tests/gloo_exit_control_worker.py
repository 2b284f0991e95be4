"""The exit soak's control: no course code at all. A torch MLP trained on 2 gloo ranks, its
gradients averaged by a loop of dist.all_reduce after backward, AdamW; it ends with a barrier and
destroy_process_group(), no gc.collect(), like sync_exit_worker.py.

Its AdamW imports torch._dynamo after init_process_group, and torch._dynamo imports
torch.distributed.nn.functional, whose collectives take `group=group.WORLD` as a default argument
evaluated at that import. Those defaults hold the default group past destroy_process_group(), which
then does not join gloo's worker threads. A worker still releasing the barrier's work when the
interpreter shuts down needs the GIL for a Python object in that work's thread-local state, Python
ends the thread, and the process aborts ("terminate called without an active exception"): about 1
exit in 100 on torch 2.13 (CPU). dtl.dist imports torch.distributed.nn before any group exists,
which leaves those defaults None. Counting aborts:

    for i in $(seq 100); do torchrun --standalone --nproc_per_node=2 \
        tests/gloo_exit_control_worker.py 2>&1 | grep -c "terminate called"; done | sort | uniq -c
"""

import torch
import torch.distributed as dist
import torch.nn as nn

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])
    for t in model.parameters():
        dist.broadcast(t.data, src=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        for p in model.parameters():
            p.grad.div_(dist.get_world_size())
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()
