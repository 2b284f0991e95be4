"""The routing a simulated MoE rank cannot compute, assumed instead (day22_megatron/moe_scale.py
reads it): rows per expert from a distribution (Zipf, a histogram stretched to E experts, each
expert at most once per token), the (T, k) table of experts that has those counts, what the
counts all-to-all would deliver to an ep rank, a histogram measured on tiny-moe, and
`assumed_routing`, which hands the dispatcher these real tables inside a fake world.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from dtl import moe as dtl_moe
from dtl.data import get_batch, load_corpus
from dtl.model import GPT, loss_fn, preset


def zipf(n_expert: int, s: float) -> list[float]:
    """p_e proportional to 1/(e+1)^s: expert 0 the hottest (s = 0: uniform)."""
    w = [1.0 / (e + 1) ** s for e in range(n_expert)]
    return [x / sum(w) for x in w]


def stretch(hist: Sequence[float], n_expert: int) -> list[float]:
    """A histogram of len(hist) experts as a distribution over n_expert: sorted hottest first,
    each measured expert's share spread evenly over n_expert / len(hist) consecutive experts."""
    m = len(hist)
    assert n_expert % m == 0, f"{n_expert} experts do not stretch {m} measured ones evenly"
    p = sorted((h / sum(hist) for h in hist), reverse=True)
    return [p[e * m // n_expert] * m / n_expert for e in range(n_expert)]


def cap(p: Sequence[float], top_k: int) -> list[float]:
    """p with no expert above 1/k of the rows (an expert is at most once among a token's k): the
    excess of the capped ones spread over the others in proportion to their shares."""
    p, top = list(p), 1.0 / top_k
    full: set[int] = set()
    while True:
        over = [e for e, x in enumerate(p) if x > top + 1e-12]
        if not over:
            return p
        excess = sum(p[e] - top for e in over)
        full.update(over)
        for e in over:
            p[e] = top
        rest = sum(x for e, x in enumerate(p) if e not in full)
        p = [x if e in full else x + excess * x / rest for e, x in enumerate(p)]


def expert_counts(p: Sequence[float], tokens: int, top_k: int) -> list[int]:
    """(E,) rows per expert from one rank's T·k rows: p capped at one slot per token, then
    rounded by largest remainder so that they sum to T·k exactly."""
    want = [x * tokens * top_k for x in cap(p, top_k)]
    counts = [min(math.floor(w), tokens) for w in want]
    short = tokens * top_k - sum(counts)
    by_remainder = sorted(range(len(p)), key=lambda e: want[e] - counts[e], reverse=True)
    for e in [e for e in by_remainder if counts[e] < tokens][:short]:
        counts[e] += 1
    return counts


def routing_table(counts: Sequence[int], tokens: int) -> torch.Tensor:
    """(T, k) int64 experts whose counts are `counts`, k distinct per token: expert e repeated
    counts[e] times (<= T), laid column by column, so one run never covers a token twice."""
    k = sum(counts) // tokens
    experts = torch.arange(len(counts))  # host: the assumed routing is real CPU ints
    seq = torch.repeat_interleave(experts, torch.tensor(counts))  # host: (T*k,)
    return seq.view(k, tokens).t().contiguous()  # slot j of token t = seq[j*T + t]


def received_counts(counts: Sequence[int], ep: int, ep_rank: int) -> torch.Tensor:
    """(ep * E/ep,) int64: what the counts all-to-all delivers to `ep_rank`, [source, my
    expert] flattened; every source sends the same counts, so ep copies of my experts'."""
    per_rank = len(counts) // ep
    mine = torch.tensor(counts[ep_rank * per_rank : (ep_rank + 1) * per_rank])  # host: ints
    return mine.repeat(ep)


def loads(counts: Sequence[int], ep: int) -> list[int]:
    """Rows each ep rank receives: ep x its experts' counts."""
    per_rank = len(counts) // ep
    return [ep * sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]


def measured_histogram(steps: int, seed: int = 0) -> list[int]:
    """Train tiny-moe with 8 experts, top-2, in this process (real tensors) for `steps` AdamW
    steps on the course corpus; its layers' rows per expert in the last step, summed."""
    torch.manual_seed(seed)
    model = GPT(preset("tiny-moe", moe=dtl_moe.MoEConfig(n_expert=8, top_k=2)), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = load_corpus(tokenizer="byte").train
    for step in range(steps):
        x, y = get_batch(data, model.cfg.block_size, 16, seed=seed, step=step)
        loss_fn(model(x), y).backward()  # the aux loss joins in backward (dtl.moe)
        opt.step()
        opt.zero_grad(set_to_none=True)
    per_layer = [m.last_tokens_per_expert for m in dtl_moe.moe_layers(model)]  # (E,) each
    return [int(c) for c in torch.stack([c for c in per_layer if c is not None]).sum(0)]


def _is_counts(x: torch.Tensor, n_expert: int) -> bool:
    """The dispatcher's counts exchange: a real (E,) int64 tensor (rows are fake, C wide)."""
    return not isinstance(x, FakeTensor) and x.dtype == torch.int64 and x.shape == (n_expert,)


@contextmanager
def assumed_routing(experts: torch.Tensor, received: torch.Tensor) -> Iterator[None]:
    """While it lasts (inside fake_world): the router's choices are `experts` (T, k), real; the
    (E,) counts all-to-all delivers `received`; fake mode is off, so ops on the real routing
    stay real while those on fake activations stay fake. Enter it before a CommCounter, which
    then counts the call it wraps."""
    route, all_to_all_single = dtl_moe.route, dist.all_to_all_single

    def assumed(logits: torch.Tensor, k: int, kind: dtl_moe.RouterKind) -> dtl_moe.Routing:
        real = route(logits, k, kind)  # fake (T, k) weights, (T, E) scores: shapes, gradients
        return dtl_moe.Routing(experts, real.weights, real.scores)

    def answered(output: torch.Tensor, input: torch.Tensor, *args: Any, **kw: Any) -> Any:
        work = all_to_all_single(output, input, *args, **kw)  # the fake group: nothing moves
        if _is_counts(input, received.numel()):
            output.copy_(received)  # [source rank, my expert] counts, as ep ranks would send
        return work

    dtl_moe.route, dist.all_to_all_single = assumed, answered
    try:
        with unset_fake_temporarily():
            yield
    finally:
        dtl_moe.route, dist.all_to_all_single = route, all_to_all_single
