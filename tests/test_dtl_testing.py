"""run_distributed: results come back per rank; a failing rank fails fast with its traceback."""

import time

import pytest
import torch
import torch.distributed as dist

from dtl.testing import RankFailed, run_distributed


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _rank1_raises_while_rank0_waits():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 blocks here forever: the harness must not wait for the timeout


def test_run_distributed_returns_each_ranks_result_in_rank_order():
    assert run_distributed(_rank_and_sum, world_size=3) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_a_failing_rank_fails_the_test_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed.*ValueError: boom on rank 1"):
        run_distributed(_rank1_raises_while_rank0_waits, world_size=2, timeout_s=60)
    assert time.monotonic() - start < 20, "the harness waited for the collective timeout"
