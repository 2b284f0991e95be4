"""Day 19: tensor-parallel layers and the TP GPT vs the dense model, megatron-core and torch's
parallelize_module; communication and activation memory vs the formulas.

Reference: the dense module in one process with the same weights (dtl.model's seeded init, or
a seeded generator for the layer checks). fp32. Tolerances: layer outputs and gradients
rtol 1e-5, atol 1e-6 (a sum split over t ranks, rounded in another order); the GPT after K
steps: losses rtol 1e-5, parameters atol 1e-6 under SGD (which shows any gradient error, a
factor of t included) and 1e-4 under AdamW (lr 1e-2, eps 1e-6): Adam moves an element whose
gradient is ~eps by up to lr * delta / (4 eps) = 2500 delta for a rounding difference delta, and
at t = 4 one element in 4096 had delta ~ 1e-8 (2.5e-5 measured).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from day19_tp import formulas
from day19_tp.activations import korthikanti_bytes, layer_terms, saved_activation_bytes
from day19_tp.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPError,
    VocabParallelEmbedding,
    apply_tp,
    check_tp,
    full_tensors,
    tp_loss,
    vocab_parallel_cross_entropy,
)
from dtl.comm import CommCounter
from dtl.grid import ParallelGrid
from dtl.model import GPT, GPTConfig, loss_fn
from dtl.reference import reference_train
from dtl.testing import run_distributed, script_error

TOL = dict(rtol=1e-5, atol=1e-6)
CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=250, bias=False)
B, T, K = 2, 16, 3
ACT = dict(s=32, b=2, h=64, a=4)  # the block whose saved activations are measured


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- what each rank runs ------------------------------------------------------------------------


def _layers(grid):
    """Column, row, embedding and loss on this rank, from dense tensors drawn from fixed seeds."""
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
    # the loss: 11 real words padded to 12 columns, two ignored targets
    logits = _rand(6, 12, seed=11).chunk(t, -1)[r].clone().requires_grad_()
    target = torch.tensor([0, 10, -100, 5, 7, -100])
    loss = vocab_parallel_cross_entropy(logits, target, g, vocab_size=11)
    loss.backward()
    out["ce"] = (loss.detach(), logits.grad)
    return out


def _train_gpt(grid, opt_name):
    """K steps of the TP GPT (padded vocabulary where needed); the first step's gradients, the
    last step's TP traffic, and the parameters at the end, all re-assembled."""
    gpt = apply_tp(GPT(CFG, seed=0), grid, pad_vocab=True)
    model = gpt
    if grid.dp_size > 1:
        model = nn.parallel.DistributedDataParallel(gpt, process_group=grid.dp_group)
    opt = _optimizer(opt_name, model.parameters())
    losses, grads = [], None
    for step in range(K):
        x, y = _batch(step, grid.dp_rank, grid.dp_size)
        with CommCounter(group=grid.tp_group) as comm:
            loss = tp_loss(gpt, model(x), y)
            loss.backward()
        if step == 0:
            grads = full_tensors(gpt, grads=True)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=grid.dp_group)
        losses.append(mean.item() / grid.dp_size)
    return dict(
        losses=losses,
        grads=grads,
        params=full_tensors(gpt),
        calls=comm.calls["all_reduce"],
        ring=comm.ring_bytes_per_rank(),
        n_params=sum(p.numel() for p in gpt.parameters()),
    )


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def _batch(step, dp_rank=0, dp_size=1):
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(0, CFG.vocab_size, (B * dp_size, T + 1), generator=g)
    mine = rows[dp_rank * B : (dp_rank + 1) * B]
    return mine[:, :-1], mine[:, 1:]


def _activations(grid):
    """Saved-for-backward bytes of one TP block, fused and naive attention."""
    from dtl.model import naive_attention

    s, b, h, a = ACT["s"], ACT["b"], ACT["h"], ACT["a"]
    cfg = GPTConfig(n_layer=1, n_head=a, n_embd=h, block_size=s, vocab_size=256)
    out = {}
    for fused in (True, False):
        gpt = apply_tp(GPT(cfg, seed=0), grid)
        if not fused:
            gpt.set_attention(naive_attention)
        x = _rand(b, s, h, seed=12).requires_grad_()
        out[fused], _ = saved_activation_bytes(gpt.blocks["0"], x)
    return out


def _block_traffic(grid):
    """One block's TP all-reduces, forward and backward counted apart: (calls, bytes) each."""
    gpt = apply_tp(GPT(CFG, seed=0), grid, pad_vocab=True)
    x = _rand(B, T, CFG.n_embd, seed=14).requires_grad_()
    with CommCounter(group=grid.tp_group) as fwd:
        y = gpt.blocks["0"](x)
    with CommCounter(group=grid.tp_group) as bwd:
        y.sum().backward()
    return [(c.calls["all_reduce"], c.bytes["all_reduce"]) for c in (fwd, bwd)]


def _world_body(tp, dp):
    grid = ParallelGrid(tp=tp, dp=dp)
    out = {
        "layers": _layers(grid),
        "activations": _activations(grid),
        "block": _block_traffic(grid),
    }
    for name in ("sgd", "adamw"):
        out[name] = _train_gpt(grid, name)
    if dp == 1:
        out["megatron"] = _megatron_layers(grid)
        out["dtensor"] = _parallelize_module_mlp(grid)
    return out


@pytest.fixture(scope="module", params=[(2, 1), (4, 1), (2, 2)], ids=["tp2", "tp4", "tp2dp2"])
def world(request):
    tp, dp = request.param
    return tp, dp, run_distributed(_world_body, tp, dp, world_size=tp * dp, timeout_s=240)


# --- each layer against its dense twin ------------------------------------------------------------


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
    logits = _rand(6, 12, seed=11)[:, :11].clone().requires_grad_()
    loss = F.cross_entropy(logits, torch.tensor([0, 10, -100, 5, 7, -100]), ignore_index=-100)
    loss.backward()
    out["ce"] = (loss.detach(), logits.grad)
    return out


def test_each_parallel_layer_equals_the_dense_layer_forward_and_backward(world):
    tp, dp, ranks = world
    dense = _dense_layers()
    for r, res in enumerate(ranks[:tp]):  # the first dp replica's TP ranks
        L = res["layers"]
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


def test_vocab_parallel_cross_entropy_equals_f_cross_entropy_with_ignore_index_and_padding(world):
    tp, _, ranks = world
    loss0, grad0 = _dense_layers()["ce"]
    full_grad = torch.cat([grad0, torch.zeros(6, 1)], dim=1)  # the padded column gets nothing
    for r, res in enumerate(ranks[:tp]):
        loss, grad = res["layers"]["ce"]
        torch.testing.assert_close(loss, loss0, **TOL)
        torch.testing.assert_close(grad, full_grad.chunk(tp, -1)[r], **TOL)


# --- the whole GPT ------------------------------------------------------------------------------


def _dense_run(opt_name, dp):
    gpt = GPT(CFG, seed=0)
    loss_fn(gpt(_global_batch(0, dp)[0]), _global_batch(0, dp)[1]).backward()
    grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt = GPT(CFG, seed=0)
    opt = _optimizer(opt_name, gpt.parameters())
    losses = reference_train(gpt, lambda s: _global_batch(s, dp), opt, K)
    return losses, grads, {n: p.detach() for n, p in gpt.named_parameters()}


def _global_batch(step, dp):
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(0, CFG.vocab_size, (B * dp, T + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def test_tp_gpt_loss_gradients_and_parameters_after_k_steps_equal_the_dense_model(world):
    tp, dp, ranks = world
    for opt_name, atol in (("sgd", 1e-6), ("adamw", 1e-4)):
        losses, grads, params = _dense_run(opt_name, dp)
        for res in ranks:
            got = res[opt_name]
            torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=0)
            for name in params:
                torch.testing.assert_close(
                    got["grads"][name], grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}"
                )
                torch.testing.assert_close(
                    got["params"][name],
                    params[name],
                    rtol=1e-5,
                    atol=atol,
                    msg=lambda m, n=name: f"{n}: {m}",
                )


def _fp64_tp_gpt():
    grid = ParallelGrid(tp=2)
    gpt = apply_tp(GPT(CFG, seed=0).double(), grid, pad_vocab=True)
    opt = _optimizer("adamw", gpt.parameters())
    losses = []
    for step in range(K):
        x, y = _batch(step)
        loss = tp_loss(gpt, gpt(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_tensors(gpt)


def test_tp_gpt_in_fp64_equals_the_dense_model_to_1e_10():
    """In fp64 only the summation order differs: 1e-10, where fp32 allows 1e-5. The vocab-parallel
    cross-entropy upcasts to at least fp32; a `.float()` there cut fp64 to 1e-7."""
    gpt = GPT(CFG, seed=0).double()
    opt = _optimizer("adamw", gpt.parameters())
    ref = reference_train(gpt, lambda s: _global_batch(s, 1), opt, K)
    losses, params = run_distributed(_fp64_tp_gpt, world_size=2)[0]
    torch.testing.assert_close(losses, ref, rtol=1e-10, atol=0)
    for name, p in gpt.named_parameters():
        assert params[name].dtype == torch.float64, name
        torch.testing.assert_close(params[name], p.detach(), rtol=0, atol=1e-10, msg=name)


def test_tp_traffic_per_step_is_4_all_reduces_per_block_plus_embedding_head_and_loss(world):
    tp, _, ranks = world
    for res in ranks:  # one block: g after attention and MLP forward, f before both backward
        (fwd_calls, fwd_bytes), (bwd_calls, bwd_bytes) = res["block"]
        assert (fwd_calls, bwd_calls) == (2, 2)
        assert fwd_bytes == bwd_bytes == 2 * B * T * CFG.n_embd * 4
    tokens = B * T
    terms = formulas.comm_elements_per_step(CFG, tokens)
    for res in ranks:
        got = res["sgd"]
        assert got["calls"] == 4 * CFG.n_layer + 2 + 3
        assert got["ring"] == formulas.ring_bytes(sum(terms.values()), 4, tp)


def test_parameters_per_rank_equal_the_formula(world):
    tp, _, ranks = world
    assert formulas.params_per_rank(CFG, 1) == sum(p.numel() for p in GPT(CFG).parameters())
    for res in ranks:  # at tp 4 the 250 words are padded to 252: 63 rows per rank
        assert res["sgd"]["n_params"] == formulas.params_per_rank(CFG, tp)


# --- activations --------------------------------------------------------------------------------


def _dense_activations():
    """t = 1: the dense block itself, in this process."""
    from dtl.model import naive_attention

    s, b, h, a = ACT["s"], ACT["b"], ACT["h"], ACT["a"]
    out = {}
    for fused in (True, False):
        gpt = GPT(GPTConfig(n_layer=1, n_head=a, n_embd=h, block_size=s, vocab_size=256), seed=0)
        if not fused:
            gpt.set_attention(naive_attention)
        out[fused], _ = saved_activation_bytes(
            gpt.blocks["0"], _rand(b, s, h, seed=12).requires_grad_()
        )
    return out


def test_saved_activations_per_rank_equal_the_term_by_term_formula_for_t_1_2_4(world):
    tp, dp, ranks = world
    s, b, h, a = ACT["s"], ACT["b"], ACT["h"], ACT["a"]
    cases = {tp: ranks[0]["activations"]}
    if (tp, dp) == (2, 1):
        cases[1] = _dense_activations()
    for t, got in cases.items():
        for fused in (True, False):
            pred = sum(layer_terms(s, b, h, a, t, 4, False, fused).values())
            assert got[fused] == pred, (t, fused, got[fused], pred)  # to the byte, as the notes
        # the paper's formula counts 16-bit values, dropout masks and the a·s² scores: with
        # 4-byte values, no dropout and the fused kernel, ours is 2 x (its s·b·h terms) minus
        # what the kernel and dropout 0 remove, so it is the smaller of the two here
        assert got[True] < 2 * korthikanti_bytes(s, b, h, a, t)


# --- megatron-core and torch's parallelize_module on the same weights -------------------------


def _megatron_layers(grid):
    """megatron-core's ColumnParallelLinear -> RowParallelLinear, VocabParallelEmbedding and
    vocab_parallel_cross_entropy with our shards loaded; ours on the same inputs."""
    from megatron.core import tensor_parallel as mtp

    import dtl.megatron as dm

    g, t, r = grid.tp_group, grid.tp_size, grid.tp_rank
    w1, w2, emb_w = _rand(16, 8, seed=2), _rand(8, 16, seed=5), _rand(12, 4, seed=9)
    x = _rand(5, 3, 8, seed=1)  # megatron's layout: [s, b, h]
    ids = torch.tensor([[0, 5, 11], [7, 2, 9]])
    logits_full = _rand(5, 3, 12, seed=11)
    target = torch.randint(0, 12, (5, 3), generator=torch.Generator().manual_seed(3))
    out = {}
    dm.init_parallel_state(grid)
    try:
        with dm.cpu_shim():
            mtp.model_parallel_cuda_manual_seed(1234)
            cfg = dm.model_parallel_config(grid)
            init = nn.init.zeros_
            fc1 = mtp.ColumnParallelLinear(
                8, 16, config=cfg, init_method=init, bias=False, gather_output=False
            )
            fc2 = mtp.RowParallelLinear(
                16,
                8,
                config=cfg,
                init_method=init,
                bias=False,
                input_is_parallel=True,
                skip_bias_add=False,
            )
            emb = mtp.VocabParallelEmbedding(12, 4, init_method=init, config=cfg)
            with torch.no_grad():
                fc1.weight.copy_(w1.chunk(t)[r])
                fc2.weight.copy_(w2.chunk(t, dim=1)[r])
                emb.weight.copy_(emb_w.chunk(t)[r])
            xm = x.clone().requires_grad_()
            y = fc2(F.gelu(fc1(xm)[0]))[0]
            y.sum().backward()
            logits = logits_full.chunk(t, -1)[r].clone().requires_grad_()
            ce = mtp.vocab_parallel_cross_entropy(logits, target).mean()
            ce.backward()
            out["megatron"] = dict(
                y=y.detach(),
                dx=xm.grad,
                dw1=fc1.weight.grad,
                dw2=fc2.weight.grad,
                emb=emb(ids).detach(),
                ce=ce.detach(),
                dlogits=logits.grad,
            )
    finally:
        dm.destroy_parallel_state()
    ours1, ours2 = (
        ColumnParallelLinear(8, 16, g, bias=False),
        RowParallelLinear(16, 8, g, bias=False),
    )
    ours_emb = VocabParallelEmbedding(12, 4, g)
    with torch.no_grad():
        ours1.weight.copy_(w1.chunk(t)[r])
        ours2.weight.copy_(w2.chunk(t, dim=1)[r])
        ours_emb.weight.copy_(emb_w.chunk(t)[r])
    xo = x.clone().requires_grad_()
    y = ours2(F.gelu(ours1(xo)))
    y.sum().backward()
    logits = logits_full.chunk(t, -1)[r].clone().requires_grad_()
    ce = vocab_parallel_cross_entropy(logits, target, g)
    ce.backward()
    out["ours"] = dict(
        y=y.detach(),
        dx=xo.grad,
        dw1=ours1.weight.grad,
        dw2=ours2.weight.grad,
        emb=ours_emb(ids).detach(),
        ce=ce.detach(),
        dlogits=logits.grad,
    )
    return out


@pytest.mark.parametrize("world", [(2, 1), (4, 1)], ids=["tp2", "tp4"], indirect=True)
def test_megatron_core_layers_give_the_same_outputs_and_gradients_as_ours(world):
    tp, dp, ranks = world
    for res in ranks:
        m, o = res["megatron"]["megatron"], res["megatron"]["ours"]
        for key in m:
            torch.testing.assert_close(o[key], m[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")


def _parallelize_module_mlp(grid):
    """torch's DTensor TP: ColwiseParallel c_fc, RowwiseParallel c_proj on a 1-D mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dtl.model import MLP

    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=8, block_size=8, vocab_size=16)
    torch.manual_seed(0)
    dense = MLP(cfg)
    x = _rand(2, 3, 8, seed=13)
    mesh = DeviceMesh.from_group(grid.tp_group, "cpu")
    theirs = parallelize_module(
        MLP(cfg), mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
    )
    ours = MLP(cfg)
    ours.c_fc = ColumnParallelLinear(8, 32, grid.tp_group)
    ours.c_proj = RowParallelLinear(32, 8, grid.tp_group)
    t, r = grid.tp_size, grid.tp_rank
    with torch.no_grad():
        for mod in (theirs,):
            for name, p in mod.named_parameters():
                full = dict(dense.named_parameters())[name]
                p.copy_(_distribute_like(full, p))
        ours.c_fc.weight.copy_(dense.c_fc.weight.chunk(t)[r])
        ours.c_fc.bias.copy_(dense.c_fc.bias.chunk(t)[r])
        ours.c_proj.weight.copy_(dense.c_proj.weight.chunk(t, dim=1)[r])
        ours.c_proj.bias.copy_(dense.c_proj.bias)
    out = {}
    for name, mod in (("theirs", theirs), ("ours", ours)):
        xi = x.clone().requires_grad_()
        y = mod(xi)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        y.sum().backward()
        w = mod.c_fc.weight.grad
        out[name] = dict(
            y=y.detach(), dx=xi.grad, dw_fc=w.to_local() if hasattr(w, "to_local") else w
        )
    return out


def _distribute_like(full, dtensor_param):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach(), dtensor_param.device_mesh, dtensor_param.placements)


@pytest.mark.parametrize("world", [(2, 1), (4, 1)], ids=["tp2", "tp4"], indirect=True)
def test_torch_parallelize_module_colwise_rowwise_equals_ours(world):
    tp, dp, ranks = world
    for res in ranks:
        d = res["dtensor"]
        for key in d["ours"]:
            torch.testing.assert_close(
                d["ours"][key], d["theirs"][key], **TOL, msg=lambda m, k=key: f"{k}: {m}"
            )


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


# --- composing with day 18: TP inside, ZeRO over the data-parallel ranks -----------------------


def _tp_then_zero(stage):
    """apply_tp (tp 2), then day 18's apply_zero over the dp groups (dp 2): K SGD steps."""
    from day18_zero.zero import apply_zero

    grid = ParallelGrid(tp=2, dp=2)
    gpt = apply_tp(GPT(CFG, seed=0), grid, pad_vocab=True)
    model = apply_zero(gpt, grid, stage, lambda ps: _optimizer("sgd", ps), bucket_cap_mb=0.01)
    for step in range(K):
        x, y = _batch(step, grid.dp_rank, grid.dp_size)
        model.zero_grad()
        tp_loss(gpt, model(x), y).backward()
        model.step()
    full = model.full_parameters()  # this TP rank's shards, gathered over dp
    for name, p in gpt.named_parameters():  # put them back, then re-assemble over TP
        p.data = full[name].view(p.shape) if p.numel() else full[name]
    return full_tensors(gpt)


@pytest.mark.parametrize("stage", [1, 3])
def test_apply_tp_then_apply_zero_equals_the_dense_model(stage):
    ranks = run_distributed(_tp_then_zero, stage, world_size=4, timeout_s=180)
    _, _, params = _dense_run("sgd", 2)
    for res in ranks:
        for name, ref in params.items():
            torch.testing.assert_close(
                res[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
