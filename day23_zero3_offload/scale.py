"""Day 23 at scale: DeepSpeed's ZeRO-3, with and without offload, run as one rank of 8 and 64,
simulated, beside predict.py's bytes per location.

    torchrun --standalone --nproc_per_node=1 -m day23_zero3_offload.scale
    ... --model=gpt2-124m --ns=8,64 --fit_budget_gb=80

explain.py predicts from DeepSpeed's rules where every byte of a rank lives, and the tests check
it against real runs of 1-4 ranks. Here the real DeepSpeed engine is built for rank 0 of N under
dtl.simulate.fake_world (a fake process group, fake tensors) with the patches of
dtl.simulate.deepspeed_under_fake_tensors, runs two steps (the first records the module trace
that DeepSpeed's prefetch and release follow), and measure.locations reads the same attributes it
reads in a real run, the gathered-parameter peak of the second step included. Two parts:
  templates   the model (--model) under each template that can run under fake tensors (no
              offload, optimizer to CPU, parameters and optimizer to CPU; NVMe cannot: it needs
              data on disk) at each N: predicted and simulated bytes, device and CPU
  fit         explain.py's "largest GPT whose model state fits --fit_budget_gb per GPU" on 8
              ranks, for each of those templates: that GPT simulated at N = 8, its device bytes
              against the budget
The gathered parameters are compared like the rest: predict._gathered replays DeepSpeed's
release rule on the trace and caps it by the live-parameter limit, an upper bound; where the cap
binds (the largest fits) the simulated peak is below it, and the gap says by how much. What a
simulation cannot see: dtl.simulate.CANNOT_SEE. Writes scale.csv in out_dir.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from day23_zero3_offload.checks import template_path
from day23_zero3_offload.measure import PeakGathered, locations
from day23_zero3_offload.predict import (
    GB,
    groups_by_formula,
    largest_fit,
    param_groups,
    predict,
    totals,
)
from dtl import config as dtl_config
from dtl import extras
from dtl.deepspeed import import_deepspeed
from dtl.metrics import write_csv
from dtl.model import GPT, PRESETS, GPTConfig, PresetName, loss_fn
from dtl.simulate import CANNOT_SEE, deepspeed_under_fake_tensors, fake_world

SIMULATED = ("zero3", "opt_only", "cpu")  # the templates that run under fake tensors (not nvme)
SEQ = 8  # tokens per simulated sequence: the state does not depend on them


@dataclass
class Config:
    model: PresetName = "gpt2-124m"  # dtl preset of the templates part
    ns: str = "8,64"  # ranks to simulate, comma-separated
    fit_budget_gb: float = 80.0  # device memory per GPU of the fit part (0: skip it)
    out_dir: str = "outputs/day23_zero3_offload/scale"  # scale.csv

    def validate(self) -> None:
        dtl_config.int_list("ns", self.ns)
        extras.require("day23_zero3_offload.scale", "deepspeed")  # it simulates DeepSpeed's engine


def ds_config(template: str, world: int) -> dict:
    with open(template_path(template)) as f:
        ds = json.load(f)
    ds.update(
        train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world
    )
    return ds


def simulate(model: GPTConfig, template: str, world: int) -> dict[str, dict[str, int]]:
    """Rank 0 of `world` under DeepSpeed with `template`: two steps, then where its bytes are."""
    deepspeed = import_deepspeed("cpu")
    with fake_world(world), deepspeed_under_fake_tensors(ds_config(template, world)) as ds:
        engine, *_ = deepspeed.initialize(
            model=GPT(model, seed=0), config=ds, dist_init_required=False
        )
        x = torch.randint(0, model.vocab_size, (1, SEQ + 1), device=engine.device)
        peak = None
        for step in range(2):  # the first records the module trace DeepSpeed's prefetch follows
            peak = PeakGathered(engine) if step == 1 else None
            engine.backward(loss_fn(engine(x[:, :-1]), x[:, 1:]))
            engine.step()
        peak.remove()
        return locations(engine, rank=0, peak=peak)


def template_rows(model_name: str, template: str, world: int) -> list[dict]:
    model = PRESETS[model_name]
    t0 = time.perf_counter()
    got = simulate(model, template, world)
    want = predict(ds_config(template, world), param_groups(model), world)
    seconds = time.perf_counter() - t0
    return [
        dict(
            model=model_name,
            template=template,
            N=world,
            where=loc,
            kind=kind,
            predicted=want[loc][kind],
            simulated=got[loc][kind],
            seconds=seconds,
        )
        for loc in ("device", "cpu")
        for kind in want[loc]
        if want[loc][kind] or got[loc][kind]
    ]


def fit_row(template: str, budget_gb: float, world: int = 8) -> dict:
    """explain.py's largest GPT for `template` on `world` ranks of budget_gb, simulated there."""
    ds = ds_config(template, world)
    best = largest_fit(ds, world, budget_gb * GB)
    if best is None:
        return dict(template=template, model="none of the grid")
    t0 = time.perf_counter()
    got = totals(simulate(best, template, world))
    want = totals(predict(ds, groups_by_formula(best), world))
    params = sum(map(sum, groups_by_formula(best)))
    return dict(
        template=template,
        model=f"{best.n_layer} x {best.n_embd}",
        params=params,
        predicted=want["device"],
        simulated=got["device"],
        cpu_predicted=want["cpu"],
        cpu_simulated=got["cpu"],
        budget=budget_gb * GB,
        seconds=time.perf_counter() - t0,
    )


def gap(predicted: float, simulated: float) -> float:
    return abs(simulated - predicted) / predicted if predicted else float(simulated != 0)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before anything runs
    rows = []
    print(f"{cfg.model}, rank 0 of N simulated under DeepSpeed ZeRO-3 (MB = 10^6 bytes)")
    print(f"{'template':<24}{'N':>4}  {'where':<7}{'kind':<12}{'predicted':>12}{'simulated':>12}")
    for template in SIMULATED:
        for world in map(int, cfg.ns.split(",")):
            for r in template_rows(cfg.model, template, world):
                rows.append(r)
                print(
                    f"{template:<24}{world:>4}  {r['where']:<7}{r['kind']:<12}"
                    f"{r['predicted'] / 1e6:>12.3f}{r['simulated'] / 1e6:>12.3f}"
                )
    worst = max(gap(r["predicted"], r["simulated"]) for r in rows)
    fits = []
    if cfg.fit_budget_gb:
        print(f"largest GPT whose model state fits {cfg.fit_budget_gb:.0f} GB per GPU on 8 ranks:")
        for template in SIMULATED:
            f = fit_row(template, cfg.fit_budget_gb)
            fits.append(f)
            if "params" in f:
                print(
                    f"  {template:<24}{f['model']:<12}{f['params'] / 1e9:>6.1f} B  device "
                    f"{f['predicted'] / GB:.2f} GB predicted, {f['simulated'] / GB:.2f} GB "
                    f"simulated (budget {cfg.fit_budget_gb:.0f}); CPU {f['cpu_predicted'] / GB:.1f}"
                    f" / {f['cpu_simulated'] / GB:.1f} GB ({f['seconds']:.0f} s)",
                    flush=True,
                )
    write_csv(rows, os.path.join(cfg.out_dir, "scale.csv"))
    print(f"the simulation cannot see: {CANNOT_SEE}")
    fit_gap = max((gap(f["predicted"], f["simulated"]) for f in fits if "params" in f), default=0)
    inside = all(f["simulated"] <= f["budget"] for f in fits if "params" in f)
    print(
        f"summary: day23 scale, {len(SIMULATED)} templates at N = {cfg.ns} ({cfg.model}): worst "
        f"|simulated - predicted| {worst:.3%} over {len(rows)} rows; largest fits simulated: "
        f"device gap {fit_gap:.3%}, within the budget {'yes' if inside else 'no'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
