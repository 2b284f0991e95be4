"""dtl.simulate: one rank of an N-rank job in this process (a fake process group, fake tensors)
gives the bytes a real gloo run of the same configuration holds and sends, to the byte; and at
N = 64 and 1,024 the formulas at the padded Ψ (day18_zero/scale.py)."""

from __future__ import annotations

import pytest
import torch

from day18_zero import engines, scale
from day18_zero import formulas as zero_formulas
from dtl.model import GPT, num_params, preset
from dtl.optim import OptimConfig
from dtl.precision import PRECISIONS
from dtl.simulate import SimulateError, fake_world
from dtl.testing import run_distributed

MODEL = preset("tiny")
CASES = [(stage, precision) for stage in (1, 2, 3) for precision in ("fp32", "bf16")]


def _real_hand_zero():
    """What scale.simulate runs, on real tensors over gloo: two steps, the second counted."""
    out = {}
    for stage, precision in CASES:
        gpt = GPT(MODEL, seed=0).to(PRECISIONS[precision].dtype)
        trainer = engines.HandZero(gpt, stage, None, OptimConfig(), no_sync=True)
        x = torch.randint(0, MODEL.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
        got = scale.two_steps(trainer, [(x[:, :-1], x[:, 1:])])  # what simulate() counts
        out[stage, precision] = dict(got, held=dict(got["held"]))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_hand_zero_holds_and_sends_what_a_real_gloo_run_does(world):
    real = run_distributed(_real_hand_zero, world_size=world)[0]  # rank 0, as simulated
    for stage, precision in CASES:
        sim = scale.simulate(MODEL, stage, world, precision)
        got = dict(held=dict(sim["held"]), padded=sim["padded"], sent=sim["sent"])
        assert got == real[stage, precision], (stage, precision, got, real[stage, precision])


@pytest.mark.parametrize("world", [64, 1024])
def test_simulated_hand_zero_at_scale_equals_the_padded_formulas(world):
    for stage, precision in CASES:
        sim = scale.simulate(MODEL, stage, world, precision)
        p = PRECISIONS[precision]
        want = zero_formulas.model_state_bytes(
            num_params(MODEL), world, stage, p, padded=sim["padded"]
        )
        assert tuple(sim["held"].values()) == (want.params, want.grads, want.optim)
        sent = zero_formulas.comm_bytes_per_rank(sim["padded"], world, stage, p.dtype.itemsize)
        assert sim["sent"] == sent


def test_fake_world_refuses_a_rank_outside_it_and_leaves_no_group_behind():
    import torch.distributed as dist

    with pytest.raises(SimulateError, match="rank 8 is not in a world of 8"):
        with fake_world(8, rank=8):
            pass
    with fake_world(16, rank=3):
        assert (dist.get_rank(), dist.get_world_size()) == (3, 16)
    assert not dist.is_initialized()
