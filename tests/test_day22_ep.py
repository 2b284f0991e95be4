"""Expert parallelism (day22_megatron/ep.py) against one process, 4 gloo ranks, one spawn.

The layer (C = 8, E = 4 experts, hidden 16), each rank holding 5 + rank tokens (26 in all, not a
multiple of ep), at ep 4 and at ep 2 (two groups, dp 2), k = 1 and 2. Reference: the same layer
with every expert, in one process, on the ep group's tokens end to end. Per rank: the output
slice and the input gradient bit for bit (every row goes through the same arithmetic in the
same order), each expert's gradient on its owner bit for bit (its rows arrive in the
reference's order), the router gradient summed over the group at rtol 1e-6 / atol 1e-7 (one
matmul over all tokens vs one per rank), the aux loss (of the rank's own tokens) bit for bit.
Edge cases: a zero router (every score tied: top-k = experts 0..k-1, so other experts get no
token on any rank), a rank with no token. Megatron's identities: identity experts return the
input and its gradient, and the all-gather dispatcher gives what the all-to-all one gives.

The model: day 22's stack on tiny-moe at dp 2 x ep 2 (k = 2) and ep 4 (k = 1), 3 AdamW steps
(lr 1e-3, eps 1e-6: dtl.model's note on Adam checks) against the one-process GPT stepping on
the mean of the data ranks' losses: losses rtol 1e-6, the global gradient norm rtol 1e-5,
gradients at step 0 and parameters after 3 steps atol 1e-6. Planted: expert gradients averaged
over their copies only (no 1/ep), and the aux loss dropped on the EP side; each fails the same
comparison.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from day22_megatron import stack
from day22_megatron.ep import EP_AXES, EP_COMBOS, AllToAllDispatcher, apply_ep
from day22_megatron.ep_allgather import AllGatherDispatcher
from dtl import dist as dtl_dist
from dtl.data import get_batch, load_corpus
from dtl.grid import ParallelGrid
from dtl.model import GPT, MLP, loss_fn, preset
from dtl.moe import MoE, MoEConfig, Routing, set_aux_loss_scale
from dtl.optim import OptimConfig
from dtl.testing import run_distributed

C, E, WORLD = 8, 4, 4
ADAMW = OptimConfig(lr=1e-3, eps=1e-6, weight_decay=0.1, decay="matrices")
T, GBS, STEPS = 16, 8, 3


def _layer(k: int) -> MoE:
    cfg = preset("tiny-moe", n_embd=C, n_head=1)
    # no aux gradient here: the reference's aux is over the group's tokens, each rank's over
    # its own (the aux's value is compared; its gradient in the stack test below)
    moe = MoEConfig(n_expert=E, top_k=k, expert_hidden=16, aux_loss_coef=0.0)
    torch.manual_seed(0)  # the same weights on every rank
    return MoE(C, moe, lambda: MLP(cfg, 16))


def _tokens(rank: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens and the output gradient it backpropagates (seeded by rank)."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(sizes[rank], C, generator=gen), torch.randn(sizes[rank], C, generator=gen)


def _layer_case(group, k: int, sizes: list[int], zero_router: bool = False) -> dict:
    """Run the EP layer and the reference; return what differs (empty: equal)."""
    ranks = dist.get_process_group_ranks(group)
    ours, reference = _layer(k), _layer(k)
    if zero_router:
        for layer in (ours, reference):
            nn.init.zeros_(layer.router.weight)
    apply_ep(ours, group)
    x, g = _tokens(dist.get_rank(), sizes)
    x.requires_grad_()
    (ours(x) * g).sum().backward()
    y = ours(x.detach()).detach()
    aux = ours.last_aux_loss
    # the reference: every expert, the group's tokens end to end
    xs, gs = zip(*(_tokens(r, sizes) for r in ranks), strict=True)
    X = torch.cat(xs).requires_grad_()
    (reference(X) * torch.cat(gs)).sum().backward()
    Y = reference(X.detach()).detach()
    start = sum(sizes[r] for r in ranks[: ranks.index(dist.get_rank())])
    mine = slice(start, start + x.size(0))
    router = ours.router.weight.grad.clone()
    dist.all_reduce(router, group=group)
    reference(x.detach())  # the aux loss of this rank's tokens alone
    bad = {}
    if not torch.equal(y, Y[mine]):
        bad["output"] = (y - Y[mine]).abs().max().item()
    if not torch.equal(x.grad, X.grad[mine]):
        bad["input grad"] = (x.grad - X.grad[mine]).abs().max().item()
    for name, p in ours.experts.named_parameters():
        if not torch.equal(p.grad, reference.experts.get_parameter(name).grad):
            bad[f"expert {name}"] = (p.grad - reference.experts.get_parameter(name).grad).norm()
    if not torch.allclose(router, reference.router.weight.grad, rtol=1e-6, atol=1e-7):
        bad["router grad"] = (router - reference.router.weight.grad).abs().max().item()
    if not torch.equal(aux, reference.last_aux_loss):
        bad["aux"] = (aux.item(), reference.last_aux_loss.item())
    bad["held"] = sorted(int(e) for e in ours.experts)
    return bad


def _identities(group, k: int) -> dict:
    """Identity experts give back the input and its gradient, through both dispatchers; with
    real experts the all-gather dispatcher equals the all-to-all one."""
    x, g = _tokens(dist.get_rank(), [5, 6, 7, 8])
    gen = torch.Generator().manual_seed(dist.get_rank())
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(x.size(0))])
    routing = Routing(experts, torch.full((x.size(0), k), 1 / k), torch.full((x.size(0), E), 0.25))
    identity = nn.ModuleDict({str(e): nn.Identity() for e in range(E)})
    out = {}
    for kind in (AllToAllDispatcher, AllGatherDispatcher):
        xi = x.clone().requires_grad_()
        y = kind(group, E)(xi, routing, identity, E)
        y.backward(g)
        out[kind.__name__] = torch.equal(y, x) and torch.equal(xi.grad, g)
    layers = [_layer(k), _layer(k)]
    ys = []
    for layer, kind in zip(layers, (AllToAllDispatcher, AllGatherDispatcher), strict=True):
        apply_ep(layer, group, kind)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * g).sum().backward()
        ys.append((y.detach(), xi.grad))
    same = all(torch.equal(a, b) for a, b in zip(*ys, strict=True))
    grads = zip(layers[0].parameters(), layers[1].parameters(), strict=True)
    out["all-gather = all-to-all"] = same and all(torch.equal(a.grad, b.grad) for a, b in grads)
    return out


def _layer_checks() -> dict:
    dtl_dist.init()
    grid = ParallelGrid(dp=2, ep=2, axes=EP_AXES)
    groups = {"ep4": dist.group.WORLD, "ep2": grid.ep_group}
    out = {}
    for label, group in groups.items():
        for k in (1, 2):
            out[label, k] = _layer_case(group, k, [5, 6, 7, 8])
            out[label, k, "tied"] = _layer_case(group, k, [5, 6, 7, 8], zero_router=True)
        out[label, "identities"] = _identities(group, 2)
    out["ep4", 2, "a rank with no token"] = _layer_case(dist.group.WORLD, 2, [0, 3, 9, 4])
    return out


def test_the_ep_layer_equals_one_process_and_megatrons_identities_hold():
    got = run_distributed(_layer_checks, world_size=WORLD)
    for rank, checks in enumerate(got):
        for case, bad in checks.items():
            if "identities" in case:
                assert all(bad.values()), f"rank {rank} {case}: {bad}"
                continue
            held = bad.pop("held")
            assert not bad, f"rank {rank} {case}: differs from one process: {bad}"
            ep = 4 if case[0] == "ep4" else 2
            assert len(held) == E // ep, f"rank {rank} {case} holds experts {held}"


# --- the model in day 22's stack -----------------------------------------------------------------


def _batches(step: int, data_ranks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = get_batch(load_corpus(tokenizer="byte").train, T, GBS, seed=0, step=step)
    rows = GBS // data_ranks
    return [(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) for i in range(data_ranks)]


def _stack_run(dp: int, ep: int, k: int, plant: str | None = None) -> dict:
    grid = ParallelGrid(dp=dp, ep=ep, axes=EP_AXES, combos=EP_COMBOS)
    cfg = preset("tiny-moe", moe=MoEConfig(top_k=k))
    s = stack.build_stack(cfg, grid, micro_batch_size=GBS // (dp * ep), microbatches=1,
                          seq_len=T, optim=ADAMW)  # fmt: skip
    true = synced = s.reduction
    if plant == "experts averaged over their copies only":  # the sync's table only
        for name, record in true.items():
            if record.routed:
                synced = synced.replace(name, routed=())
    if plant == "aux loss dropped on the EP side":
        set_aux_loss_scale(s.gpt, 0.0)
    data_rank = grid.dp_rank * ep + grid.ep_rank  # dp outer, ep inner: the grid's order
    losses, grads = [], None
    for step in range(STEPS):
        loss = stack.forward_backward(s, [_batches(step, dp * ep)[data_rank]])
        s.reduction = synced
        stack.sync_gradients(s)
        s.reduction = true
        if step == 0:
            grads = stack.full_state(s, grads=True)
            norm = stack.global_grad_norm(s)  # each tensor once: an expert on its owner only
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        losses.append(dtl_dist.all_reduce_scalar(loss, average=True))
    return dict(losses=losses, grads=grads, norm=norm, params=stack.full_state(s))


# (dp, ep, k): both ep sizes and both k; the layer test above runs every combination
STACKS = ((2, 2, 2), (1, 4, 1))


def _stack_checks() -> dict:
    dtl_dist.init()
    out = {}
    for dp, ep, k in STACKS:
        out[dp, ep, k] = _stack_run(dp, ep, k)
    for plant in ("experts averaged over their copies only", "aux loss dropped on the EP side"):
        out[plant] = _stack_run(2, 2, 2, plant)
    return out


def _one_process(k: int, data_ranks: int) -> dict:
    """The GPT in one process, stepping on the mean of the data ranks' losses (each rank's aux
    loss over its own tokens, as the EP run computes it)."""
    gpt = GPT(preset("tiny-moe", moe=MoEConfig(top_k=k)), seed=0)
    set_aux_loss_scale(gpt, 1 / data_ranks)
    optimizer = ADAMW.make(list(gpt.parameters()))
    losses, grads = [], None
    for step in range(STEPS):
        total = 0.0
        for x, y in _batches(step, data_ranks):
            loss = loss_fn(gpt(x), y) / data_ranks
            loss.backward()
            total += loss.item()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in gpt.named_parameters(remove_duplicate=False)}
            norm = torch.stack([p.grad.double().square().sum() for p in gpt.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return dict(losses=losses, grads=grads, norm=norm.sum().sqrt().item(), params=gpt.state_dict())


def _differences(got: dict, reference: dict) -> list[str]:
    bad = []
    if got["losses"] != pytest.approx(reference["losses"], rel=1e-6):
        bad.append(f"losses {got['losses']} vs {reference['losses']}")
    if got["norm"] != pytest.approx(reference["norm"], rel=1e-5):
        bad.append(f"global norm {got['norm']} vs {reference['norm']}")
    for what in ("grads", "params"):
        assert got[what].keys() == reference[what].keys()
        for name, t in reference[what].items():
            if not torch.allclose(got[what][name], t, rtol=0, atol=1e-6):
                bad.append(f"{what} {name}: {(got[what][name] - t).abs().max().item():.2e}")
    return bad


def test_the_stack_with_ep_trains_like_one_process_and_each_planted_bug_fails():
    got = run_distributed(_stack_checks, world_size=WORLD)[0]
    for dp, ep, k in STACKS:
        bad = _differences(got[dp, ep, k], _one_process(k, dp * ep))
        assert not bad, f"dp {dp} x ep {ep}, k = {k}: " + "; ".join(bad[:5])
    reference = _one_process(2, 4)
    experts = _differences(got["experts averaged over their copies only"], reference)
    assert experts and all(".experts." in line for line in experts if "grads" in line), experts
    assert any("router" in line for line in _differences(
        got["aux loss dropped on the EP side"], reference))  # fmt: skip
