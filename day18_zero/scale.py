"""Day 18 at scale: our hand ZeRO-1/2/3 and torch's FSDP2 as one rank of 8, 64 and 1,024,
simulated in one process.

    torchrun --standalone --nproc_per_node=1 -m day18_zero.scale
    ... --models=gpt-1.3b --ns=8,64,1024 --engines=hand-3,fsdp2-2,fsdp2-3 --precision=bf16

memory.py measures N = 1, 2, 4 (the ranks this box has). Here the same engines run as rank 0 of
N ranks under dtl.simulate.fake_world: a fake process group of N ranks and fake tensors (shapes,
no data), two optimizer steps, then what the rank holds (its live tensors, as memory.py counts
them) and what it sent in the last step (dtl.comm.CommCounter, from the shapes), beside the
formulas of formulas.py at the Ψ the engine padded to (our buckets pad each bucket to a multiple
of N; FSDP2 pads each parameter's first dimension). A 1.3 B model takes about a second per row by
hand and a few seconds with FSDP2 (10-20 s at N = 1,024: it cuts every parameter into N pieces).
Engines: hand-1/2/3 (zero.ZeroModel), fsdp2-2 (fully_shard, reshard_after_forward=False) and
fsdp2-3 (fully_shard). torch's stage 1 (DDP + ZeroRedundancyOptimizer) is not simulated: DDP's
Reducer is C++ and reads its buckets back, which fake tensors cannot give.
What a simulation cannot see: dtl.simulate.CANNOT_SEE.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from day18_zero import engines, formulas
from dtl import config as dtl_config
from dtl.comm import CommCounter
from dtl.metrics import write_csv
from dtl.model import GPT, PRESETS, GPTConfig, num_params
from dtl.optim import OptimConfig
from dtl.precision import ANY_DEVICE, PRECISIONS, PrecisionError, PrecisionName, declare
from dtl.simulate import CANNOT_SEE, fake_world
from dtl.state import StateBytes

MB = 1e6
MODELS = {
    **PRESETS,
    # GPT-3 XL's shape (Brown et al. 2020, table 2.1): 24 layers, 2,048 wide, 1.3 B parameters
    "gpt-1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=50304),
}


@dataclass
class Config:
    models: str = "small,gpt-1.3b"  # comma-separated: a GPT preset or gpt-1.3b
    ns: str = "8,64,1024"  # data-parallel world sizes to simulate
    engines: str = "hand-1,hand-2,hand-3,fsdp2-3"  # <impl>-<stage>: hand-1..3, fsdp2-2, fsdp2-3
    precision: PrecisionName = "fp32"  # fp32 | bf16 (bf16 params and grads, fp32 masters)
    seq_len: int = 16  # tokens per sequence (activations are not in the table)
    out_dir: str = "outputs/day18_zero/scale"  # scale.csv: every row, formula and simulated

    def validate(self) -> None:
        err = dtl_config.ConfigError
        unknown = [m for m in self.models.split(",") if m not in MODELS]
        if unknown:
            raise err(f"unknown model(s) {unknown}; {', '.join(MODELS)}")
        dtl_config.int_list("ns", self.ns)
        unknown = [e for e in self.engines.split(",") if e not in ENGINES]
        if unknown:
            raise err(f"unknown engine(s) {unknown}; {', '.join(ENGINES)}")
        try:  # on fake tensors: no device runs, the host's rule applies
            SIMULATED.require(self.precision, "cpu")
        except PrecisionError as e:
            raise err(str(e)) from None


# What the simulation holds state in: the hand stages' fp32 masters, and FSDP2's parameters,
# gradients and Adam state in the training dtype (no master; day 18's train refuses to train so)
SIMULATED = declare(
    "day 18's simulated ZeRO (hand stages 1-3, FSDP2)",
    {"fp32": ANY_DEVICE, "bf16": ANY_DEVICE},
    why="fp16 needs a loss scaler, which the hand engine lacks; fp8 is not simulated",
)

# engine name -> (engines.build's impl, stage); "fsdp2" is impl "torch" at stages 2 and 3
ENGINES = {
    **{f"hand-{s}": ("hand", s) for s in (1, 2, 3)},
    **{f"fsdp2-{s}": ("torch", s) for s in (2, 3)},
}


def simulate(
    model: GPTConfig, stage: int, n: int, precision: str, seq_len: int = 16, impl: str = "hand"
) -> dict:
    """Rank 0 of `n` running `impl` ZeRO `stage`: its state before the second step's update, the
    Ψ it padded to, and the ring bytes it sent in that step."""
    dtype = PRECISIONS[precision].storage
    with fake_world(n):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # fake parameters cannot be cast in place: make them so
        try:
            gpt = GPT(model, seed=0)
        finally:
            torch.set_default_dtype(default)
        trainer = engines.build(impl, stage, gpt, None, OptimConfig(), no_sync=True)
        x = torch.randint(0, model.vocab_size, (1, seq_len + 1))  # host: fake, no device runs
        return two_steps(trainer, [(x[:, :-1], x[:, 1:])], precision)


def two_steps(trainer: engines.Trainer, batch, precision: str) -> dict:
    """Two optimizer steps on `batch`, the second counted (the optimizer state exists from the
    first on): the state held before its update, the Ψ the buckets padded to, and the ring
    bytes sent. What simulate() reads at scale, and the tests read from a real gloo run."""
    trainer.run_step(batch)
    with CommCounter() as comm:
        trainer.run_step(batch)
    held: StateBytes = trainer.bytes_before_step
    return dict(
        held=held,
        padded=trainer.padded_numel(),
        sent=sum(comm.ring_bytes.values()),
        precision=trainer.state_precision(PRECISIONS[precision]),
        formula_stage=trainer.formula_stage(),
    )


def row(name: str, engine: str, n: int, precision: str, seq_len: int) -> dict:
    model = MODELS[name]
    impl, stage = ENGINES[engine]
    t0 = time.perf_counter()
    sim = simulate(model, stage, n, precision, seq_len, impl)
    psi = num_params(model)  # a tied weight once
    want = formulas.model_state_bytes(
        psi, n, sim["formula_stage"], sim["precision"], padded=sim["padded"]
    )
    elem = PRECISIONS[precision].storage.itemsize
    return dict(
        model=name,
        engine=engine,
        N=n,
        psi=psi,
        simulated=sum(sim["held"].values()),
        formula=want.total,
        sent=sim["sent"],
        sent_formula=formulas.comm_bytes_per_rank(sim["padded"], n, stage, elem),
        seconds=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before anything runs
    rows = []
    print(
        f"ZeRO, rank 0 of N simulated ({cfg.precision}; MB = 10^6 bytes): model state "
        "held and ring bytes sent per step, simulated vs formulas.py at the padded Ψ"
    )
    print(
        f"{'model':<10}{'engine':>8}{'N':>6}{'state sim':>12}{'formula':>12}"
        f"{'sent sim':>12}{'formula':>12}{'s':>6}"
    )
    for name in cfg.models.split(","):
        for engine in cfg.engines.split(","):
            for n in map(int, cfg.ns.split(",")):
                r = row(name, engine, n, cfg.precision, cfg.seq_len)
                rows.append(r)
                print(
                    f"{name:<10}{engine:>8}{n:>6}{r['simulated'] / MB:>12.3f}"
                    f"{r['formula'] / MB:>12.3f}{r['sent'] / MB:>12.3f}"
                    f"{r['sent_formula'] / MB:>12.3f}{r['seconds']:>6.1f}",
                    flush=True,
                )
    write_csv(rows, os.path.join(cfg.out_dir, "scale.csv"))
    state_gap = max(abs(r["simulated"] - r["formula"]) for r in rows)
    sent_gap = max(abs(r["sent"] - r["sent_formula"]) for r in rows)
    print(f"the simulation cannot see: {CANNOT_SEE}")
    ns = ", ".join(cfg.ns.split(","))
    ok = state_gap == 0 and sent_gap == 0
    print(
        f"summary: day18 scale, {cfg.engines} at N = {ns} ({cfg.models}, "
        f"{cfg.precision}): worst |simulated - formula| state {state_gap:.0f} B, sent "
        f"{sent_gap:.0f} B over {len(rows)} rows",
        flush=True,
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
