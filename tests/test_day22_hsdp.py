"""Day 22: HSDP (FSDP2 on a 2-D replicate x shard mesh) trains like one process, holds the
formula's state per rank, and moves the formula's bytes on each axis; a planted mesh fails.

One 4-rank spawn runs train_hsdp.run twice at replicate 2 x shard 2: 3 AdamW steps of `tiny`
(clipping at 1.0) against the one-process GPT on the same global batches (losses rtol 1e-5,
gradient norms rtol 1e-5, parameters atol 1e-5); its state counted from the live tensors after
the last step, and the ring bytes of the last step on each mesh axis, equal to hsdp.py's
formulas on every rank, to the byte. Planted: apply_hsdp handing FSDP2 a 1-D mesh of every rank
(plain FSDP over 4: nothing replicated, the gathers on the world group): its state and bytes per
axis are not the 2 x 2 formulas'.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from day22_megatron import hsdp, train_hsdp
from dtl import dist as dtl_dist
from dtl.testing import run_distributed


def _runs() -> dict:
    info = dtl_dist.init()
    cfg = train_hsdp.Config(replicas=2, check=False)
    true = hsdp.apply_hsdp

    def one_dimensional(gpt, mesh):  # the 2-D mesh ignored: FSDP over the world
        return true(gpt, DeviceMesh.from_group(dist.group.WORLD, info.device.type))

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(hsdp, "apply_hsdp", one_dimensional)
        planted = train_hsdp.run(cfg, info.device)
    return {"hsdp": train_hsdp.run(cfg, info.device), "planted": planted}


def _counts(run: dict) -> dict:
    return dict(state=run["state"], **run["sent"])


def test_hsdp_trains_like_one_process_and_holds_and_moves_the_formulas_bytes():
    ranks = run_distributed(_runs, world_size=4, timeout_s=180)
    losses, params, norms = train_hsdp.one_process(train_hsdp.Config())
    run = ranks[0]["hsdp"]
    torch.testing.assert_close(run["losses"], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(run["norms"], norms, rtol=1e-5, atol=0)
    for name, p in params.items():
        torch.testing.assert_close(run["full"][name], p.detach(), rtol=0, atol=1e-5, msg=name)
    cfg = train_hsdp.Config(replicas=2)
    for rank, r in enumerate(ranks):  # every rank's counts: each is checked, not rank 0's alone
        want = dict(
            state=hsdp.state_bytes(r["hsdp"]["padded"], 2),
            **hsdp.comm_bytes(r["hsdp"]["padded"], r["hsdp"]["root"], cfg.replicas, 2),
        )
        assert _counts(r["hsdp"]) == want, (rank, _counts(r["hsdp"]), want)
        assert _counts(r["planted"]) != want, rank  # the same numbers, not the same layout
