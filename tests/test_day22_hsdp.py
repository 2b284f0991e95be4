"""Day 22: HSDP's planted twin. The registered `hsdp` line (train_hsdp.py at replicate 2 x shard 2
on 4 ranks) checks the real thing: 3 AdamW steps of `tiny` against the one-process GPT (losses,
gradient norms, parameters) and, on every rank, the state held and the ring bytes of the last
step on each mesh axis equal to hsdp.py's formulas, to the byte. Here the same run with
apply_hsdp handing FSDP2 a 1-D mesh of every rank (plain FSDP over 4: nothing replicated, the
gathers on the world group) trains the same model but fails those counts: the check tells the
layouts apart.
"""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from day22_megatron import hsdp, train_hsdp
from dtl import dist as dtl_dist
from dtl.testing import run_distributed


def _planted() -> dict:
    info = dtl_dist.init()
    cfg = train_hsdp.Config(replicas=2, check=False)
    true = hsdp.apply_hsdp

    def one_dimensional(gpt, mesh):  # the 2-D mesh ignored: FSDP over the world
        return true(gpt, DeviceMesh.from_group(dist.group.WORLD, info.device.type))

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(hsdp, "apply_hsdp", one_dimensional)
        run = train_hsdp.run(cfg, info.device)
    want = train_hsdp.formulas_of(cfg, run)
    return dict(got=dict(state=run["state"], **run["sent"]), want=want)


def test_a_one_dimensional_mesh_under_the_2x2_config_fails_the_formulas():
    for rank, r in enumerate(run_distributed(_planted, world_size=4, timeout_s=180)):
        assert r["got"] != r["want"], rank  # the same model, not the same layout
