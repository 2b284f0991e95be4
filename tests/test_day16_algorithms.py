"""Day 16: the hand-written ring, tree and double-binary-tree all-reduces return what
dist.all_reduce returns, on 2..8 gloo ranks, and their step/byte counts match the formulas.

What "the same" means, per dtype:
  int64, and float data holding small integers (|sum| <= 64, exact in bf16's 8-bit mantissa):
      bit for bit (torch.equal): every partial sum is exact, so the order of additions is moot.
  random normal floats: the two results add in different orders, so elementwise
      |ours - dist.all_reduce| <= 2 (n-1) u sum_r |x_r|   (u = 2^-24 fp32, 2^-53 fp64, 2^-8 bf16:
      each side's n-1 roundings, Higham, "Accuracy and Stability of Numerical Algorithms" 4.2),
      and every rank holds the same bits.
One spawn of 8 ranks for the ring and one for the trees: world sizes 2..7 run on sub-groups
(disjoint ones side by side), 8 on the whole world; spawning per world size would cost more than
the checks (1-8 s each on 2 cores). The ring's two phases also run alone, on 2, 3 and 4 ranks:
the graders of the exercises day16.ring_reduce_scatter and day16.ring_all_gather.
"""

import pytest
import torch
import torch.distributed as dist

from day16_nccl import algorithms as algo
from day16_nccl import cost_model
from dtl import compat
from dtl.testing import run_distributed

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
SMALL_CHUNK = 48  # bytes: a tree pipeline of many chunks even for small tensors


def _input(numel, dtype, seed, integer):
    g = torch.Generator().manual_seed(seed)
    if integer or dtype == torch.int64:
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _run_all_reduce(name, x, chunk, g):
    fn = algo.ALL_REDUCES[name]
    return fn(x, group=g) if name == "ring" else fn(x, group=g, chunk_bytes=chunk)


def _check_one(name, numel, dtype, integer, chunk, fails, g):
    n, r = dist.get_world_size(g), dist.get_rank(g)
    x = _input(numel, dtype, seed=1000 * r + numel, integer=integer)
    ref, ours = x.clone(), x.clone()
    dist.all_reduce(ref, group=g)  # the built-in: the reference
    stats = _run_all_reduce(name, ours, chunk, g)
    tag = f"{name} n={n} numel={numel} {dtype} {'int' if integer else 'random'}"
    if integer or dtype == torch.int64:
        if not torch.equal(ours, ref):
            fails.append(f"{tag}: not bit-identical to dist.all_reduce")
    else:
        abs_sum = x.double().abs()
        dist.all_reduce(abs_sum, group=g)  # sum_r |x_r|, in fp64
        bound = 2 * (n - 1) * UNIT_ROUNDOFF[dtype] * abs_sum
        excess = ((ours.double() - ref.double()).abs() - bound).max().item()
        if excess > 0:
            fails.append(f"{tag}: exceeds the summation bound by {excess:.3g}")
        everyone = [torch.empty_like(ours) for _ in range(n)]
        dist.all_gather(everyone, ours, group=g)
        if not all(torch.equal(e, everyone[0]) for e in everyone):
            fails.append(f"{tag}: ranks hold different bits")
    elem = x.element_size()
    steps, sent = (
        cost_model.ring_counts(numel, n, elem)
        if name == "ring"
        else cost_model.tree_counts(name, numel, n, elem, chunk)
    )
    if (stats.steps, stats.bytes_sent) != (steps, sent[r]):
        fails.append(
            f"{tag}: counted (steps {stats.steps}, sent {stats.bytes_sent}) but the "
            f"formula says ({steps}, {sent[r]})"
        )
    totals = torch.tensor([stats.bytes_sent, stats.bytes_recv])
    dist.all_reduce(totals, group=g)
    if totals[0] != totals[1]:
        fails.append(f"{tag}: bytes sent {totals[0]} != bytes received {totals[1]} over all ranks")


def _check_ring_reduce_scatter(numel, fails, g):
    """Ring reduce-scatter on its own, against all_reduce and the built-in reduce-scatter."""
    n, r = dist.get_world_size(g), dist.get_rank(g)
    x = _input(numel, torch.float32, seed=r, integer=True)
    full = x.clone()
    dist.all_reduce(full, group=g)
    mine, rs = algo.ring_reduce_scatter(x, group=g)
    c = cost_model.chunk_sizes(numel, n)
    if not torch.equal(mine, full.tensor_split(n)[r]):
        fails.append(f"ring_reduce_scatter n={n} numel={numel}: wrong chunk")
    if (rs.steps, rs.bytes_sent) != (n - 1, (numel - c[r]) * 4):
        fails.append(f"ring_reduce_scatter n={n} numel={numel}: counts {rs}")
    if numel % n == 0:  # the built-in needs equal chunks
        out = torch.empty(numel // n)
        compat.reduce_scatter_single(out, x, group=g)
        if not torch.equal(mine, out):
            fails.append(f"ring_reduce_scatter n={n} numel={numel}: != reduce_scatter_single")


def _check_ring_all_gather(numel, fails, g):
    """Ring all-gather on its own, from chunks of all_reduce's result, against the built-in."""
    n, r = dist.get_world_size(g), dist.get_rank(g)
    full = _input(numel, torch.float32, seed=r, integer=True)
    dist.all_reduce(full, group=g)
    mine = full.tensor_split(n)[r].clone()
    c = cost_model.chunk_sizes(numel, n)
    gathered, ag = algo.ring_all_gather(mine, numel, group=g)
    if not torch.equal(gathered, full):
        fails.append(f"ring_all_gather n={n} numel={numel}: wrong vector")
    if (ag.steps, ag.bytes_sent) != (n - 1, (numel - c[(r + 1) % n]) * 4):
        fails.append(f"ring_all_gather n={n} numel={numel}: counts {ag}")
    if numel % n == 0:  # the built-in needs equal chunks
        out = torch.empty(numel)
        compat.all_gather_single(out, mine, group=g)
        if not torch.equal(gathered, out):
            fails.append(f"ring_all_gather n={n} numel={numel}: != all_gather_single")


def _check_ring_piece(check):
    n, fails = dist.get_world_size(), []
    for numel in (1, n + 1, 1000, 64 * n):  # fewer elements than ranks, uneven, even
        check(numel, fails, None)
    return fails


def _assert_ring_piece(check, world_size):
    for rank, fails in enumerate(run_distributed(_check_ring_piece, check, world_size=world_size)):
        assert not fails, f"rank {rank}: " + "\n".join(fails[:20])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_reduce_scatter_leaves_each_rank_its_chunk_of_the_sum_in_n_minus_1_rounds(world_size):
    # day16.ring_reduce_scatter: rank r ends with chunk r summed over the ranks, and has sent
    # every chunk but its own, once
    _assert_ring_piece(_check_ring_reduce_scatter, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_gather_gives_every_rank_every_chunk_in_n_minus_1_rounds(world_size):
    # day16.ring_all_gather: every rank ends with the whole vector, and has sent every chunk but
    # the one its right neighbour owns, once
    _assert_ring_piece(_check_ring_all_gather, world_size)


def _check_everything(names, g):
    n = dist.get_world_size(g)
    fails, checks = [], 0
    small = sorted({1, max(n - 1, 1), n + 1, 7 * n + 3})  # below, around and above n
    for name in names:
        for dtype in DTYPES:
            for numel in small + [1000]:
                chunk = SMALL_CHUNK if numel < 1000 else 1024  # pipelined: many chunks
                for integer in (True, False) if dtype != torch.int64 else (True,):
                    _check_one(name, numel, dtype, integer, chunk, fails, g)
                    checks += 1
        # 2 MiB of fp32 in NCCL's 512 KiB tree chunks (several chunks, the last one partial),
        # not divisible by n: one dtype, since the chunking does not depend on it
        _check_one(name, 2**19 + 3, DTYPES[0], True, algo.TREE_CHUNK_BYTES, fails, g)
        checks += 1
    return checks, fails


PHASES = [(2, 6), (3, 5), (4, 4), (7,), (8,)]  # group sizes run side by side on 8 ranks


def _check_all_world_sizes(names):
    r, out = dist.get_rank(), {}
    for sizes in PHASES:
        start, mine = 0, None
        for size in sizes:  # new_group is collective: every rank creates every group
            group = dist.new_group(list(range(start, start + size)))
            if start <= r < start + size:
                mine = (size, group)
            start += size
        if mine is not None:
            size, group = mine
            out[size] = _check_everything(names, None if size == 8 else group)
        dist.barrier()
    return out


def _assert_on_2_to_8_ranks(names):
    results = run_distributed(_check_all_world_sizes, names, world_size=8, timeout_s=240)
    seen = set()
    for rank, per_size in enumerate(results):
        for size, (checks, fails) in per_size.items():
            seen.add(size)
            assert checks > 20 * len(names)  # the loops ran
            assert not fails, f"rank {rank} of {size}: " + "\n".join(fails[:20])
    assert seen == set(range(2, 9))


def test_ring_matches_dist_all_reduce_and_counts_on_2_to_8_ranks():
    _assert_on_2_to_8_ranks(["ring"])  # reduce-scatter then all-gather, in place


def test_tree_and_double_tree_match_dist_all_reduce_and_counts_on_2_to_8_ranks():
    _assert_on_2_to_8_ranks(["tree", "dbt"])
