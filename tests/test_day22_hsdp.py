"""Day 22: HSDP (FSDP2 on a 2-D replicate x shard mesh) trains like one process, holds the
formula's state per rank, and moves the formula's bytes on each axis; a planted mesh fails.

One 4-rank spawn runs train_hsdp.run twice: replicate 2 x shard 2, 3 AdamW steps of `tiny`
(clipping at 1.0) against the one-process GPT on the same global batches (losses rtol 1e-5,
gradient norms rtol 1e-5, parameters atol 1e-5); its state counted from the live tensors after
the last step, and the ring bytes of the last step on each mesh axis, equal to hsdp.py's
formulas on every rank, to the byte. Planted: replicate 4 x shard 1, every rank a replica (an
all-reduce where the shard axis should reduce-scatter): its state and bytes are not the
formula's for 2 x 2.
"""

import torch

from day22_megatron import hsdp, train_hsdp
from dtl import dist as dtl_dist
from dtl.testing import run_distributed


def _runs() -> dict:
    dtl_dist.init()
    cfg = train_hsdp.Config(replicas=2, check=False)
    planted = train_hsdp.Config(replicas=4, check=False)
    return {"hsdp": train_hsdp.run(cfg), "planted": train_hsdp.run(planted)}


def test_hsdp_trains_like_one_process_and_holds_and_moves_the_formulas_bytes():
    ranks = run_distributed(_runs, world_size=4, timeout_s=180)
    losses, params, norms = train_hsdp.one_process(train_hsdp.Config())
    run = ranks[0]["hsdp"]
    torch.testing.assert_close(run["losses"], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(run["norms"], norms, rtol=1e-5, atol=0)
    for name, p in params.items():
        torch.testing.assert_close(run["full"][name], p.detach(), rtol=0, atol=1e-5, msg=name)
    for rank, r in enumerate(ranks):
        got = r["hsdp"]
        assert got["state"] == hsdp.state_bytes(got["padded"], 2), (rank, got["state"])
        assert got["sent"] == hsdp.comm_bytes(got["padded"], got["root"], 2, 2), (rank, got["sent"])
    planted = ranks[0]["planted"]  # the same numbers; all-reduced, not sharded: the counts fail
    assert planted["state"] != hsdp.state_bytes(run["padded"], 2)
    assert planted["sent"] != hsdp.comm_bytes(run["padded"], run["root"], 2, 2)
