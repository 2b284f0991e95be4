"""The smallest multi-host job: every rank joins, one all-reduce, one line from rank 0.

    torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d --rdzv-endpoint=node0:29500 \\
        -m dtl.cluster.probe

The failure drills launch it with one thing wrong (a hosts file, an interface variable, the
master's address, a node rank), because a wrong launch fails before any lesson code runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtl import dist as dtl_dist


def main() -> None:
    info = dtl_dist.init()
    hosts = dtl_dist.hosts_line(info)  # all_gather_object: the first traffic between the hosts
    x = torch.tensor([float(info.rank + 1)], device=info.device)
    dist.all_reduce(x)  # (1,) on every rank: 1 + 2 + ... + world
    want = info.world_size * (info.world_size + 1) / 2
    ok = x.item() == want
    dtl_dist.print0(
        f"summary: probe {hosts}; all_reduce sum {x.item():g} (expected {want:g}) "
        f"{'ok' if ok else 'WRONG'}"
    )
    dtl_dist.finish(ok)


if __name__ == "__main__":
    main()
