"""Day 19: our tensor-parallel layers against megatron-core's (ColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy) and against torch's
DTensor parallelize_module (ColwiseParallel, RowwiseParallel), on the same shards, at tp 2 and 4.

Reference: the library on the same weights and inputs, in the same processes. fp32, rtol 1e-5,
atol 1e-6 (the same sums, rounded in another order). megatron-core is an extra: without it that
comparison skips with the install line.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from day19_tp.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from dtl.grid import ParallelGrid
from dtl.model import GPTConfig
from dtl.testing import needs_extras, run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)
TP = pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4"])


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- megatron-core and torch's parallelize_module on the same weights -------------------------


def _megatron_layers(tp):
    """megatron-core's ColumnParallelLinear -> RowParallelLinear, VocabParallelEmbedding and
    vocab_parallel_cross_entropy with our shards loaded; ours on the same inputs."""
    from megatron.core import tensor_parallel as mtp

    import dtl.megatron as dm

    grid = ParallelGrid(tp=tp)
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


@needs_extras("megatron")
@TP
def test_megatron_core_layers_give_the_same_outputs_and_gradients_as_ours(tp):
    for res in run_distributed(_megatron_layers, tp, world_size=tp):
        m, o = res["megatron"], res["ours"]
        for key in m:
            torch.testing.assert_close(o[key], m[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")


def _parallelize_module_mlp(tp):
    """torch's DTensor TP: ColwiseParallel c_fc, RowwiseParallel c_proj on a 1-D mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dtl.model import MLP

    grid = ParallelGrid(tp=tp)
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


@TP
def test_torch_parallelize_module_colwise_rowwise_equals_ours(tp):
    for d in run_distributed(_parallelize_module_mlp, tp, world_size=tp):
        for key in d["ours"]:
            torch.testing.assert_close(
                d["ours"][key], d["theirs"][key], **TOL, msg=lambda m, k=key: f"{k}: {m}"
            )
