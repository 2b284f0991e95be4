"""Day 15: the world, sub-groups and every collective, each checked against its closed form.

CPU (gloo), any number of processes:
    torchrun --standalone --nproc_per_node=4 -m day15_collectives.collectives
GPUs (NCCL, one process per GPU):
    torchrun --standalone --nproc_per_node=gpu -m day15_collectives.collectives
Two nodes (the same line on each; MASTER = a reachable address of one of them; with the c10d
rendezvous the ranks are assigned at rendezvous, so no --node_rank):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=job1 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 -m day15_collectives.collectives

Environment: OMP_NUM_THREADS=1 (torchrun sets it when unset), TORCH_DISTRIBUTED_DEBUG=DETAIL
(turns a mismatched collective into a readable error), NCCL_DEBUG=INFO (what NCCL chose; day 16).

Every rank r starts from a tensor whose contents are a formula in r, so each result has a closed
form in n = world size: e.g. all_reduce(SUM) of (r + 1) must give n(n + 1)/2 everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtl import config as dtl_config
from dtl import dist as dtl_dist

N_ELEMS = 4  # every tensor below has this many elements per rank: small enough to print


def check_broadcast(device, group=None):
    # before: rank r holds [r, r, r, r]; after: everyone holds the source's [src, src, src, src]
    n, r = dist.get_world_size(group), dist.get_rank(group)
    src_group_rank = n - 1
    t = torch.full((N_ELEMS,), float(r), device=device, dtype=torch.float64)
    dist.broadcast(
        t, src=dist.get_global_rank(group or dist.group.WORLD, src_group_rank), group=group
    )
    return t, torch.full_like(t, float(src_group_rank))


def check_all_reduce_sum(device, group=None):
    # before: rank r holds (r + 1); after: every rank holds 1 + 2 + ... + n = n(n + 1)/2
    n, r = dist.get_world_size(group), dist.get_rank(group)
    t = torch.full((N_ELEMS,), float(r + 1), device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t, torch.full_like(t, n * (n + 1) / 2)


def check_all_reduce_avg(device, group=None):
    # AVG = SUM / n: (n + 1)/2 everywhere (native on NCCL, and on gloo since torch 2.x)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    t = torch.full((N_ELEMS,), float(r + 1), device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    return t, torch.full_like(t, (n + 1) / 2)


def check_all_reduce_max(device, group=None):
    # element i of rank r is (r * i) mod n: the max over ranks has a closed form per element
    n, r = dist.get_world_size(group), dist.get_rank(group)
    i = torch.arange(N_ELEMS, device=device, dtype=torch.float64)
    t = (r * i) % n
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    expected = torch.stack([(k * i) % n for k in range(n)]).amax(dim=0)
    return t, expected


def check_all_gather(device, group=None):
    # before: (N_ELEMS,) per rank holding r; after: (n, N_ELEMS) on every rank, row k holds k
    n, r = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.full((N_ELEMS,), float(r), device=device, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(out, mine, group=group)
    expected = torch.arange(n, device=device, dtype=torch.float64)[:, None].expand(n, N_ELEMS)
    return torch.stack(out), expected


def check_reduce_scatter(device, group=None):
    # before: (n, N_ELEMS) per rank, row j holds r*n + j; after: rank r holds row r summed over
    # ranks: sum_k (k*n + r) = n * n(n - 1)/2 + n*r
    n, r = dist.get_world_size(group), dist.get_rank(group)
    rows = [
        torch.full((N_ELEMS,), float(r * n + j), device=device, dtype=torch.float64)
        for j in range(n)
    ]
    out = torch.empty(N_ELEMS, device=device, dtype=torch.float64)
    dist.reduce_scatter(out, rows, op=dist.ReduceOp.SUM, group=group)
    return out, torch.full_like(out, n * n * (n - 1) / 2 + n * r)


def check_all_reduce_is_reduce_scatter_plus_all_gather(device, group=None):
    # the identity behind ring all-reduce and ZeRO: AR(x) == AG(RS(x)), on random data.
    # Random integers, so that every summation order gives the same bits: with random floats the
    # two paths add in different orders and differ in the last bit (try it: that is a lesson too).
    n, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(r)
    x = torch.randint(-1000, 1000, (n * N_ELEMS,), generator=gen).to(device, torch.float64)
    reduced = x.clone()
    dist.all_reduce(reduced, group=group)  # (n * N_ELEMS,) summed
    shard = torch.empty(N_ELEMS, device=device, dtype=torch.float64)
    dist.reduce_scatter(shard, list(x.chunk(n)), group=group)  # (N_ELEMS,): my summed chunk
    pieces = [torch.empty_like(shard) for _ in range(n)]
    dist.all_gather(pieces, shard, group=group)  # n x (N_ELEMS,) -> the full sum again
    return torch.cat(pieces), reduced


def check_all_to_all(device, group=None):
    # a transpose across ranks: input element j of rank r goes to rank j, slot r.
    # before: rank r holds [r*n + 0, ..., r*n + n-1]
    # after:  rank r holds [0*n + r, ..., (n-1)*n + r]
    n, r = dist.get_world_size(group), dist.get_rank(group)
    inp = torch.arange(n, device=device, dtype=torch.float64) + r * n
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return out, torch.arange(n, device=device, dtype=torch.float64) * n + r


def check_send_recv_ring(device, group=None):
    # point to point: every rank sends its rank to the right neighbour, receives from the left
    n, r = dist.get_world_size(group), dist.get_rank(group)
    g = group or dist.group.WORLD
    mine = torch.full((N_ELEMS,), float(r), device=device, dtype=torch.float64)
    if n == 1:  # a ring of one: gloo cannot send to itself, and the left neighbour is you
        return mine.clone(), mine
    got = torch.empty_like(mine)
    ops = [
        dist.P2POp(dist.isend, mine, dist.get_global_rank(g, (r + 1) % n), group),
        dist.P2POp(dist.irecv, got, dist.get_global_rank(g, (r - 1) % n), group),
    ]
    for work in dist.batch_isend_irecv(ops):  # posted together: no rank waits for another
        work.wait()
    return got, torch.full_like(got, float((r - 1) % n))


CHECKS = {
    "broadcast": check_broadcast,
    "all_reduce(SUM)": check_all_reduce_sum,
    "all_reduce(AVG)": check_all_reduce_avg,
    "all_reduce(MAX)": check_all_reduce_max,
    "all_gather": check_all_gather,
    "reduce_scatter": check_reduce_scatter,
    "AR == RS + AG": check_all_reduce_is_reduce_scatter_plus_all_gather,
    "all_to_all": check_all_to_all,
    "send/recv ring": check_send_recv_ring,
}


def even_odd_groups():
    """Two sub-groups, even and odd global ranks. new_group is collective: all ranks create both."""
    n = dist.get_world_size()
    even = dist.new_group(list(range(0, n, 2)))
    odd = dist.new_group(list(range(1, n, 2))) if n > 1 else None
    return (even if dist.get_rank() % 2 == 0 else odd), (
        "even" if dist.get_rank() % 2 == 0 else "odd"
    )


def run_all(device, sub_groups: bool = True) -> list[tuple[str, bool]]:
    """Every check on the world group, then every check inside this rank's even/odd sub-group."""
    results = []
    for name, check in CHECKS.items():
        got, expected = check(device)
        results.append((name, torch.equal(got, expected)))
    if sub_groups and dist.get_world_size() >= 2:
        sub, label = even_odd_groups()
        for name, check in CHECKS.items():
            got, expected = check(device, group=sub)
            results.append((f"{name} [sub-group]", torch.equal(got, expected)))
    return results


# Measured on torch 2.13 + gloo (see the notes): these fail, and PREMUL_SUM also leaves the group
# out of sync so the next collective times out. This script does not run them.
GLOO_UNSUPPORTED = (
    "ReduceOp.PREMUL_SUM",
    "all_gather or list all_to_all with uneven sizes (all_to_all_single handles uneven splits)",
    "float8",
)


def support_table(backend: str, results: list[tuple[str, bool]]) -> str:
    """What this run executed on `backend`, and whether every rank got the closed form."""
    ops: dict[str, bool] = {}
    for name, ok in results:
        op = name.split(" [")[0]
        ops[op] = ops.get(op, True) and ok
    lines = [
        f"operations run on {backend}: "
        + ", ".join(f"{op} {'ok' if ok else 'FAILED'}" for op, ok in ops.items())
    ]
    if backend == "gloo":
        lines.append("not supported by gloo (not run): " + "; ".join(GLOO_UNSUPPORTED))
    return "\n".join(lines)


@dataclass
class Config:
    sub_groups: bool = True  # also run every check inside the even- and odd-rank sub-groups


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # --help, or a bad key: before any process group
    info = dtl_dist.init()
    rows = dtl_dist.world_table(info)  # all_gather_object: every rank's (rank, local, host, ...)
    dtl_dist.print0(f"world: {info.world_size} processes, backend {info.backend}")
    dtl_dist.print0(f"{'rank':>4} {'local':>5}  {'host':<20} {'device':<8} backend")
    for rank, local, host, device, backend in rows:
        dtl_dist.print0(f"{rank:>4} {local:>5}  {host:<20} {device:<8} {backend}")
    results = run_all(info.device, cfg.sub_groups)
    all_ranks: list = [None] * info.world_size
    dist.all_gather_object(all_ranks, results)  # a check passes only if it passed on every rank
    passed = [all(rank_results[i][1] for rank_results in all_ranks) for i in range(len(results))]
    for (name, _), ok in zip(results, passed):
        dtl_dist.print0(f"  {'ok  ' if ok else 'FAIL'} {name}")
    dtl_dist.print0(support_table(info.backend, [(n, ok) for (n, _), ok in zip(results, passed)]))
    dtl_dist.print0(
        f"summary: collectives {sum(passed)}/{len(passed)} checks passed "
        f"on {info.world_size} ranks ({info.backend})"
        + (", even/odd sub-groups included" if cfg.sub_groups and info.world_size > 1 else "")
    )
    failed = not all(passed)
    dtl_dist.cleanup()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
