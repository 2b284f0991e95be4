"""Day 28: a run's verdict: the one-process reference it is compared with, and its summary lines.

    losses, params, norms = reference(cfg, train_shards)   # the same GPT, recipe and rows, alone
    ok = report(cfg, info, grid, result)                    # the verdict, summary.json, the lines

The reference trains the run's model in one process on the global batch of every step, with the
recipe's AdamW, clipping and schedule; an MoE's runs one forward per micro-batch of that batch
(Config.forwards), as the ranks do. report compares (dtl.reference's verdict), writes what
compare.py reads beside its predictions, and prints the two summary lines.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from day28_gpt125m.recipe import Recipe, lr_at
from day28_gpt125m.strategies import REGISTRY
from dtl import dist as dtl_dist
from dtl.grid import ParallelGrid
from dtl.metrics import mfu, peak_flops
from dtl.model import GPTConfig, flops_per_token
from dtl.reference import ADAM_NORM_RTOL, Verdict, one_process_gpt, reference_verdict


class Config(Protocol):
    """What the verdict reads of train.py's Config (this module does not import train.py)."""

    strategy: str
    model: str
    tp: int
    pp: int
    ep: int
    replicas: int
    seq_len: int
    global_batch_size: int
    steps: int
    seed: int
    check: bool
    resume: bool
    stop_at: int
    runs_precision: str
    out_dir: str

    @property
    def forwards(self) -> int: ...

    def model_config(self) -> GPTConfig: ...

    def recipe(self) -> Recipe: ...


def reference(cfg: Config, train) -> tuple[list[float], dict, list[float]]:
    """The one-process run: the same model, recipe, schedule and global batches; its losses,
    parameters and gradient norms before clipping (with clipping on, Adam and the clip hide a
    gradient scaled by any constant from the losses and parameters: the norms show it)."""
    r = cfg.recipe()
    norms: list[float] = []
    losses, gpt = one_process_gpt(
        cfg.model_config(),
        train.read(0, len(train)),
        seq_len=cfg.seq_len,
        rows=cfg.global_batch_size,
        steps=cfg.steps,
        seed=cfg.seed,
        lr=r.lr,
        weight_decay=r.weight_decay,
        eps=r.eps,
        betas=r.betas,
        clip_grad=r.clip or None,
        grad_norms=norms,
        lr_at=lambda step: lr_at(step, r),
        slices=cfg.forwards if cfg.model_config().moe else 1,  # one aux loss per forward
    )
    return losses, dict(gpt.named_parameters()), norms


def report(cfg: Config, info, grid: ParallelGrid, result: dict) -> bool:
    steady = result["times"][1:] or result["times"]
    med = sorted(steady)[len(steady) // 2]
    tokens_s = cfg.global_batch_size * cfg.seq_len / med
    peak = peak_flops(info.device, cfg.runs_precision)
    fpt = flops_per_token(cfg.model_config(), cfg.seq_len)
    value = mfu(fpt, tokens_s, peak, info.world_size)
    shown = f"{value:.1%}" if value is not None else "n/a (no peak for a CPU)"
    wait = sum(result["waits"][1:]) / sum(steady)  # seconds over seconds
    verdict = Verdict.skip("one-process check skipped (check=false)")
    if cfg.resume or cfg.stop_at:
        verdict = Verdict.skip(
            "one-process check skipped (a run cut in two: compare its losses with a whole one)"
        )
    elif cfg.check:
        verdict = reference_verdict(
            result["losses"],
            result["full"],
            lambda: reference(cfg, result["train"]),
            steps=cfg.steps,
            device=info.device,
            what="one process",
            optimizer="AdamW",
            grad_norms=result["norms"],
            norm_rtol=ADAM_NORM_RTOL,  # dtl.reference says why
        )
    dtl_dist.print0(f"sample (rank 0, top-k 40): {result['sample']!r}")
    if info.is_main:  # what compare.py reads beside its predictions
        state = sum(result["state"].values()) if result["state"] else None
        summary = dict(
            run=os.path.basename(cfg.out_dir),
            strategy=cfg.strategy,
            model=cfg.model,
            world=info.world_size,
            tp=cfg.tp,
            pp=cfg.pp,
            state_bytes=state,
            tokens_per_s=tokens_s,
            final_loss=result["losses"][-1],
        )
        with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    dtl_dist.print0(
        f"summary: day28 {cfg.strategy} {cfg.model} on {info.world_size} ranks ({grid}): {verdict}"
    )
    if result["state"]:  # rank 0's model state against its prediction (fit.py's formulas)
        sizes = dict(world=info.world_size, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, replicas=cfg.replicas)
        want = REGISTRY[cfg.strategy].predicted_rank_state(
            cfg.model_config(), **sizes, pp_rank=grid.pp_rank, precision=cfg.runs_precision
        )
        dtl_dist.print0(
            f"summary: model state, rank 0: {sum(result['state'].values()) / 1e6:.4f} MB "
            f"(predicted {want / 1e6:.4f} MB)"
        )
    if result["sent"] is not None:  # a strategy that counts its bytes per axis: rank 0's
        pairs = ", ".join(
            f"{axis} {got:,.0f} B (formula {result['predicted_sent'][axis]:,.0f})"
            for axis, got in result["sent"].items()
        )
        dtl_dist.print0(f"summary: bytes sent in the last step, rank 0, per axis: {pairs}")
    val = result["val_loss"] or 0.0  # rank 0 evaluates; print0 prints there
    dtl_dist.print0(
        f"summary: final loss {result['losses'][-1]:.4f}, val loss {val:.4f}; "
        f"{tokens_s:,.0f} tokens/s, MFU {shown}; waiting for data {wait:.1%} of the step time"
    )
    return verdict.ok
