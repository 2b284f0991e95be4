"""Day 18: where the memory goes. The paper's formulas, measured at N = 1, 2, 4, extrapolated.

CPU (gloo), 4 processes, ~30 s:
    torchrun --standalone --nproc_per_node=4 -m day18_zero.memory
GPUs: torchrun --standalone --nproc_per_node=gpu -m day18_zero.memory --model=gpt2-124m

One launch measures every N that fits: it builds process groups of the first 1, 2, 4, ...
ranks, trains two steps of hand-written ZeRO on each (fp32 and mixed precision), and counts
the bytes of parameters, gradients and optimizer state that rank 0 holds just before the
optimizer step. Stage 0 is measured on a group of one rank: a DDP replica holds the same state
whatever N is. Then a table for N = 1 ... 1024 (formula beyond the measured N), DeepSpeed's own
estimators beside ours, the paper's 7.5B example, and memory.png.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from day18_zero import engines, formulas
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.metrics import write_csv
from dtl.model import GPT, PRESETS, preset
from dtl.optim import OptimConfig
from dtl.precision import PRECISIONS

FORMULA_NS = (8, 64, 1024)
MB = 1e6


@dataclass
class Config:
    model: str = "small"  # GPT preset whose model states are measured
    seq_len: int = 32  # tokens per sequence of the two measured steps
    batch_size: int = 2  # sequences per rank
    out_dir: str = "outputs/day18_zero/memory"  # table.csv and memory.png go here

    def validate(self) -> None:
        if self.model not in PRESETS:
            raise dtl_config.ConfigError(
                f"unknown model '{self.model}'; one of {', '.join(PRESETS)}"
            )
        if self.seq_len > preset(self.model).block_size:
            raise dtl_config.ConfigError(
                f"seq_len {self.seq_len} exceeds {self.model}'s block_size"
            )


def measured_sizes(world: int) -> list[int]:
    """1, 2, 4, ... up to the world size."""
    sizes, n = [], 1
    while n <= world:
        sizes.append(n)
        n *= 2
    return sizes


def measure(cfg: Config, stage: int, dtype: torch.dtype, group, device) -> tuple[dict, int]:
    """Two hand-ZeRO steps on `group`; this rank's state bytes before the second step's update
    (the optimizer state exists from the first step on), and the elements it shards (Ψ padded
    so that every bucket splits into equal slices)."""
    gpt = GPT(preset(cfg.model), seed=0).to(device=device, dtype=dtype)
    trainer = engines.HandZero(gpt, max(stage, 1), group, OptimConfig(), no_sync=True)
    vocab = preset(cfg.model).vocab_size
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, vocab, (cfg.batch_size, cfg.seq_len + 1), generator=g).to(device)
        trainer.step([(x[:, :-1], x[:, 1:])])
    return trainer.bytes_before_step, trainer.padded_numel()


def measure_all(cfg: Config, info) -> dict[tuple, tuple[dict, int]]:
    """(precision, stage, N) -> (bytes, padded Ψ) on rank 0, for every N that fits the world."""
    out = {}
    for n in measured_sizes(info.world_size):
        group = dist.new_group(list(range(n)))  # every rank takes part in creating it
        if info.rank < n:
            for prec in ("fp32", "bf16"):
                for stage in (1, 2, 3) if n > 1 else (0, 1, 2, 3):
                    key = (prec, stage, n)
                    out[key] = measure(cfg, stage, PRECISIONS[prec].storage, group, info.device)
        dist.barrier()
    for prec in ("fp32", "bf16"):  # stage 0: a replica, the same for every N (rank 0 has it)
        for n in measured_sizes(info.world_size)[1:] if info.rank == 0 else ():
            out[(prec, 0, n)] = out[(prec, 0, 1)]
    return out


def table(psi: int, measured: dict, world: int) -> list[dict]:
    rows = []
    for prec in ("fp32", "bf16"):
        p = PRECISIONS[prec]
        for stage in formulas.STAGES_ALL:
            for n in (*measured_sizes(world), *FORMULA_NS):
                got, padded = measured.get((prec, stage, n), (None, None))
                # measured: the formula at the Ψ it padded to (to the byte); else the paper's
                want = formulas.model_state_bytes(psi, n, stage, p, padded=padded)
                rows.append(
                    dict(
                        precision=prec,
                        stage=stage,
                        N=n,
                        formula_mb=want.total / MB,
                        measured_mb=None if got is None else sum(got.values()) / MB,
                        params_mb=None if got is None else got["params"] / MB,
                        grads_mb=None if got is None else got["grads"] / MB,
                        optim_mb=None if got is None else got["optim"] / MB,
                    )
                )
    return rows


def print_table(rows: list[dict], psi: int) -> float:
    """Prints the table; returns the largest |measured - formula| / formula."""
    worst = 0.0
    print(
        f"model states per rank, Ψ = {psi:,} parameters (MB = 10^6 bytes); measured = "
        "rank 0's live tensors before the optimizer step",
        flush=True,
    )
    for prec in ("fp32", "bf16"):
        p = PRECISIONS[prec]
        print(f"\n{prec}: {p.param} + {p.grad} + {p.optim} bytes per parameter", flush=True)
        print(
            f"{'stage':<7}{'N':>6}{'params':>10}{'grads':>10}{'optim':>10}"
            f"{'measured':>11}{'formula':>11}{'diff':>9}",
            flush=True,
        )
        for r in (r for r in rows if r["precision"] == prec):
            if r["measured_mb"] is None:
                cells = f"{'':>10}{'':>10}{'':>10}{'-':>11}"
                diff = ""
            else:
                err = (r["measured_mb"] - r["formula_mb"]) / r["formula_mb"]
                worst = max(worst, abs(err))
                exact = r["measured_mb"] == r["formula_mb"]
                cells = (
                    f"{r['params_mb']:>10.3f}{r['grads_mb']:>10.3f}{r['optim_mb']:>10.3f}"
                    f"{r['measured_mb']:>11.3f}"
                )
                diff = "exact" if exact else f"{err:+.2%}"
            print(f"{r['stage']:<7}{r['N']:>6}{cells}{r['formula_mb']:>11.3f}{diff:>9}", flush=True)
    return worst


def deepspeed_estimates(gpt: torch.nn.Module, psi: int) -> None:
    """DeepSpeed's own estimators (mixed precision, no offload) beside the paper's formula."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        print(
            "DeepSpeed estimators: skipped (DeepSpeed is not installed: pip install -e "
            "'.[deepspeed]')",
            flush=True,
        )
        return
    largest = max(p.numel() for p in gpt.parameters())
    mixed = PRECISIONS["bf16"]  # the paper's mixed precision: 2 + 2 + 12
    print(
        "\nDeepSpeed's estimators (GPU bytes, no offload) vs the paper's formula, mixed precision:",
        flush=True,
    )
    print(f"{'N':>6}{'zero2 DS':>12}{'paper s2':>12}{'zero3 DS':>12}{'paper s3':>12}", flush=True)
    for n in (1, 2, 4, *FORMULA_NS):
        _, z2 = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=n, cpu_offload=False)
        _, z3, _ = estimate_zero3_model_states_mem_needs(
            psi, largest, num_gpus_per_node=n, cpu_offload=False, cpu_offload_params=False
        )
        s2 = formulas.model_state_bytes(psi, n, 2, mixed).total
        s3 = formulas.model_state_bytes(psi, n, 3, mixed).total
        print(f"{n:>6}{z2 / MB:>12.2f}{s2 / MB:>12.2f}{z3 / MB:>12.2f}{s3 / MB:>12.2f}", flush=True)
    if psi >= 1e8:  # DeepSpeed's own printed tables (GB, 2 decimals: all 0.00 for small models)
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
        from deepspeed.runtime.zero.stage_1_and_2 import (
            estimate_zero2_model_states_mem_needs_all_live,
        )

        n = dist.get_world_size()
        estimate_zero2_model_states_mem_needs_all_live(gpt, num_gpus_per_node=n)
        estimate_zero3_model_states_mem_needs_all_live(gpt, num_gpus_per_node=n)
    else:
        print(
            "(DeepSpeed's estimate_zero2/3_model_states_mem_needs_all_live print these same "
            "functions' results in GB with 2 decimals: 0.00 GB for this model; they print "
            "for models of 100M+ parameters, e.g. --model=gpt2-124m)",
            flush=True,
        )
    print(
        "DeepSpeed counts 18 bytes per parameter per N (2 bf16 grads + 4 fp32 grads + 4 fp32 "
        "master + 8 Adam) where the paper counts 14, and its zero3 adds 4 x the largest layer "
        f"({largest:,} parameters) for the gathered one",
        flush=True,
    )


def paper_line() -> str:
    got = formulas.paper_example()
    return "paper example (Ψ = 7.5B, N = 64, mixed): " + ", ".join(
        f"stage {s} {got[s]:.1f} GB (paper: {formulas.PAPER_GB[s]})" for s in formulas.STAGES_ALL
    )


def plot(rows: list[dict], psi: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ns = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    for ax, prec in zip(axes, ("bf16", "fp32")):
        p = PRECISIONS[prec]
        for stage in formulas.STAGES_ALL:
            line = [formulas.model_state_bytes(psi, n, stage, p).total / MB for n in ns]
            (h,) = ax.plot(ns, line, label=f"stage {stage} (formula)")
            pts = [
                (r["N"], r["measured_mb"])
                for r in rows
                if r["precision"] == prec and r["stage"] == stage and r["measured_mb"]
            ]
            if pts:
                ax.plot(*zip(*pts), "o", color=h.get_color(), label=f"stage {stage} measured")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="data-parallel ranks N",
            ylabel="model-state MB per rank",
            title=f"{prec}: {p.param}+{p.grad}+{p.optim} B/param, Ψ = {psi / 1e6:.1f}M",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    measured = measure_all(cfg, info)
    ok = True
    if info.is_main:
        gpt = GPT(preset(cfg.model), seed=0)
        psi = sum(p.numel() for p in gpt.parameters())
        rows = table(psi, measured, info.world_size)
        worst = print_table(rows, psi)
        deepspeed_estimates(gpt, psi)
        print(paper_line(), flush=True)
        write_csv(rows, os.path.join(cfg.out_dir, "table.csv"))
        png = os.path.join(cfg.out_dir, "memory.png")
        plot(rows, psi, png)
        print(f"wrote {png}", flush=True)
        sizes = ", ".join(map(str, measured_sizes(info.world_size)))
        got = [r for r in rows if r["measured_mb"] is not None]
        exact = sum(r["measured_mb"] == r["formula_mb"] for r in got)  # to the byte (see table)
        ok = exact == len(got)
        print(
            f"summary: memory measured at N = {sizes} for stages 0-3 in fp32 and mixed "
            f"precision: worst |measured - formula| = {worst:.2%} of the formula; "
            f"{exact}/{len(got)} measured rows exact to the byte",
            flush=True,
        )
        print(f"summary: {paper_line()}", flush=True)
    dtl_dist.finish(ok)  # exit 1 when a measured row is off the formula by a byte


if __name__ == "__main__":
    main()
