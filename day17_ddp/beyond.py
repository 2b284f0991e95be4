"""Day 17, beyond the gradient sync: buffers, uneven inputs, SyncBatchNorm, torch.compile.

    torchrun --standalone --nproc_per_node=2 -m day17_ddp.beyond            # ~10 s on CPU
    torchrun --standalone --nproc_per_node=gpu -m day17_ddp.beyond          # SyncBatchNorm too

Each part runs a small model under torch DDP and checks one claim of the notes, numerically:
    buffers   broadcast_buffers=True copies rank 0's buffers (BatchNorm running stats) at the
              start of every forward; False leaves each rank its own. After a step they differ
              either way: the forward updated them with the local batch.
    join      ranks with uneven numbers of batches: under Join the ranks that ran out shadow the
              all-reduces with zeros, so the others do not hang; DDP still divides by the initial
              world size. The parameters equal a one-process replay of exactly that.
    syncbn    SyncBatchNorm normalises with the statistics of the global batch (CUDA only).
    compile   torch.compile(DDP(model)) gives the gradients of eager DDP; dynamo's DDPOptimizer
              (optimize_ddp) splits the graph at bucket boundaries so all-reduces still overlap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.registry import SKIP_PREFIX

PARTS = ("buffers", "join", "syncbn", "compile")


@dataclass
class Config:
    part: Literal[("all", *PARTS)] = "all"  # all | buffers | join | syncbn | compile
    lr: float = 0.1  # SGD learning rate of the join replay
    out_dir: str = "outputs/day17_ddp/beyond"  # where config.json goes


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())  # [(C,)] * n: every rank's copy
    return out


def _bn_net(device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(device)


def _local_batch(rank: int, step: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 3, generator=g)  # host: a CPU generator, the same rows on every device
    return (x + 3.0 * rank).to(device)  # shifted per rank: the batch statistics differ


def _recorder(store: list):
    def hook(module, _inputs):
        store.append(module.running_mean.clone())  # the buffer as this forward finds it

    return hook


def part_buffers(device, rank: int) -> tuple[bool, str]:
    seen = {}
    for broadcast in (True, False):
        net = _bn_net(device)
        bn = net[1]
        at_entry: list[torch.Tensor] = []
        bn.register_forward_pre_hook(_recorder(at_entry))
        model = DDP(net, broadcast_buffers=broadcast)
        for step in range(2):
            model(_local_batch(rank, step, device)).sum().backward()
        # running_mean as step 1's forward found it, and after it, on every rank
        entry, after = _gather(at_entry[-1]), _gather(bn.running_mean)
        seen[broadcast] = (all(torch.equal(entry[0], e) for e in entry),
                           all(torch.equal(after[0], a) for a in after))  # fmt: skip
    ok = seen[True][0] and not seen[False][0] and not seen[True][1]
    line = (
        f"buffers: running_mean equal across ranks at forward entry with broadcast_buffers=True: "
        f"{'yes' if seen[True][0] else 'NO'}, with False: {'yes' if seen[False][0] else 'no'}; "
        f"after the step (local update) with True: {'yes' if seen[True][1] else 'no'}"
    )
    return ok, line


def _join_batches(rank: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(4, 3, generator=g).to(device), torch.randn(4, 1, generator=g).to(device))
        for _ in range(3 + 2 * rank)
    ]  # fmt: skip  (rank 0: 3 batches, rank 1: 5, ...)


def part_join(device, rank: int, world: int, lr: float) -> tuple[bool, str]:
    torch.manual_seed(0)
    net = nn.Linear(3, 1).to(device)
    reference = nn.Linear(3, 1).to(device)
    reference.load_state_dict(net.state_dict())
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with Join([model]):  # a rank that runs out joins; the others keep stepping
        for x, y in _join_batches(rank, device):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    # one process replays it: step s averages the gradients of the ranks that still had a
    # batch, divided by the initial world size (the joined ranks sent zeros)
    every = [_join_batches(r, device) for r in range(world)]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for s in range(max(len(b) for b in every)):
        for batches in every:
            if s < len(batches):
                x, y = batches[s]
                (nn.functional.mse_loss(reference(x), y) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    try:
        for p, q in zip(net.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        ok = True
    except AssertionError:
        ok = False
    counts = [len(b) for b in every]
    return ok, (
        f"join: batches per rank {counts}; under Join every rank finished and the parameters "
        f"equal the one-process replay (rtol 1e-5): {'yes' if ok else 'NO'}"
    )


def part_syncbn(device, rank: int, world: int) -> tuple[bool | None, str]:
    if device.type != "cuda":
        try:  # ask torch itself, so the reason printed is the one this torch gives
            model = DDP(nn.SyncBatchNorm(4).to(device))
            model(torch.randn(8, 4, device=device))
        except ValueError as e:
            return None, f"syncbn: SKIP on {device.type}: torch says '{e}'"
        return None, "syncbn: SKIP: ran on CPU without error; this torch changed, check it"

    def rows(r: int) -> torch.Tensor:  # rank r's batch: (8, 4), shifted by r
        g = torch.Generator().manual_seed(r)
        x = torch.randn(8, 4, generator=g)  # host: a CPU generator, any rank rebuilds rank r's rows
        return (x + r).to(device)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4))).to(device)
    model = DDP(net)
    out = model(rows(rank))  # statistics all-reduced over the ranks' batches
    # the reference: one plain BatchNorm over the global batch, every rank's rows stacked
    full = nn.BatchNorm1d(4).to(device)(torch.cat([rows(r) for r in range(world)]))
    ok = torch.allclose(out, full[8 * rank : 8 * (rank + 1)], rtol=1e-4, atol=1e-5)
    return ok, f"syncbn: outputs equal one BatchNorm over the global batch: {'yes' if ok else 'NO'}"


def part_compile(device, rank: int) -> tuple[bool, str]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(device)
    eager = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(device)
    eager.load_state_dict(net.state_dict())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).to(device)
    t0 = time.perf_counter()
    compiled = torch.compile(DDP(net))
    compiled(x).square().mean().backward()
    seconds = time.perf_counter() - t0
    # keep the wrapper in a name: in `DDP(m)(x).sum().backward()` the DDP object, and with it the
    # Reducer and its hooks, is freed before backward runs, and nothing is all-reduced (tried)
    reference = DDP(eager)
    reference(x).square().mean().backward()
    local = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(device)
    local.load_state_dict(eager.state_dict())
    local(x).square().mean().backward()  # this rank's own gradient: what a missed sync leaves
    pairs = list(zip(net.parameters(), eager.parameters(), local.parameters()))
    ok = all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6) for p, q, _ in pairs) and any(
        not torch.allclose(q.grad, r.grad) for _, q, r in pairs
    )  # equal to eager DDP, and different from the unsynchronised gradient
    return ok, (
        f"compile: torch.compile(DDP(model)) gradients equal eager DDP's (rtol 1e-5): "
        f"{'yes' if ok else 'NO'}; first step {seconds:.1f} s (compilation included); "
        f"torch._dynamo.config.optimize_ddp = {torch._dynamo.config.optimize_ddp}"
    )


def main() -> None:
    cfg = dtl_config.parse(Config)  # bad input: one line, before any process group
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir)
    if info.world_size < 2:
        # every part compares ranks (buffers that differ, batches that run out, statistics and
        # gradients that only a sync makes equal): on one rank each claim is empty. A skip,
        # said as one: the tour and the tests show SKIP, never PASS
        dtl_dist.print0(
            f"{SKIP_PREFIX} needs 2 ranks (world size is 1): every part of day17 beyond "
            f"compares what the ranks hold ({info.backend}, {info.device})"
        )
        dtl_dist.cleanup()
        return
    parts = PARTS if cfg.part == "all" else (cfg.part,)
    results = {}
    for part in parts:
        if part == "buffers":
            results[part] = part_buffers(info.device, info.rank)
        elif part == "join":
            results[part] = part_join(info.device, info.rank, info.world_size, cfg.lr)
        elif part == "syncbn":
            results[part] = part_syncbn(info.device, info.rank, info.world_size)
        else:
            results[part] = part_compile(info.device, info.rank)
        dtl_dist.print0(results[part][1])
    passed = [p for p, (ok, _) in results.items() if ok]
    skipped = [p for p, (ok, _) in results.items() if ok is None]
    failed = [p for p, (ok, _) in results.items() if ok is False]
    dtl_dist.print0(
        f"summary: day17 beyond on {info.world_size} ranks: {len(passed)} checked ok "
        f"({', '.join(passed) or '-'}), skipped {skipped or '-'}, failed {failed or '-'}"
    )
    dtl_dist.finish(not failed)


if __name__ == "__main__":
    main()
