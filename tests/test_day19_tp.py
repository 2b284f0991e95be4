"""Day 19: the f and g operators, each tensor-parallel layer and the vocab-parallel loss against
their dense twins, at tp 2, tp 4 and tp 2 x dp 2; sizes that do not split. The TP GPT against
the dense model, its traffic and its activations: test_day19_tp_training.py; megatron-core and
torch's parallelize_module on the same weights: test_day19_tp_libraries.py.

Reference: the dense operation in one process on tensors drawn from fixed seeds. fp32.
Tolerances: rtol 1e-5, atol 1e-6 (a sum split over t ranks, rounded in another order); what no
rank sums (f's forward, g's backward) is compared exactly. Each check runs its own processes, so
a layer that raises fails its own test and no other.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from day19_tp.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPError,
    VocabParallelEmbedding,
    check_tp,
    vocab_parallel_cross_entropy,
)
from day19_tp.tp_comms import copy_to_tp, reduce_from_tp
from dtl.comm import CommCounter
from dtl.grid import ParallelGrid
from dtl.model import GPTConfig
from dtl.testing import run_distributed, script_error

TOL = dict(rtol=1e-5, atol=1e-6)
EXACT = dict(rtol=0, atol=0)
GRIDS = pytest.mark.parametrize("tp, dp", [(2, 1), (4, 1), (2, 2)], ids=["tp2", "tp4", "tp2dp2"])


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- f and g, alone (day19.f_and_g) -------------------------------------------------------------


def _f_and_g(tp, dp):
    """f and g on this rank's own input and output gradient (seeds 20 + rank, 40 + rank), each
    direction's all-reduces on the TP group counted apart; and the TP group's global ranks."""
    grid = ParallelGrid(tp=tp, dp=dp)
    g, rank = grid.tp_group, dist.get_rank()
    out = {"members": grid.ranks_along("tp")}
    for name, op in (("f", copy_to_tp), ("g", reduce_from_tp)):
        x = _rand(3, 4, seed=20 + rank).requires_grad_()
        with CommCounter(group=g) as fwd:
            y = op(x, g)
        with CommCounter(group=g) as bwd:
            y.backward(_rand(3, 4, seed=40 + rank))
        out[name] = dict(
            y=y.detach().clone(),
            dx=x.grad,
            x_after=x.detach().clone(),
            calls=(fwd.calls["all_reduce"], bwd.calls["all_reduce"]),
        )
    return out


@GRIDS
def test_f_is_identity_forward_and_all_reduce_backward_and_g_the_reverse(tp, dp):
    ranks = run_distributed(_f_and_g, tp, dp, world_size=tp * dp)
    x = [_rand(3, 4, seed=20 + r) for r in range(tp * dp)]
    dy = [_rand(3, 4, seed=40 + r) for r in range(tp * dp)]
    for r, res in enumerate(ranks):
        members, f, g = res["members"], res["f"], res["g"]
        say = lambda m, r=r: f"rank {r}: {m}"  # noqa: E731
        # f: forward hands the input on as it is; backward sums dL/dX over the TP group only
        torch.testing.assert_close(f["y"], x[r], **EXACT, msg=say)
        torch.testing.assert_close(f["dx"], sum(dy[m] for m in members), **TOL, msg=say)
        assert f["calls"] == (0, 1), f"rank {r}: f's all-reduces (forward, backward)"
        # g: forward sums the partial outputs over the TP group; backward hands dL/dY on
        torch.testing.assert_close(g["y"], sum(x[m] for m in members), **TOL, msg=say)
        torch.testing.assert_close(g["dx"], dy[r], **EXACT, msg=say)
        assert g["calls"] == (1, 0), f"rank {r}: g's all-reduces (forward, backward)"
        # the all-reduce works in place: g must sum a copy, never autograd's input
        torch.testing.assert_close(g["x_after"], x[r], **EXACT, msg=say)


# --- each layer against its dense twin (day19.column_row_forward) -------------------------------


def _layers(tp, dp):
    """Column, row and embedding on this rank, from dense tensors drawn from fixed seeds."""
    grid = ParallelGrid(tp=tp, dp=dp)
    g, t, r = grid.tp_group, grid.tp_size, grid.tp_rank
    out = {}
    x, w1, b1 = _rand(3, 5, 8, seed=1), _rand(16, 8, seed=2), _rand(16, seed=3)
    for gather in (False, True):
        col = ColumnParallelLinear(8, 16, g, gather_output=gather)
        with torch.no_grad():
            col.weight.copy_(w1.chunk(t)[r])
            col.bias.copy_(b1.chunk(t)[r])
        xi = x.clone().requires_grad_()
        y = col(xi)
        y.backward(_rand(*y.shape, seed=4) if gather else _rand(3, 5, 16, seed=4).chunk(t, -1)[r])
        out[f"col{gather}"] = (y.detach(), xi.grad, col.weight.grad, col.bias.grad)
    w2, b2 = _rand(8, 16, seed=5), _rand(8, seed=6)
    x2 = _rand(3, 5, 16, seed=7)
    for parallel_in in (True, False):
        row = RowParallelLinear(16, 8, g, input_is_parallel=parallel_in)
        with torch.no_grad():
            row.weight.copy_(w2.chunk(t, dim=1)[r])
            row.bias.copy_(b2)
        xi = (x2.chunk(t, -1)[r] if parallel_in else x2).clone().requires_grad_()
        y = row(xi)
        y.backward(_rand(3, 5, 8, seed=8))
        out[f"row{parallel_in}"] = (y.detach(), xi.grad, row.weight.grad, row.bias.grad)
    emb = VocabParallelEmbedding(12, 4, g)
    with torch.no_grad():
        emb.weight.copy_(_rand(12, 4, seed=9)[emb.lo : emb.hi])
    ids = torch.tensor([[0, 5, 11, 3], [7, 7, 2, 9]])
    e = emb(ids)
    e.backward(_rand(2, 4, 4, seed=10))
    out["emb"] = (e.detach(), emb.weight.grad)
    return out


def _dense_layers():
    out = {}
    x, w1, b1 = _rand(3, 5, 8, seed=1), _rand(16, 8, seed=2), _rand(16, seed=3)
    for gather in (False, True):
        xi, w, bb = (
            x.clone().requires_grad_(),
            w1.clone().requires_grad_(),
            b1.clone().requires_grad_(),
        )
        y = F.linear(xi, w, bb)
        y.backward(_rand(3, 5, 16, seed=4))
        out[f"col{gather}"] = (y.detach(), xi.grad, w.grad, bb.grad)
    w2, b2, x2 = _rand(8, 16, seed=5), _rand(8, seed=6), _rand(3, 5, 16, seed=7)
    xi, w, bb = (
        x2.clone().requires_grad_(),
        w2.clone().requires_grad_(),
        b2.clone().requires_grad_(),
    )
    y = F.linear(xi, w, bb)
    y.backward(_rand(3, 5, 8, seed=8))
    out["row"] = (y.detach(), xi.grad, w.grad, bb.grad)
    emb = _rand(12, 4, seed=9).requires_grad_()
    e = F.embedding(torch.tensor([[0, 5, 11, 3], [7, 7, 2, 9]]), emb)
    e.backward(_rand(2, 4, 4, seed=10))
    out["emb"] = (e.detach(), emb.grad)
    return out


@GRIDS
def test_each_parallel_layer_equals_the_dense_layer_forward_and_backward(tp, dp):
    ranks = run_distributed(_layers, tp, dp, world_size=tp * dp)
    dense = _dense_layers()
    for r, L in enumerate(ranks[:tp]):  # the first dp replica's TP ranks
        # column: my out/t columns (or all, gathered); dX is the full sum; dW, db my rows
        y, dx, dw, db = L["colFalse"]
        y0, dx0, dw0, db0 = dense["colFalse"]
        torch.testing.assert_close(y, y0.chunk(tp, -1)[r], **TOL)
        torch.testing.assert_close(dw, dw0.chunk(tp)[r], **TOL)
        torch.testing.assert_close(db, db0.chunk(tp)[r], **TOL)
        torch.testing.assert_close(dx, dx0, **TOL)  # f's all-reduce in backward
        # gather_output: the full output; backward keeps my slice of its gradient
        y, dx, dw, db = L["colTrue"]
        y0, dx0, dw0, db0 = dense["colTrue"]
        torch.testing.assert_close(y, y0, **TOL)
        torch.testing.assert_close(dx, dx0, **TOL)
        torch.testing.assert_close(dw, dw0.chunk(tp)[r], **TOL)
        torch.testing.assert_close(db, db0.chunk(tp)[r], **TOL)
        # row: the full output after g; dX my slice (or the full input's grad); dW my columns
        y0, dx0, dw0, db0 = dense["row"]
        for parallel_in in (True, False):
            y, dx, dw, db = L[f"row{parallel_in}"]
            torch.testing.assert_close(y, y0, **TOL)
            torch.testing.assert_close(dw, dw0.chunk(tp, dim=1)[r], **TOL)
            torch.testing.assert_close(db, db0, **TOL)
            torch.testing.assert_close(dx, dx0.chunk(tp, -1)[r] if parallel_in else dx0, **TOL)
        e, dw = L["emb"]
        torch.testing.assert_close(e, dense["emb"][0], **TOL)
        torch.testing.assert_close(dw, dense["emb"][1].chunk(tp)[r], **TOL)


# --- the vocab-parallel loss (day19.vocab_parallel_ce) ------------------------------------------


def _loss(tp, dp):
    """The vocab-parallel loss on this rank: 11 real words padded to 12 columns, two ignored
    targets."""
    grid = ParallelGrid(tp=tp, dp=dp)
    g, t, r = grid.tp_group, grid.tp_size, grid.tp_rank
    logits = _rand(6, 12, seed=11).chunk(t, -1)[r].clone().requires_grad_()
    target = torch.tensor([0, 10, -100, 5, 7, -100])
    loss = vocab_parallel_cross_entropy(logits, target, g, vocab_size=11)
    loss.backward()
    return loss.detach(), logits.grad


def _dense_loss():
    logits = _rand(6, 12, seed=11)[:, :11].clone().requires_grad_()
    loss = F.cross_entropy(logits, torch.tensor([0, 10, -100, 5, 7, -100]), ignore_index=-100)
    loss.backward()
    return loss.detach(), logits.grad


@GRIDS
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy_with_ignore_index_and_padding(tp, dp):
    ranks = run_distributed(_loss, tp, dp, world_size=tp * dp)
    loss0, grad0 = _dense_loss()
    full_grad = torch.cat([grad0, torch.zeros(6, 1)], dim=1)  # the padded column gets nothing
    for r, (loss, grad) in enumerate(ranks[:tp]):
        torch.testing.assert_close(loss, loss0, **TOL)
        torch.testing.assert_close(grad, full_grad.chunk(tp, -1)[r], **TOL)


# --- bad input ----------------------------------------------------------------------------------


def test_the_node_table_the_notes_quote_is_what_bench_prints(capsys):
    """`--part=node` (formulas only, no process group) prints the block the README quotes
    under its command, line for line."""
    from day19_tp import bench

    command = "python -m day19_tp.bench --part=node --model=gpt2-124m --batch_size=8 --seq_len=1024"
    bench.main(command.split()[3:])
    printed = capsys.readouterr().out
    with open(os.path.join(os.path.dirname(bench.__file__), "README.md")) as f:
        notes = f.read()
    quoted = notes.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    assert printed == quoted
    assert "0.26-1.80x on NVLink, 2.3-16.2x on one IB port" in printed


def test_sizes_that_do_not_split_over_tp_are_one_line_errors():
    for cfg, tp, pattern in (
        (GPTConfig(n_head=3, n_embd=48), 2, "n_head 3 is not divisible by tp 2"),
        (GPTConfig(n_head=4, n_embd=32, vocab_size=250), 4, "vocab_size 250 is not divisible"),
    ):
        with pytest.raises(TPError, match=pattern) as info:
            check_tp(cfg, tp)
        assert "\n" not in str(info.value)
    check_tp(GPTConfig(n_head=4, n_embd=32, vocab_size=250), 4, pad_vocab=True)  # padding: fine


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--tp=3"], "4", "tp 3 does not divide the world size 4"),
        (["--tp=8"], "8", "n_head 4 is not divisible by tp 8"),
        (["--tp=2", "--model=gpt2-124m"], "2", "pad it to 50258 (pad_vocab=true)"),
    ],
)
def test_train_script_rejects_bad_input_with_one_line_and_exit_2(args, world, message):
    assert message in script_error("day19_tp.train", *args, env={"WORLD_SIZE": world})
