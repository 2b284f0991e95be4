"""dtl.comm.CommCounter: calls and bytes per collective, per group, against known volumes."""

import pytest
import torch
import torch.distributed as dist

from dtl import compat
from dtl.comm import BUSBW_FACTOR, CommCounter
from dtl.grid import ParallelGrid
from dtl.testing import run_distributed


def _count_known_volumes():
    n, rank = dist.get_world_size(), dist.get_rank()
    t = torch.ones(1000)  # 4,000 bytes of fp32
    with CommCounter() as comm:
        dist.all_reduce(t)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        dist.all_gather_into_tensor(torch.empty(n * 1000), t)  # S = the gathered 4,000 n
        dist.reduce_scatter_tensor(torch.empty(250), torch.ones(n * 250))  # S = the input
        dist.all_gather([torch.empty(10) for _ in range(n)], torch.ones(10))
        reqs = [
            dist.isend(torch.ones(5, dtype=torch.float64), (rank + 1) % n),
            dist.irecv(torch.empty(5, dtype=torch.float64), (rank - 1) % n),
        ]
        for r in reqs:
            r.wait()
    dist.all_reduce(t)  # outside the context: not counted
    return dict(comm.calls), dict(comm.bytes), comm.ring_bytes_per_rank("all_reduce"), comm.table()


@pytest.mark.parametrize("n", [2, 4])
def test_counter_counts_calls_and_bytes_per_collective(n):
    calls, nbytes, ring_ar, table = run_distributed(_count_known_volumes, world_size=n)[0]
    assert calls == {
        "all_reduce": 2,
        "broadcast": 1,
        "all_gather": 2,
        "reduce_scatter": 1,
        "send": 1,
        "recv": 1,
    }
    assert nbytes == {
        "all_reduce": 8000,
        "broadcast": 4000,
        "all_gather": 4000 * n + 40 * n,
        "reduce_scatter": 1000 * n,
        "send": 40,
        "recv": 40,
    }
    assert ring_ar == pytest.approx(8000 * 2 * (n - 1) / n)  # 2(n-1)/n x S for a ring
    assert "all_reduce" in table and "8,000" in table


def _count_only_the_tp_group():
    grid = ParallelGrid(dp=2, tp=2)
    with CommCounter(group=grid.tp_group) as tp_comm:
        dist.all_reduce(torch.ones(8), group=grid.tp_group)
        dist.all_reduce(torch.ones(8), group=grid.dp_group)
        dist.all_reduce(torch.ones(8))
    return dict(tp_comm.calls), tp_comm.world["all_reduce"]


def test_counter_filters_by_group():
    calls, world = run_distributed(_count_only_the_tp_group, world_size=4)[0]
    assert calls == {"all_reduce": 1} and world == 2


def test_bus_factors_are_the_nccl_tests_ones():
    assert BUSBW_FACTOR["all_reduce"](8) == 2 * 7 / 8
    assert BUSBW_FACTOR["all_gather"](8) == BUSBW_FACTOR["reduce_scatter"](8) == 7 / 8
    assert BUSBW_FACTOR["broadcast"](8) == 1.0


def _count_batched_p2p_and_mixed_groups():
    grid = ParallelGrid(dp=2, tp=2)  # 4 ranks: tp and dp groups of 2
    rank, n = dist.get_rank(), dist.get_world_size()
    with CommCounter() as comm:
        # P2POp checks that op is the real isend/irecv: this must work inside the counter
        ops = [
            dist.P2POp(dist.isend, torch.ones(3), (rank + 1) % n),
            dist.P2POp(dist.irecv, torch.empty(3), (rank - 1) % n),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.all_reduce(torch.ones(100), group=grid.tp_group)  # n = 2: factor 1
        dist.all_reduce(torch.ones(100))  # n = 4: factor 1.5
        compat.all_gather_single(torch.empty(4 * 10), torch.ones(10))
    return dict(comm.calls), dict(comm.bytes), comm.ring_bytes_per_rank("all_reduce")


def test_counter_sees_batched_p2p_and_weights_each_call_by_its_own_group():
    calls, nbytes, ring_ar = run_distributed(_count_batched_p2p_and_mixed_groups, world_size=4)[0]
    assert calls == {"send": 1, "recv": 1, "all_reduce": 2, "all_gather": 1}
    assert nbytes == {"send": 12, "recv": 12, "all_reduce": 800, "all_gather": 160}
    assert ring_ar == pytest.approx(400 * 1.0 + 400 * 1.5)
