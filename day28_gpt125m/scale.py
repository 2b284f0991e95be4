"""Day 28 at scale: compare.py's two rows, each run as one rank of 8 and 16 GPUs, simulated.

    torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.scale
    ... --models=gpt-6.6b --gpus=16

compare.py's table is formulas. Here, for each model and cluster of its table:
  zero3   our hand ZeRO-3 (day 18's zero.ZeroModel: the same gathers and reduce-scatters as
          DeepSpeed's stage 3, per micro-step, no rank holding whole gradients) in bf16 with fp32
          masters, as rank 0 of N under dtl.simulate.fake_world, runs one optimizer step of the
          configured m micro-steps: the bytes it sent (CommCounter) beside compare's
          zero3_traffic_bytes, and the state it holds beside fit.py's 16Ψ/N. Sequences of 16
          tokens: neither the traffic nor the state depends on the tokens, only on Ψ, N and m.
  tp_pp   compare's layout for TP + PP, our 4-D stack at it (day 22's scale.py): parameters on the
          fullest stage and TP + PP bytes per micro-batch beside plan.py's formulas.
The gaps: ZeRO-3's buckets pad Ψ to a multiple of N per unit (a few elements in a billion); the
stack's TP adds the ends' all-reduces and the vocab-parallel loss's, which plan leaves out
(day 22's scale.py). A 6.6 B model's 128
micro-steps take about a minute: the line is a benchmark. What a simulation cannot see:
dtl.simulate.CANNOT_SEE. Writes scale.csv in out_dir.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from day18_zero import engines
from day22_megatron import at_scale as stack_scale
from day22_megatron.step_model import GB
from day28_gpt125m import compare, fit
from dtl import config as dtl_config
from dtl.comm import CommCounter
from dtl.metrics import write_csv
from dtl.model import GPT, num_params
from dtl.optim import OptimConfig
from dtl.simulate import CANNOT_SEE, fake_world

SEQ = 16  # tokens per simulated sequence: ZeRO-3's bytes do not depend on them


@dataclass
class Config:
    models: str = "gpt3-125m,gpt3-1.3b,gpt-6.6b"  # comma-separated (compare.MODELS)
    gpus: str = "8,16"  # cluster sizes, comma-separated
    out_dir: str = "outputs/day28_gpt125m/scale"  # scale.csv

    def validate(self) -> None:
        compare.Config(models=self.models, gpus=self.gpus, plot_gpus=self.gpus).validate()


def simulate_zero3(name: str, gpus: int, micro_steps: int) -> dict:
    """Rank 0 of `gpus` under hand ZeRO-3, bf16: a first step builds Adam's state, the second
    (micro_steps micro-steps) is counted: the bytes sent, the state held before its update."""
    model = compare.MODELS[name]
    with fake_world(gpus):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # fake parameters cannot be cast in place
        try:
            gpt = GPT(model, seed=0)
        finally:
            torch.set_default_dtype(default)
        # no_sync=False: every micro-step reduce-scatters, as DeepSpeed's ZeRO-3 does
        trainer = engines.HandZero(gpt, 3, None, OptimConfig(), no_sync=False)
        x = torch.randint(0, model.vocab_size, (1, SEQ + 1), device=next(gpt.parameters()).device)
        batch = (x[:, :-1], x[:, 1:])
        trainer.run_step([batch])
        with CommCounter() as comm:
            trainer.run_step([batch] * micro_steps)
        return dict(sent=comm.ring_bytes_per_rank(), state=sum(trainer.bytes_before_step.values()))


def zero3_row(name: str, gpus: int) -> dict:
    row = compare.zero3_row(name, gpus, compare.Config())
    t0 = time.perf_counter()
    sim = simulate_zero3(name, gpus, row["m"])
    model = compare.MODELS[name]
    state = fit.predicted_bytes(model, "zero3", world=gpus, precision="bf16")["resident"]
    return dict(
        model=name,
        gpus=gpus,
        strategy="zero3",
        layout=row["layout"],
        m=row["m"],
        traffic_sim=sim["sent"],
        traffic_formula=compare.zero3_traffic_bytes(num_params(model), gpus, row["m"]),
        state_sim=sim["state"],
        state_formula=state,
        params_sim=None,
        params_formula=None,
        seconds=time.perf_counter() - t0,
    )


def tp_pp_row(name: str, gpus: int) -> dict:
    row = compare.tp_pp_row(name, gpus, compare.Config())
    t0 = time.perf_counter()
    r = stack_scale.row_at(compare.MODELS[name], row["lay"], row["plan"], k=0)
    return dict(
        model=name,
        gpus=gpus,
        strategy="tp_pp",
        layout=row["layout"],
        m=row["m"],
        traffic_sim=(r["tp_sim"] + r["pp_sim"]) * row["m"],
        traffic_formula=(r["tp_formula"] + r["pp_formula"]) * row["m"],
        state_sim=None,
        state_formula=None,  # plan.py's state assumes Megatron's optimizer
        params_sim=r["params_sim"],
        params_formula=r["params_formula"],  # elements, fullest stage
        seconds=time.perf_counter() - t0,
    )


def gap(r: dict, key: str) -> float:
    want = r[f"{key}_formula"]
    return abs(r[f"{key}_sim"] - want) / want if want else float(r[f"{key}_sim"] != 0)


def show(r: dict) -> str:
    if r["params_formula"] is not None:  # TP + PP: parameters on the fullest stage, millions
        key, label, scale = "params", "params (M)", 1e6
    else:  # ZeRO-3: model state bytes
        key, label, scale = "state", "state (GB)", GB
    return (
        f"{r['model']:<10}{r['gpus']:>5} {r['strategy']:<6}{r['layout']:<13}{r['m']:>5}"
        f"{r['traffic_sim'] / GB:>12.2f}{r['traffic_formula'] / GB:>12.2f}{gap(r, 'traffic'):>8.3%}"
        f"  {label:<11}{r[key + '_sim'] / scale:>12,.3f}{r[key + '_formula'] / scale:>12,.3f}"
        f"{gap(r, key):>8.3%}{r['seconds']:>6.1f}"
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before anything runs
    print(
        "compare.py's rows simulated (one rank; traffic GB per GPU per step: ZeRO-3's gathers and"
        " reduce-scatters x m, TP + PP's bytes x m)"
    )
    print(
        f"{'model':<10}{'GPUs':>5} {'kind':<6}{'layout':<13}{'m':>5}{'sent sim':>12}"
        f"{'formula':>12}{'gap':>8}  {'':<11}{'simulated':>12}{'formula':>12}{'gap':>8}{'s':>6}"
    )
    rows = []
    for name in cfg.models.split(","):
        for gpus in map(int, cfg.gpus.split(",")):
            for build in (zero3_row, tp_pp_row):
                rows.append(build(name, gpus))
                print(show(rows[-1]), flush=True)
    write_csv(rows, os.path.join(cfg.out_dir, "scale.csv"))
    print(f"the simulation cannot see: {CANNOT_SEE}")
    worst = {
        kind: max(gap(r, "traffic") for r in rows if r["strategy"] == kind)
        for kind in ("zero3", "tp_pp")
    }
    state = max(gap(r, "state") for r in rows if r["strategy"] == "zero3")
    params = max(gap(r, "params") for r in rows if r["strategy"] == "tp_pp")
    print(
        f"summary: day28 scale, {len(rows)} rows of compare.py simulated ({cfg.models} on "
        f"{cfg.gpus} GPUs): worst traffic gap zero3 {worst['zero3']:.3%}, tp_pp "
        f"{worst['tp_pp']:.3%}; zero3 state {state:.3%}, tp_pp params {params:.3%}",
        flush=True,
    )


if __name__ == "__main__":
    main()
