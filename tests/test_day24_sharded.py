"""Day 24: a checkpoint of a model-parallel layout (day 22's stack: TP, PP, TP x PP, with DP; an
MoE's experts over EP) loads at another layout bit for bit (day24_checkpoint/sharded.py).

One 4-rank spawn saves each source layout after two AdamW steps and loads it into a fresh stack
at the target layout. The reference is the one-process view of the state: every parameter and
every AdamW moment as the full tensor (TP pieces gathered, the stages' keys merged), which must
be equal, bit for bit, before the save and after the load. Both views go through the same
description of the state, so a layout saved wrong (a fused QKV as one ordinary block) would
still read back equal: the loaded model is also run on a fixed batch, its logits against the
source's weights in one process and its loss against the source layout's own loss. Then a shard
of a TP checkpoint is damaged and the load is refused in one line, before DCP reads anything.
"""

import os

import pytest
import torch

from day22_megatron.ep import data_rank
from day22_megatron.layouts import Layout
from day22_megatron.stack import build_stack, forward_backward, grid_for, sync_gradients
from day22_megatron.stack import full_state as dense_state
from day24_checkpoint import ckpt
from day24_checkpoint.sharded import StackState, full_state
from dtl.model import GPT, loss_fn, preset
from dtl.testing import run_distributed

DENSE, MOE = preset("tiny-nobias"), preset("tiny-moe")
B, T, K = 2, 16, 2  # micro-batch, tokens, micro-batches per step
PAIRS = {  # source layout -> target layout, on 4 ranks, and the model
    "tp2-pp2 to dp4": (Layout(tp=2, pp=2), Layout(dp=4), DENSE),  # tp 2 -> 1 and pp 2 -> 1
    "pp2-dp2 to tp2-dp2": (Layout(pp=2, dp=2), Layout(tp=2, dp=2), DENSE),  # pp 2 -> 1, tp 1 -> 2
    "tp2-dp2 to dp4": (Layout(tp=2, dp=2), Layout(dp=4), DENSE),
    "ep2-dp4 to dp4": (Layout(dp=4, ep=2), Layout(dp=4), MOE),  # each expert a key: ep 2 -> 1
}


def _stack(lay: Layout, cfg):
    return build_stack(cfg, grid_for(lay), micro_batch_size=B, microbatches=K, seq_len=T, seed=0)


def _train(stack, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + data_rank(stack.grid)[0])
        x = torch.randint(0, stack.gpt.cfg.vocab_size, (K, B, T + 1), generator=g)
        forward_backward(stack, [(x[i, :, :-1], x[i, :, 1:]) for i in range(K)])
        sync_gradients(stack)
        stack.optimizer.step()
        stack.optimizer.zero_grad(set_to_none=True)


def _fixed_batch():
    """The same K micro-batches on every rank and at every layout (not the training data)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, DENSE.vocab_size, (K, B, T + 1), generator=g)
    return [(x[i, :, :-1], x[i, :, 1:]) for i in range(K)]


def _loss(stack) -> float:
    """The stack's own mean loss on the fixed batch, at its layout (the last pipeline stage knows
    it: gathered over the pipeline group); the gradients it leaves are dropped."""
    loss = forward_backward(stack, _fixed_batch())
    stack.optimizer.zero_grad(set_to_none=True)
    known: list = [None] * stack.grid.pp_size
    torch.distributed.all_gather_object(known, loss, group=stack.grid.pp_group)
    return next(v for v in known if v is not None)


def _dense(stack) -> tuple[torch.Tensor, float]:
    """The one-process GPT with the stack's weights (day 22's gather, which knows the QKV's
    [Q_r; K_r; V_r] layout, not day 24's description): its logits on the fixed batch's first
    micro-batch, and its mean loss over the K micro-batches."""
    gpt = GPT(stack.gpt.cfg, seed=1)
    gpt.load_state_dict(dense_state(stack))
    with torch.no_grad():
        losses = [loss_fn(gpt(x), y).item() for x, y in _fixed_batch()]
        return gpt(_fixed_batch()[0][0]), sum(losses) / K


def _logits(stack) -> torch.Tensor:
    """The stack's own logits at its layout (pp = 1): TP's vocabulary pieces gathered."""
    assert stack.pipeline is None, "the targets have pp = 1: their logits are on every rank"
    with torch.no_grad():
        local = stack.gpt(_fixed_batch()[0][0])
    if stack.grid.tp_size == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(stack.grid.tp_size)]
    torch.distributed.all_gather(pieces, local.contiguous(), group=stack.grid.tp_group)
    return torch.cat(pieces, dim=-1)[..., : stack.gpt.cfg.vocab_size]


def _save_and_reshard(tmp):
    out = {}
    for name, (src, dst, cfg) in PAIRS.items():
        folder = os.path.join(tmp, name.replace(" ", "_"))
        saved = StackState(_stack(src, cfg), ckpt.Progress(step=2))
        _train(saved.stack, 2)
        ckpt.Checkpointer(folder, keep=1).save(saved, 2)
        want = full_state(saved)
        (want_logits, dense_loss), want_loss = _dense(saved.stack), _loss(saved.stack)
        loaded = StackState(_stack(dst, cfg))
        fresh_logits = _logits(loaded.stack)  # before the load: the run must change them
        step = ckpt.Checkpointer(folder, keep=1).load(loaded)
        got = full_state(loaded)
        got_logits, got_loss = _logits(loaded.stack), _loss(loaded.stack)
        out[name] = dict(
            step=step,
            keys=sorted(got) == sorted(want),
            differ=[k for k in want if k in got and not torch.equal(got[k], want[k])],
            n=len(want),
            folder=folder,
            logits=(got_logits - want_logits).abs().max().item(),
            trained=(fresh_logits - want_logits).abs().max().item(),
            loss=(got_loss, want_loss),
            dense_loss=dense_loss,
        )
    return out


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sharded"))
    return run_distributed(_save_and_reshard, tmp, world_size=4, timeout_s=240)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_a_model_parallel_checkpoint_loads_bit_for_bit_at_another_layout(resharded, pair):
    for rank, res in enumerate(resharded):
        r = res[pair]
        assert r["step"] == 2, (rank, r)
        assert r["keys"], (rank, pair)  # every parameter and moment, once, at both layouts
        assert not r["differ"], (rank, pair, r["differ"][:5])
        # each saved piece: the parameter and its two moments; each parameter: AdamW's step
        cfg = PAIRS[pair][2]
        assert r["n"] == 3 * len(list(_dense_names(cfg))) + len(list(GPT(cfg).parameters()))


@pytest.mark.parametrize("pair", list(PAIRS))
def test_the_resharded_model_computes_the_source_models_logits_and_loss(resharded, pair):
    # Logits: exact at a target tp = 1 (the same dense forward on the same weights); at tp = 2
    # the row-parallel layers sum partial products over the TP ranks, in another order than one
    # process: fp32 rounding (1.2e-7 seen), so 1e-5. Losses (source layout, target layout, one
    # process): PP averages micro-batches and TP sums the softmax over vocabulary pieces in
    # other orders (4e-8 relative seen), so 1e-6 relative. A QKV saved in the wrong layout
    # (heads' rows mixed) moves the logits by ~0.2 but the loss by as little as 8e-6 relative.
    tol = 0.0 if PAIRS[pair][1].tp == 1 else 1e-5
    for rank, res in enumerate(resharded):
        r = res[pair]
        assert r["trained"] > 0.01, (rank, r["trained"])  # the load changed the fresh model
        assert r["logits"] <= tol, (rank, pair, "max |logit difference|", r["logits"])
        got_loss, want_loss = r["loss"]
        assert abs(got_loss - want_loss) <= 1e-6 * want_loss, (rank, pair, r["loss"])
        assert abs(got_loss - r["dense_loss"]) <= 1e-6 * want_loss, (rank, pair, r["dense_loss"])


def _dense_names(cfg):
    """One-process parameter names, the fused QKV counted as its three saved thirds."""
    for name, _ in GPT(cfg, seed=0).named_parameters():
        if ".attn.c_attn." in name:
            yield from (f"{name}.{b}" for b in "qkv")
        else:
            yield name


def test_a_damaged_shard_of_a_tp_checkpoint_is_refused_in_one_line(resharded):
    folder = resharded[0]["tp2-pp2 to dp4"]["folder"]
    path = ckpt.latest(folder)
    shard = next(f for f in sorted(os.listdir(path)) if f.endswith(".distcp"))
    with open(os.path.join(path, shard), "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.verify(path)
    assert "corrupt" in str(err.value) and "\n" not in str(err.value)
