"""Day 28: fsdp2_tp at 64 and 1,024 ranks, simulated beside its formulas.

    torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.sharded_tp_scale

Each row builds day 28's fsdp2_tp strategy (sharded_tp.py: the course's TP layers over tp,
FSDP2 over dp) for the real model as rank 0 of N (dtl.simulate.fake_world: shapes, no data),
fp32, tp ranks inside a node and dp = N / tp across, and runs one optimizer step of one
micro-batch of one sequence: the state it holds after the step and the ring bytes it sent on
each axis, against sharded_tp_formulas.py. Only the tp column depends on the tokens (16 here);
the dp column moves the parameters, whatever the batch. What a simulation cannot see:
dtl.simulate.CANNOT_SEE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from day22_megatron import planner
from day22_megatron.layouts import tp_vocab
from day28_gpt125m import sharded_tp_formulas as cost
from day28_gpt125m.recipe import Recipe
from day28_gpt125m.sharded_tp import FSDP2TP
from day28_gpt125m.strategy import Setup
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.grid import ParallelGrid
from dtl.simulate import CANNOT_SEE, fake_world

GB = 1e9
SEQ = 16  # tokens of the one simulated sequence


@dataclass
class Config:
    models: str = "gpt2-124m,gpt-6.6b"  # planner.MODELS names, comma-separated
    ranks: str = "64,1024"  # world sizes N, multiples of tp
    tp: int = 4  # tensor-parallel ranks (inside a node); divides every model's heads

    def validate(self) -> None:
        err = dtl_config.ConfigError
        planner.check_models(self.models, self.tp)
        bad = [n for n in dtl_config.int_list("ranks", self.ranks) if n % self.tp or n == self.tp]
        if bad:
            raise err(f"ranks {bad[0]}: a multiple of --tp={self.tp}, with dp >= 2")
        if dtl_dist.launch_world_size() > 1:
            raise err("sharded_tp_scale.py runs as one process (--nproc_per_node=1): it simulates")


def simulate(name: str, world: int, tp: int) -> dict:
    """Rank 0 of `world` under fsdp2_tp at (dp world / tp, tp): one step of one sequence."""
    cfg = tp_vocab(planner.MODELS[name], tp)  # padded as Megatron pads where tp does not divide it
    with fake_world(world):
        grid = ParallelGrid(tp=tp, dp=world // tp)
        setup = Setup(
            cfg=cfg, recipe=Recipe(), grid=grid, device=torch.device("cpu"), micro_batch=1,
            accum=1, seq_len=SEQ, seed=0, steps=1,
        )  # fmt: skip
        strategy = FSDP2TP(setup)
        strategy.measure_state = True
        x = torch.randint(0, cfg.vocab_size, (1, SEQ + 1))  # host: fake, no device runs
        strategy.step([(x[:, :-1], x[:, 1:])], lr=1e-4)
        sent = dict(strategy.last_sent or {})
        padded, root = strategy.padded, strategy.root
        state = sum((strategy.last_state or {}).values())
    want = cost.comm_bytes(
        cfg, tp=tp, dp=world // tp, padded=padded, root=root, micro_batch_size=1,
        microbatches=1, seq_len=SEQ,
    )  # fmt: skip
    return dict(
        model=name,
        world=world,
        got=dict(state=state, **sent),
        want=dict(state=cost.state_bytes(padded, world // tp), **want),
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before anything runs
    rows = [
        simulate(m, int(n), cfg.tp) for m in cfg.models.split(",") for n in cfg.ranks.split(",")
    ]
    keys = ("state", "tp", "dp")  # the norm's one fp64 number: its own line
    print(f"GB per rank, fsdp2_tp at tp {cfg.tp} x dp N/{cfg.tp}, fp32, one step of one sequence")
    head = [f"{k} {w}" for k in keys for w in ("sim", "formula")]
    print(f"{'model':<10}{'N':>6}" + "".join(f"{h:>15}" for h in head))
    gaps = []
    for r in rows:
        got, want = r["got"], r["want"]
        gaps += [abs(got[k] - want[k]) / max(want[k], 1) for k in (*keys, "norm")]
        values = [v for k in keys for v in (got[k], want[k])]
        print(f"{r['model']:<10}{r['world']:>6}" + "".join(f"{v / GB:>15.6f}" for v in values))
    last = rows[-1]
    print(
        f"norm: one fp64 number all-reduced over the {last['world']} ranks, "
        f"{last['got']['norm']:.2f} B sent per rank (formula {last['want']['norm']:.2f} B)"
    )
    ok = max(gaps) == 0
    print(f"cannot see: {CANNOT_SEE}")
    print(
        f"summary: day28 fsdp2_tp at scale, {len(rows)} rows simulated: state and bytes per "
        f"axis = formula {'yes' if ok else 'NO'} (worst gap {max(gaps):.3%})"
    )
    dtl_dist.finish(ok)


if __name__ == "__main__":
    main()
