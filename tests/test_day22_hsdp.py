"""Day 22: HSDP (FSDP2 on a 2-D replicate x shard mesh) trains like one process, holds the
formula's state per rank, and moves the formula's bytes on each axis; a planted mesh fails.

One 4-rank spawn (replicate 2 x shard 2): 3 AdamW steps of `tiny` (clipping at 1.0) against the
one-process GPT on the same global batches: losses rtol 1e-5, gradient norms rtol 1e-5,
parameters atol 1e-5. State: counted from the live tensors after the last step, to the byte.
Bytes: CommCounter on the mesh's two groups during the last step, to the byte.
"""

import torch
import torch.distributed as dist

from day22_megatron import hsdp
from dtl import dist as dtl_dist
from dtl.comm import CommCounter
from dtl.data import get_batch, load_corpus
from dtl.model import GPT, loss_fn, preset
from dtl.optim import OptimConfig
from dtl.reference import one_process_gpt
from dtl.state import live_state_bytes
from dtl.testing import run_distributed

STEPS, T, GBS = 3, 16, 8
ADAMW = OptimConfig(lr=1e-3, weight_decay=0.1, decay="matrices")


def _train(replicas: int) -> dict:
    """HSDP at `replicas` x (world / replicas) ranks: 3 steps, the last one's bytes counted."""
    mesh = hsdp.hsdp_mesh(replicas, "cpu")
    gpt = GPT(preset("tiny"), seed=0)
    shapes, root = [p.shape for p in gpt.parameters()], hsdp.root_shapes(gpt)
    model = hsdp.apply_hsdp(gpt, mesh)
    optimizer = ADAMW.make(model.parameters())
    corpus = load_corpus(tokenizer="byte").train
    rows = GBS // dist.get_world_size()
    losses, norms = [], []
    for step in range(STEPS):
        x, y = get_batch(corpus, T, GBS, seed=0, step=step)
        mine = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
        with CommCounter() as comm:
            loss = loss_fn(model(x[mine]), y[mine])
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        optimizer.step()
        state = live_state_bytes(model.parameters(), optimizer, counters=False)
        optimizer.zero_grad(set_to_none=True)
        losses.append(dtl_dist.all_reduce_scalar(loss.item(), average=True))
        norms.append(norm.item())
    sent = {axis: comm.ring_bytes_on(mesh.get_group(axis)) for axis in hsdp.HSDP_AXES}
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, norms=norms, full=full, state=sum(state.values()), sent=sent,
                padded=hsdp.padded_numel(shapes, dist.get_world_size() // replicas),
                root=hsdp.padded_numel(root, dist.get_world_size() // replicas))  # fmt: skip


def _runs() -> dict:
    dtl_dist.init()
    # planted: every rank a replica (shard groups of 1): all-reduce where the shard axis should
    # reduce-scatter, every rank holding the whole state
    return {"hsdp": _train(2), "planted": _train(4)}


def _one_process():
    norms: list[float] = []
    losses, gpt = one_process_gpt(
        preset("tiny"), load_corpus(tokenizer="byte").train, seq_len=T, rows=GBS, steps=STEPS,
        lr=1e-3, weight_decay=0.1, clip_grad=1.0, grad_norms=norms,
    )  # fmt: skip
    return losses, norms, dict(gpt.named_parameters())


def test_hsdp_trains_like_one_process_and_holds_and_moves_the_formulas_bytes():
    ranks = run_distributed(_runs, world_size=4, timeout_s=180)
    losses, norms, params = _one_process()
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
