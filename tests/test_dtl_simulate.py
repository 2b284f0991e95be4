"""dtl.simulate: one rank of an N-rank job in this process (a fake process group, fake tensors)
gives the bytes a real gloo run of the same configuration holds and sends, to the byte; and at
N = 64 and 1,024 the formulas at the padded Ψ (day18_zero/scale.py)."""

from __future__ import annotations

import pytest
import torch

from day18_zero import engines, scale
from day18_zero import formulas as zero_formulas
from day22_megatron import at_scale as stack_scale
from day22_megatron import planner
from day22_megatron.layouts import Layout
from dtl.model import GPT, num_params, preset
from dtl.optim import OptimConfig
from dtl.precision import PRECISIONS
from dtl.simulate import SimulateError, fake_world
from dtl.testing import run_distributed

MODEL = preset("tiny")
CASES = [
    (engine, precision) for engine in scale.ENGINES for precision in ("fp32", "bf16")
]  # hand ZeRO 1-3 and FSDP2 (fully_shard, with and without resharding after forward)


def _real_zero():
    """What scale.simulate runs, on real tensors over gloo: two steps, the second counted."""
    out = {}
    for engine, precision in CASES:
        impl, stage = scale.ENGINES[engine]
        gpt = GPT(MODEL, seed=0).to(PRECISIONS[precision].storage)
        trainer = engines.build(impl, stage, gpt, None, OptimConfig(), no_sync=True)
        x = torch.randint(0, MODEL.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
        got = scale.two_steps(trainer, [(x[:, :-1], x[:, 1:])], precision)  # what simulate counts
        out[engine, precision] = _comparable(got)
    return out


def _comparable(got: dict) -> dict:
    return dict(held=dict(got["held"]), padded=got["padded"], sent=got["sent"])


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_zero_and_fsdp2_hold_and_send_what_a_real_gloo_run_does(world):
    real = run_distributed(_real_zero, world_size=world)[0]  # rank 0, as simulated
    for engine, precision in CASES:
        impl, stage = scale.ENGINES[engine]
        got = _comparable(scale.simulate(MODEL, stage, world, precision, impl=impl))
        assert got == real[engine, precision], (engine, precision, got, real[engine, precision])


@pytest.mark.parametrize("world", [256])  # 8 and 64: the launch line (0 B); 1,024: its full run
def test_simulated_zero_and_fsdp2_at_scale_equal_the_padded_formulas(world):
    for engine, precision in CASES:
        impl, stage = scale.ENGINES[engine]
        sim = scale.simulate(MODEL, stage, world, precision, impl=impl)
        want = zero_formulas.model_state_bytes(
            num_params(MODEL), world, sim["formula_stage"], sim["precision"], padded=sim["padded"]
        )
        assert tuple(sim["held"].values()) == (want.params, want.grads, want.optim), engine
        elem = PRECISIONS[precision].storage.itemsize
        assert sim["sent"] == zero_formulas.comm_bytes_per_rank(sim["padded"], world, stage, elem)


def test_fake_world_refuses_a_rank_outside_it_and_leaves_no_group_behind():
    import torch.distributed as dist

    with pytest.raises(SimulateError, match="rank 8 is not in a world of 8"):
        with fake_world(8, rank=8):
            pass
    with fake_world(16, rank=3):
        assert (dist.get_rank(), dist.get_world_size()) == (3, 16)
    assert not dist.is_initialized()


def test_storage_key_tells_fake_tensors_apart_and_a_view_from_its_base_not():
    """dtl.state.storage_key under fake tensors, where every data pointer is 0: two tensors of
    their own get two keys, a view (slice, transpose, reshape, detach) its base's key."""
    from torch._subclasses.fake_tensor import FakeTensor

    from dtl.state import storage_key

    with fake_world(2, rank=0):
        layer = torch.nn.Linear(8, 8)
        a, b = torch.empty(4, 8), torch.empty(4, 8)  # the same shape, dtype and device
        tensors = [layer.weight, layer.bias, a, b]
        assert all(isinstance(t, FakeTensor) for t in tensors)  # the case under test
        keys = [storage_key(t) for t in tensors]
        assert len(set(keys)) == len(tensors), keys
        for base, view in [
            (a, a[1:]), (a, a.t()), (a, a.view(-1)), (b, b[:, 2:5]),
            (layer.weight, layer.weight.detach()), (layer.weight, layer.weight.T),
        ]:  # fmt: skip
            assert storage_key(view) == storage_key(base), view.shape
        assert storage_key(a[1:]) != storage_key(b[1:])


# --- TP and PP: day 22's stack, simulated and real -------------------------------------------

STACK_LAYOUTS = {2: [Layout(tp=2), Layout(pp=2)], 4: [Layout(tp=2, pp=2), Layout(tp=2, dp=2)]}


def _real_stack(world):
    return [stack_scale.measure(MODEL, lay, 2, 2) for lay in STACK_LAYOUTS[world]]


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_tp_and_pp_stack_holds_and_sends_what_a_real_gloo_run_does(world):
    """Rank by rank (every stage, every TP rank): parameters, TP / PP / DP bytes and the state
    of the simulated stack equal a real gloo run's, exactly."""
    real = run_distributed(_real_stack, world, world_size=world)
    for i, lay in enumerate(STACK_LAYOUTS[world]):
        for rank in range(world):
            with fake_world(world, rank):
                got = stack_scale.measure(MODEL, lay, 2, 2)
            assert got == real[rank][i], (lay, rank, got, real[rank][i])


def test_simulated_picks_of_plan_py_hold_its_formulas_at_8_and_64_gpus():
    """params, PP, DP bytes and the state exact; TP is plan.py's layers' term, 8(t-1)/t (L/p)
    s b h x 2 B, plus what plan leaves out, to the byte: the embedding's all-reduce in forward
    on the first stage, the tied head's in backward on the last (2(t-1)/t s b h x 2 B each),
    and on the last the vocab-parallel loss's three all-reduces of s b fp32 numbers."""
    cfg = planner.MODELS["gpt2-124m"]
    rows = []
    for gpus in (8, 64):
        for which, lay, best in stack_scale.picks("gpt2-124m", gpus):
            rows.append((lay, stack_scale.row("gpt2-124m", gpus, which, lay, best, 0)))
    assert {lay.name() for lay, _ in rows} >= {"tp1-pp1-dp8", "tp2-pp1-dp4", "tp1-pp2-dp4"}
    for lay, r in rows:
        for key in ("params", "pp", "dp", "state"):
            assert r[f"{key}_sim"] == r[f"{key}_formula"], (lay, key)
        ring = 2 * (lay.tp - 1) / lay.tp  # an all-reduce's bytes per rank, per byte reduced
        sbh = cfg.block_size * r["b"] * cfg.n_embd * 2  # one bf16 activation
        layers = 4 * ring * (cfg.n_layer // lay.pp) * sbh
        first = ring * sbh if r["stage"] == 0 else 0
        loss = 3 * ring * cfg.block_size * r["b"] * 4  # max, sum of exp, target logit: fp32
        last = ring * sbh + loss if r["stage"] == lay.pp - 1 else 0
        assert r["tp_formula"] == pytest.approx(layers, rel=1e-12), lay
        assert r["tp_sim"] == pytest.approx(layers + first + last, rel=1e-12), lay
