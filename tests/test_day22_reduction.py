"""Day 22's stack reads each parameter's reduction axes from its table (dtl.reduction): one step
at cp 2 x tp 2 equals one process with the true table, and a parameter planted with the wrong
axes fails the same comparison, by name.

4 ranks, one spawn, one stack: the step's averaged gradients (full, before clipping) and the
global norm, for the true table and for two plants. Reference: the dtl GPT in one process on the
same global batch; gradients atol 1e-6 and the norm rtol 1e-5, as in test_day22_megatron.py.
"""

import re

import pytest
import torch

from day22_megatron import stack, train_4d
from dtl import dist as dtl_dist
from dtl.data import get_batch, load_corpus
from dtl.grid import ParallelGrid
from dtl.model import GPT, loss_fn, preset
from dtl.testing import run_distributed

T, GBS = 16, 8
# a row-parallel bias: averaged over dp x cp, added after the TP sum so whole on every TP rank
BIAS = "blocks.0.mlp.c_proj.bias"
PLANTS = {  # label -> (parameter, its record's changed fields), None: the true table
    "true table": None,
    # the CP ranks' shares never summed
    f"{BIAS} averaged over dp only": (BIAS, dict(average=("dp",))),
    # counted in the norm on both TP ranks
    f"{BIAS} declared a tp shard": (BIAS, dict(replica=(), shard=("tp",))),
}


def _one_step_per_table():
    """cp 2 x tp 2 (dp 1): step 0's averaged gradients and global norm under each table."""
    info = dtl_dist.init()
    sizes = dict(global_batch_size=GBS, micro_batch_size=1, cp=2, tp=2, seq_len=T, steps=1)
    cfg = train_4d.Config(model="tiny", num_layers=4, **sizes, check=False)
    cfg.validate()
    grid = ParallelGrid(cp=2, tp=2)
    s = stack.build_stack(
        cfg.model_config(), grid, micro_batch_size=1, microbatches=cfg.microbatches, seq_len=T
    )
    corpus, true = load_corpus(tokenizer="byte"), s.reduction
    out = {}
    for label, plant in PLANTS.items():
        s.reduction = true if plant is None else true.replace(plant[0], **plant[1])
        s.optimizer.zero_grad(set_to_none=True)
        stack.forward_backward(s, train_4d.micro_batches(corpus.train, cfg, 0, grid, info.device))
        stack.sync_gradients(s)
        out[label] = dict(norm=stack.global_grad_norm(s), grads=stack.full_state(s, grads=True))
    return out


def _one_process():
    """Step 0's gradients of the one-process GPT on the global batch, and their norm."""
    gpt = GPT(preset("tiny", n_layer=4), seed=0)
    x, y = get_batch(load_corpus(tokenizer="byte").train, T, GBS, seed=0, step=0)
    loss_fn(gpt(x), y).backward()
    norm = torch.stack([p.grad.double().pow(2).sum() for p in gpt.parameters()]).sum().sqrt()
    return {n: p.grad for n, p in gpt.named_parameters(remove_duplicate=False)}, norm.item()


def _check(label, got, reference):
    grads, norm = reference
    assert got["grads"].keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(
            got["grads"][name], grads[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert got["norm"] == pytest.approx(norm, rel=1e-5), (
        f"{label}: global norm {got['norm']!r}, one process {norm!r}"
    )


def test_the_true_table_steps_like_one_process_and_each_planted_axis_fails_by_name():
    per_table = run_distributed(_one_step_per_table, world_size=4)[0]  # rank 0's
    reference = _one_process()
    _check("true table", per_table["true table"], reference)
    # a replica averaged over too few axes: its gradient is one CP rank's share
    label = f"{BIAS} averaged over dp only"
    with pytest.raises(AssertionError, match=rf"^{re.escape(BIAS)}: Tensor-likes are not close"):
        _check(label, per_table[label], reference)
    # a replica declared a shard: counted on both TP ranks, the norm too large
    label = f"{BIAS} declared a tp shard"
    with pytest.raises(AssertionError, match=rf"^{re.escape(label)}: global norm"):
        _check(label, per_table[label], reference)
