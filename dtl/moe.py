"""Mixture of experts: the MLP of every block replaced by E expert MLPs and a router that sends
each token to k of them (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral; DeepSeek-V3).

    y_t = sum over the token's k chosen experts e of  w_te * expert_e(x_t)

One MoE layer, in the order it runs (tokens flattened to (N, C), N = B*T):
    1. the router, in fp32: logits = x W_r^T (N, E); scores = softmax (or sigmoid) of them
    2. top-k with a deterministic tie-break (`top_k`): the k best experts of each token, the
       lower index first among equal scores; their weights w (N, k)
    3. the N*k (token, slot) rows sorted by expert (`sort_by_expert`): every expert's rows are
       one contiguous slice, the tokens in order within it
    4. each expert runs on its slice (`run_experts`), even an empty one
    5. the rows put back in (token, slot) order and summed with their weights (`combine`)
Expert parallelism (day 22's apply_ep) changes only what happens between 3 and 5: the sorted
rows travel to the ranks that hold their experts and back, by all-to-all. The steps are a
`Dispatcher`, a field of the layer: `LocalDispatcher` here, the all-to-all one there.

The load-balancing loss (Switch; Megatron's `switch_load_balancing_loss_func`):
    aux = E * sum_e f_e * P_e,   f_e = (rows sent to e) / (N * k),   P_e = mean_t score_te
1.0 when the tokens spread evenly; its gradient reaches the router through P only. It joins the
training loss the way megatron-core joins it (MoEAuxLossAutoScaler): the layer's output passes
through `_AttachAuxLoss`, which changes nothing forward and, in backward, adds the gradient of
coef * aux * `aux_loss_scale`. So every path that backpropagates through the layer (a pipeline's
middle stage too, which computes no loss) trains the router to balance, without a second loss
to carry; a loop that divides its loss by m micro-batches sets the scale to 1/m
(`set_aux_loss_scale`). The loss value a script prints is the cross-entropy; the layer keeps
its last aux (`last_aux_loss`) and expert counts (`last_tokens_per_expert`) to print beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F

RouterKind = Literal["softmax", "sigmoid"]
TINY = 1e-20  # megatron-core's guard against dividing by sigmoid scores that all underflow


@dataclass(frozen=True)
class MoEConfig:
    """What makes a GPT's MLPs a mixture of experts (GPTConfig.moe; None: dense)."""

    n_expert: int = 4  # E experts per layer
    top_k: int = 2  # experts per token
    router: RouterKind = "softmax"  # softmax: weights are the top-k probabilities (Switch;
    # megatron-core's moe_router_pre_softmax); sigmoid: top-k of sigmoid scores, renormalised
    # to sum 1 when k > 1 (DeepSeek-V3; megatron-core's sigmoid score function)
    aux_loss_coef: float = 0.01  # Switch's alpha (Megatron's --moe-aux-loss-coeff)
    expert_hidden: int | None = None  # each expert's hidden width; None: 4 * n_embd

    def __post_init__(self) -> None:
        if self.router not in get_args(RouterKind):
            raise ValueError(f"unknown router '{self.router}'; one of {get_args(RouterKind)}")
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k {self.top_k} must be in 1..n_expert ({self.n_expert})")

    def hidden(self, n_embd: int) -> int:
        return self.expert_hidden or 4 * n_embd

    def layer_params(self, n_embd: int, bias: bool, experts: int | None = None) -> int:
        """Parameters of one MoE layer holding `experts` experts (all E by default): the router
        (C x E, no bias) and each expert's two linears."""
        C, H, b = n_embd, self.hidden(n_embd), int(bias)
        expert = C * H + H * b + H * C + C * b
        return C * self.n_expert + (self.n_expert if experts is None else experts) * expert


@dataclass(frozen=True)
class Routing:
    """Where each of N tokens goes: its k experts, best first, their weights, and the router's
    scores over all E experts (the aux loss reads them)."""

    experts: torch.Tensor  # (N, k) int64
    weights: torch.Tensor  # (N, k) fp32, with gradient to the router
    scores: torch.Tensor  # (N, E) fp32, normalised to sum 1 per token

    @property
    def top_k(self) -> int:
        return self.experts.size(1)


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(N, E) -> (N, k) expert indices, best first; among equal scores the lower index first.
    torch.topk does not promise an order for ties, and a tie must route alike on every rank
    and in the reference: a stable sort does."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def _softmax_route(logits: torch.Tensor, k: int) -> Routing:
    """The top-k of the softmax scores, weighted by those scores (not renormalised)."""
    scores = logits.softmax(dim=-1)
    experts = top_k(scores, k)
    return Routing(experts, scores.gather(1, experts), scores)


def _sigmoid_route(logits: torch.Tensor, k: int) -> Routing:
    """The top-k of sigmoid scores (each expert scored on its own, 0..1), renormalised over
    the k when k > 1 (one weight alone would always be 1: no gradient to the router)."""
    gates = torch.sigmoid(logits)
    experts = top_k(gates, k)
    chosen = gates.gather(1, experts)
    weights = chosen / (chosen.sum(-1, keepdim=True) + TINY) if k > 1 else chosen
    return Routing(experts, weights, gates / (gates.sum(-1, keepdim=True) + TINY))


ROUTERS: dict[str, Callable[[torch.Tensor, int], Routing]] = {
    "softmax": _softmax_route,
    "sigmoid": _sigmoid_route,
}


def route(logits: torch.Tensor, k: int, kind: RouterKind) -> Routing:
    """(N, E) fp32 router logits -> the Routing of `kind` (ROUTERS)."""
    return ROUTERS[kind](logits, k)


def tokens_per_expert(routing: Routing, n_expert: int) -> torch.Tensor:
    """(E,) int64: how many (token, slot) rows each expert receives."""
    return torch.bincount(routing.experts.flatten(), minlength=n_expert)


def load_balancing_loss(
    routing: Routing, n_expert: int, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch's aux loss over these tokens: E * sum_e f_e P_e (module docstring), fp32 scalar.
    `counts`: tokens_per_expert(routing), where the caller has it already."""
    n_rows = max(routing.experts.numel(), 1)  # N * k (a rank with no token: aux 0)
    if counts is None:
        counts = tokens_per_expert(routing, n_expert)
    f = counts.to(routing.scores.dtype) / n_rows  # no gradient
    P = routing.scores.sum(dim=0) / max(routing.scores.size(0), 1)  # (E,): the gradient's path
    return n_expert * (f * P).sum()


def sort_by_expert(routing: Routing, n_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) rows in expert order: `order` (N*k,) indexes the flattened (N, k)
    slots so that rows[order] lists expert 0's rows, then expert 1's ...; tokens ascending
    within an expert (a stable sort). And the (E,) row counts."""
    flat = routing.experts.flatten()  # slot j of token t at t*k + j
    return torch.sort(flat, stable=True).indices, torch.bincount(flat, minlength=n_expert)


def run_experts(
    rows: torch.Tensor, counts: Sequence[int], experts: Sequence[nn.Module]
) -> torch.Tensor:
    """Expert i on the i-th contiguous slice of `rows` (counts[i] rows), outputs in the same
    order. Every expert runs, on zero rows too: its gradient is then zeros rather than None,
    so data-parallel replicas always reduce the same list of gradients."""
    slices = rows.split(list(counts))
    return torch.cat([expert(part) for expert, part in zip(experts, slices, strict=True)])


def combine(outputs: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(N*k, C) expert outputs in (token, slot) order -> (N, C) = sum_j w_tj * out_tj.

    A sum over the k slots of a (N, k, C) view, in slot order, rather than index_add into N
    rows: the same additions in the same order on every rank and every backend (CUDA's
    index_add uses atomics, whose order varies)."""
    N, k = routing.experts.shape
    weights = routing.weights.to(outputs.dtype).unsqueeze(-1)  # (N, k, 1)
    return (outputs.view(N, k, outputs.size(-1)) * weights).sum(dim=1)


class Dispatcher(Protocol):
    """Steps 3-5 of the layer: rows to their experts, the experts run, the rows combined."""

    def __call__(
        self, tokens: torch.Tensor, routing: Routing, experts: nn.ModuleDict, n_expert: int
    ) -> torch.Tensor: ...


class LocalDispatcher:
    """Every expert on this rank: sort, run, unsort, combine."""

    def __call__(
        self, tokens: torch.Tensor, routing: Routing, experts: nn.ModuleDict, n_expert: int
    ) -> torch.Tensor:
        order, counts = sort_by_expert(routing, n_expert)
        rows = tokens[order // routing.top_k]  # (N*k, C): a token once per chosen expert
        out = run_experts(rows, counts.tolist(), [experts[str(e)] for e in range(n_expert)])
        return combine(out[torch.argsort(order)], routing)  # back to (token, slot) order


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on y forward; backward also starts the aux loss's backward with gradient
    `scale` (megatron-core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


ExpertFactory = Callable[[], nn.Module]


class MoE(nn.Module):
    """The layer: `router` (C -> E, no bias), `experts` keyed "0".."E-1" (a ModuleDict, so an
    expert-parallel rank deletes the experts it does not hold and the rest keep their
    one-process names), and the dispatcher that moves rows between them."""

    def __init__(self, n_embd: int, cfg: MoEConfig, make_expert: ExpertFactory):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(n_embd, cfg.n_expert, bias=False)
        self.experts = nn.ModuleDict({str(e): make_expert() for e in range(cfg.n_expert)})
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.aux_loss_scale = 1.0  # the loss's own factor: 1/m over m micro-batches
        self.last_aux_loss: torch.Tensor | None = None  # detached, for the logs
        self.last_tokens_per_expert: torch.Tensor | None = None

    def route(self, tokens: torch.Tensor) -> Routing:
        """(N, C) tokens -> their Routing. The router runs in fp32 whatever the model's dtype,
        autocast too (off here): top-k on rounded logits flips near-ties between ranks."""
        with torch.autocast(tokens.device.type, enabled=False):
            logits = F.linear(tokens.float(), self.router.weight.float())  # (N, E)
        return route(logits, self.cfg.top_k, self.cfg.router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.size(-1))  # (B, T, C) -> (N, C)
        routing = self.route(tokens)
        y = self.dispatcher(tokens, routing, self.experts, self.cfg.n_expert)  # (N, C)
        counts = tokens_per_expert(routing, self.cfg.n_expert)
        aux = load_balancing_loss(routing, self.cfg.n_expert, counts)
        self.last_aux_loss, self.last_tokens_per_expert = aux.detach(), counts
        scale = self.cfg.aux_loss_coef * self.aux_loss_scale
        if torch.is_grad_enabled() and scale:
            y = _AttachAuxLoss.apply(y, aux, scale)  # type: ignore[no-untyped-call]
        return y.view_as(x)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The factor the training loop applies to each forward's loss (1/m for m micro-batches),
    which the aux loss's gradient must carry too."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = scale
