"""Day 22 at scale, MoE: one rank of a 64-1024-rank job running one expert-parallel MoE layer of
Mixtral's or DeepSeek-V3's published shape, simulated, beside the formulas.

    torchrun --standalone --nproc_per_node=1 -m day22_megatron.moe_scale
    ... --models=mixtral-8x7b --ns=64 --distributions=zipf

The layer is the kit's (dtl.moe.MoE), split over ep ranks by apply_ep and moved by ep.py's
AllToAllDispatcher, unchanged, under dtl.simulate.fake_world: forward and backward of one layer
on `tokens` tokens of this rank, in fp32 (the precision of ep.py's formula, formulas.ep_bytes:
bf16 halves the rows' bytes; the counts stay int64). CommCounter counts the all-to-all data and
live_state_bytes the experts' state (after one AdamW step); formulas.ep_bytes and
formulas.expert_params say what they should be.

What a fake world cannot do here, and what this script supplies instead (`assumed_routing`):
- the router's choices: fake tensors have no values, so no top-k and no split sizes (the
  dispatcher turns its counts into Python ints with `.tolist()`);
- the counts other ranks send: the fake process group moves nothing, and an uneven all-to-all's
  output is whatever was in the buffer.
So the routing is an assumption, stated with the table: every rank's T·k rows spread over the E
experts by one distribution (uniform; Zipf; the shape measured on tiny-moe trained here for a
few steps), the same on every rank. While the layer runs, the routing (experts per token) and
the counts are real CPU int64 tensors, the activations and parameters fake:
  - dtl.moe.route is wrapped: the real router runs (fake scores and weights) and its chosen
    experts are replaced by a real (T, k) table whose per-expert counts follow the distribution;
  - dist.all_to_all_single is wrapped: the (E,) counts exchange is answered with what this rank
    would receive, ep copies of its experts' counts (every rank sends alike);
  - fake mode is off while the layer runs (dtl's FakeTensorMode allows real inputs, and an op on
    a fake tensor is still fake): ops on the real routing stay real, so `.tolist()` works.
The simulated rank is the ep rank whose experts receive the most rows (ep rank 0 under uniform),
dp rank 0. N changes only how many copies of each expert there are (N/ep); the rows and the
expert state per rank depend on ep, T and the routing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch

from day22_megatron import formulas
from day22_megatron import routing_assumptions as routing
from day22_megatron.ep import EP_AXES, AllToAllDispatcher, apply_ep
from day22_megatron.layouts import Layout
from dtl import config as dtl_config
from dtl import moe as dtl_moe
from dtl.comm import CommCounter
from dtl.grid import ParallelGrid
from dtl.metrics import write_csv
from dtl.model import MLP, GPTConfig
from dtl.simulate import CANNOT_SEE, fake_world
from dtl.state import live_state_bytes

GB = 1e9
SWIGLU = 1.5  # a SwiGLU expert has 3 matrices of C x H, the kit's GELU expert 2
Row = dict[str, Any]  # one table row: the simulation beside its formulas


@dataclass(frozen=True)
class MoEShape:
    """One published MoE layer, in the kit's terms: hidden C, expert width H, E experts, top-k,
    L MoE layers, and the ep sizes simulated."""

    n_embd: int
    n_head: int
    expert_hidden: int
    n_expert: int
    top_k: int
    moe_layers: int
    eps: tuple[int, ...]
    source: str

    def gpt(self, layers: int) -> GPTConfig:
        """A GPTConfig the formulas read (only C, E, k, H, bias and n_layer matter to them)."""
        moe = dtl_moe.MoEConfig(self.n_expert, self.top_k, expert_hidden=self.expert_hidden)
        return GPTConfig(
            n_layer=layers, n_head=self.n_head, n_embd=self.n_embd, bias=False, moe=moe
        )


MODELS = {
    # Jiang et al. 2024 (arXiv 2401.04088): every one of 32 layers is an MoE of 8 experts, top-2
    "mixtral-8x7b": MoEShape(4096, 32, 14336, 8, 2, 32, (8,), "arXiv 2401.04088"),
    # DeepSeek-AI 2024 (arXiv 2412.19437): 58 of 61 layers MoE, 256 routed experts of 2048, top-8
    # (its shared expert and the 3 dense layers are not simulated)
    "deepseek-v3": MoEShape(7168, 128, 2048, 256, 8, 58, (64, 256), "arXiv 2412.19437"),
}


@dataclass
class Config:
    models: str = "mixtral-8x7b,deepseek-v3"  # comma-separated: MODELS
    ns: str = "64,256,1024"  # simulated world sizes, comma-separated
    distributions: str = "uniform,zipf,measured"  # routing assumptions: DISTRIBUTIONS
    tokens: Annotated[int, dtl_config.AT_LEAST_1] = 4096  # tokens per rank (one micro-batch)
    zipf: Annotated[float, dtl_config.NON_NEGATIVE] = 1.0  # Zipf exponent: p_e ~ 1/(e+1)^s
    steps: int = 20  # AdamW steps of tiny-moe (E=8) before its histogram is read
    out_dir: str = "outputs/day22_megatron/moe_scale"  # moe_scale.csv

    def validate(self) -> None:
        err = dtl_config.ConfigError
        unknown = [m for m in self.models.split(",") if m not in MODELS]
        if unknown:
            raise err(f"unknown model(s) {unknown}; {', '.join(MODELS)}")
        wrong = [d for d in self.distributions.split(",") if d not in DISTRIBUTIONS]
        if wrong:
            raise err(f"unknown distribution(s) {wrong}; {', '.join(DISTRIBUTIONS)}")
        for n in dtl_config.int_list("ns", self.ns):
            for name in self.models.split(","):
                if not eps_for(MODELS[name], n):
                    raise err(f"no ep of {name}'s {MODELS[name].eps} divides N = {n}")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise err("moe_scale.py runs as one process (--nproc_per_node=1): it simulates")


def eps_for(shape: MoEShape, n: int) -> list[int]:
    """The ep sizes of `shape` that an N-rank job can use: ep divides N and E."""
    return [ep for ep in shape.eps if n % ep == 0 and shape.n_expert % ep == 0]


# name -> the share of rows each of E experts gets: (E, the run's config, the measured histogram)
SHARES: dict[str, Callable[[int, Config, Sequence[int]], list[float]]] = {
    "uniform": lambda n_expert, cfg, hist: [1.0 / n_expert] * n_expert,
    "zipf": lambda n_expert, cfg, hist: routing.zipf(n_expert, cfg.zipf),
    "measured": lambda n_expert, cfg, hist: routing.stretch(hist, n_expert),
}


DISTRIBUTIONS = tuple(SHARES)


def distribution(name: str, n_expert: int, cfg: Config, hist: Sequence[int]) -> list[float]:
    return SHARES[name](n_expert, cfg, hist)


def assumptions(cfg: Config, hist: Sequence[int]) -> list[str]:
    """The table's stated routing assumptions, one line each."""
    share = ", ".join(f"{h / sum(hist):.3f}" for h in sorted(hist, reverse=True)) if hist else ""
    text = {
        "uniform": "every expert gets T·k/E of each rank's T·k rows",
        "zipf": f"Zipf, exponent {cfg.zipf:g}: expert e gets a share ~ 1/(e+1)^{cfg.zipf:g}, "
        "expert 0 hottest",
        "measured": f"measured: tiny-moe E=8 after {cfg.steps} steps (rows per expert, both "
        f"layers, last batch, hottest first: {share}), each share spread evenly over E/8 "
        "consecutive experts",
    }
    return [
        "routing assumption (a fake world has no router values and delivers no counts; every "
        "rank's T·k rows follow one distribution, the same on every rank):",
        *(f"  {d:<10}{text[d]}" for d in cfg.distributions.split(",")),
        "  an expert takes at most one of a token's k slots: a share above 1/k is capped and the "
        "excess spread over the others in proportion",
        "  simulated rank: the ep rank whose experts receive the most rows (ep rank 0), dp rank 0",
    ]


# --- the simulation --------------------------------------------------------------------------


@dataclass
class Sim:
    """What the simulated rank did and holds, for one MoE layer."""

    rows_sent: int
    rows_received: int
    calls: int
    all_to_all: int  # bytes: S of every all_to_all_single, forward and backward
    state: int  # bytes of the experts' params, grads and AdamW state on this rank
    seconds: float


def simulate(shape: MoEShape, n: int, ep: int, counts: Sequence[int], tokens: int) -> Sim:
    """Rank `ep_rank` (the most loaded) of ep group 0 in an N-rank job: one MoE layer forward
    and backward on `tokens` fp32 tokens routed as `counts`, then one AdamW step."""
    t0 = time.perf_counter()
    ep_rank = max(range(ep), key=lambda r: routing.loads(counts, ep)[r])
    experts = routing.routing_table(counts, tokens)
    received = routing.received_counts(counts, ep, ep_rank)
    gcfg = shape.gpt(1)
    assert gcfg.moe is not None
    with fake_world(n, rank=ep_rank):  # dp 0: ranks 0..ep-1 are ep group 0 (EP_AXES)
        grid = ParallelGrid(dp=n // ep, ep=ep, axes=EP_AXES)
        layer = dtl_moe.MoE(gcfg.n_embd, gcfg.moe, lambda: MLP(gcfg, shape.expert_hidden))
        apply_ep(layer, grid.group("ep"))  # keeps E/ep experts, AllToAllDispatcher
        x = torch.empty(tokens, gcfg.n_embd, requires_grad=True)  # host: fake (T, C) fp32
        with routing.assumed_routing(experts, received), CommCounter() as comm:
            layer(x).sum().backward()  # 2 all-to-alls of rows forward, 2 backward, 1 of counts
        opt = torch.optim.AdamW(layer.experts.parameters())
        opt.step()  # Adam's m and v exist from here
        state = live_state_bytes(layer.experts.parameters(), opt, counters=False).total
        dispatcher = layer.dispatcher
        assert isinstance(dispatcher, AllToAllDispatcher)
        t = dispatcher.traffic
    return Sim(
        t.rows_sent, t.rows_received, t.calls, comm.bytes["all_to_all"], state,
        time.perf_counter() - t0,
    )  # fmt: skip


def row(name: str, n: int, ep: int, dist_name: str, cfg: Config, hist: Sequence[int]) -> Row:
    """One table row: the simulation beside the formulas, which read the routing, not the run."""
    shape = MODELS[name]
    shares = distribution(dist_name, shape.n_expert, cfg, hist)
    counts = routing.expert_counts(shares, cfg.tokens, shape.top_k)
    sim = simulate(shape, n, ep, counts, cfg.tokens)
    per_rank = routing.loads(counts, ep)
    sent, received = cfg.tokens * shape.top_k, max(per_rank)  # the formula's rows
    lay = Layout(dp=n, ep=ep)
    per_layer = formulas.expert_params(shape.gpt(1), lay, 0)
    adam = formulas.FP32 * (2 + formulas.ADAM_STATES)  # params, grads, m, v: 16 B / parameter
    return dict(
        model=name, n=n, ep=ep, routing=dist_name, ep_rank=per_rank.index(received),
        rows_sent=sim.rows_sent, rows_received=sim.rows_received,
        rows_sent_formula=sent, rows_received_formula=received,
        imbalance=received / (sum(per_rank) / ep),
        a2a_sim=sim.all_to_all,
        a2a_formula=formulas.ep_bytes(shape.gpt(1), sent, received, 1),
        state_sim=sim.state * shape.moe_layers,
        state_formula=adam * formulas.expert_params(shape.gpt(shape.moe_layers), lay, 0),
        expert_params=per_layer * shape.moe_layers,
        seconds=sim.seconds,
    )  # fmt: skip


def gap(r: Row, key: str) -> float:
    """|simulated - formula| / formula."""
    return float(abs(r[f"{key}_sim"] - r[f"{key}_formula"]) / r[f"{key}_formula"])


def header(name: str, n: int, ep: int, tokens: int) -> list[str]:
    s = MODELS[name]
    return [
        f"{name} ({s.source}): C {s.n_embd}, expert H {s.expert_hidden}, E {s.n_expert}, "
        f"k {s.top_k}, {s.moe_layers} MoE layers; N = {n} ranks, ep {ep}, {n // ep} "
        f"cop{'y' if n == ep else 'ies'} of each expert; one layer fwd+bwd, {tokens} tokens/rank, "
        "fp32",
        f"  {'routing':<9}{'rank':>5}{'rows sent':>10}{'received':>10}{'imbal':>7}"
        f"{'a2a B simulated':>17}{'formula':>15}{'gap':>7}"
        f"{'expert state GB/rank':>22}{'formula':>9}{'gap':>7}{'SwiGLU':>8}",
    ]


def show(r: Row) -> str:
    return (
        f"  {r['routing']:<9}{r['ep_rank']:>5}{r['rows_sent']:>10,}{r['rows_received']:>10,}"
        f"{r['imbalance']:>7.2f}{r['a2a_sim']:>17,}{r['a2a_formula']:>15,.0f}"
        f"{gap(r, 'a2a'):>7.2%}{r['state_sim'] / GB:>22.2f}{r['state_formula'] / GB:>9.2f}"
        f"{gap(r, 'state'):>7.2%}{SWIGLU * r['state_sim'] / GB:>8.2f}"
    )


def table(cfg: Config, hist: Sequence[int], emit: Callable[[str], None] = print) -> list[Row]:
    rows = []
    for name in cfg.models.split(","):
        for n in dtl_config.int_list("ns", cfg.ns):
            for ep in eps_for(MODELS[name], n):
                for line in header(name, n, ep, cfg.tokens):
                    emit(line)
                for d in cfg.distributions.split(","):
                    rows.append(row(name, n, ep, d, cfg, hist))
                    emit(show(rows[-1]))
    return rows


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before anything runs
    t0 = time.perf_counter()
    measured = "measured" in cfg.distributions.split(",")  # the one that trains first
    hist = routing.measured_histogram(cfg.steps) if measured else []
    for line in assumptions(cfg, hist):
        print(line)
    print(
        "experts: the kit's GELU MLP, 2 matrices (C x H, H x C, no bias); Mixtral's and "
        "DeepSeek-V3's are SwiGLU, 3 matrices: their state is SwiGLU = 1.5 x the kit's (the "
        "rows' bytes are the same). State: params, grads, AdamW m and v, fp32 (16 B/param)"
    )
    rows = table(cfg, hist, lambda line: print(line, flush=True))
    write_csv(rows, os.path.join(cfg.out_dir, "moe_scale.csv"))
    print(f"the simulation cannot see: {CANNOT_SEE}; and the real routing (it is assumed)")
    rows_ok = all(
        r["rows_sent"] == r["rows_sent_formula"]
        and r["rows_received"] == r["rows_received_formula"]
        for r in rows
    )
    print(
        f"summary: day22 moe_scale {len(rows)} layers simulated ({cfg.models}; N {cfg.ns}; "
        f"routing {cfg.distributions}; {cfg.tokens} tokens/rank): all-to-all "
        f"{max(gap(r, 'a2a') for r in rows):.2%}, expert state "
        f"{max(gap(r, 'state') for r in rows):.2%} worst |simulated - formula| / formula; "
        f"rows = routing's {'yes' if rows_ok else 'NO'}; worst imbalance "
        f"{max(r['imbalance'] for r in rows):.2f}; {time.perf_counter() - t0:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
