"""The MoE layer in one process (dtl.moe): the sorted dispatch equals a token-by-token loop, ties
route to the lower index, the aux loss is 1 at balance and its gradient is that of
loss + coef * aux, and an expert with no token still gets a (zero) gradient."""

import pytest
import torch

from dtl.model import GPT, MLP, loss_fn, preset
from dtl.moe import MoE, MoEConfig, load_balancing_loss, route, set_aux_loss_scale, top_k

C = 8


def _layer(**fields) -> MoE:
    cfg = preset("tiny-moe", n_embd=C, n_head=1)
    moe = MoEConfig(**fields)
    torch.manual_seed(0)
    return MoE(C, moe, lambda: MLP(cfg, moe.hidden(C)))


def _token_by_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """y_t = sum_j w_tj expert_j(x_t), one token and one expert at a time."""
    logits = x.float() @ layer.router.weight.float().T
    r = route(logits, layer.cfg.top_k, layer.cfg.router)
    rows = []
    for t in range(x.size(0)):
        experts = [layer.experts[str(int(e))](x[t : t + 1]) for e in r.experts[t]]
        rows.append(sum(w * y for w, y in zip(r.weights[t], experts, strict=True)))
    return torch.cat(rows)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("k", [1, 2])
def test_the_sorted_dispatch_equals_a_token_by_token_loop(router, k):
    layer = _layer(top_k=k, router=router, aux_loss_coef=0.0)
    x = torch.randn(13, C)  # 13 tokens: some expert gets few, the order is not a multiple of E
    torch.testing.assert_close(layer(x), _token_by_token(layer, x), rtol=1e-6, atol=1e-7)


def test_ties_route_to_the_lower_index_and_sigmoid_weights_sum_to_one():
    scores = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.4, 0.4, 0.1]])
    assert top_k(scores, 2).tolist() == [[0, 1], [1, 2]]
    r = route(torch.randn(5, 4), 2, "sigmoid")
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(5))


def test_the_aux_loss_is_one_at_balance_and_grows_when_one_expert_takes_all():
    # flat scores: every token to expert 0 (a tie), yet the loss is 1 (P = 1/4: E x 1 x 1/4):
    # the loss sees a skew only through the scores, which is where its gradient goes
    flat = route(torch.zeros(8, 4), 1, "softmax")
    assert load_balancing_loss(flat, 4).item() == pytest.approx(1.0)
    skewed = route(torch.tensor([[9.0, 0, 0, 0]] * 8), 1, "softmax")
    assert load_balancing_loss(skewed, 4).item() == pytest.approx(4 * skewed.scores[0, 0].item())
    spread = route(torch.eye(4).repeat(2, 1) * 5, 1, "softmax")  # two tokens per expert
    assert load_balancing_loss(spread, 4).item() == pytest.approx(1.0)


def test_the_attached_aux_loss_gives_the_gradient_of_loss_plus_coef_times_aux():
    coef, scale = 0.3, 0.5
    attached = _layer(aux_loss_coef=coef)
    set_aux_loss_scale(attached, scale)
    plain = _layer(aux_loss_coef=0.0)
    x = torch.randn(11, C)
    (attached(x).square().sum() * scale).backward()
    y = plain(x)
    routing = route(x @ plain.router.weight.T, 2, "softmax")
    ((y.square().sum() + coef * load_balancing_loss(routing, 4)) * scale).backward()
    for (name, a), b in zip(attached.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0, msg=name)
    assert attached.router.weight.grad.abs().sum() > 0


def test_an_expert_that_gets_no_token_has_a_zero_gradient_not_none():
    layer = _layer(top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()  # every score equal: every token to expert 0
    layer(torch.randn(6, C)).sum().backward()
    assert layer.last_tokens_per_expert.tolist() == [6, 0, 0, 0]
    for e in "123":
        assert all(p.grad is not None and not p.grad.any() for p in layer.experts[e].parameters())


def test_the_gpt_trains_its_router_through_the_block():
    gpt = GPT(preset("tiny-moe"), seed=0)
    x = torch.randint(0, 256, (2, 16))
    loss_fn(gpt(x), x).backward()
    router = gpt.blocks["0"].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    assert gpt.blocks["1"].mlp.last_tokens_per_expert.sum().item() == 2 * 16 * 2  # N x k
