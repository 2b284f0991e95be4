"""Day 24 benchmark: how long a save blocks training, sync vs async, and what lands on disk.

    torchrun --standalone --nproc_per_node=2 -m day24_checkpoint.bench
    torchrun --standalone --nproc_per_node=2 -m day24_checkpoint.bench --models=tiny   # seconds

For each model (DDP, AdamW, one step taken so the optimizer state exists): `saves` synchronous
saves, then `saves` asynchronous ones with a training step running while each is written. Per
save: the time the training loop was blocked (sync: the whole write; async: staging the copy),
the time to the commit, and the step time while an async write runs beside it (the writer thread
competes for the CPU). Then the bytes on disk beside the formula: 4 bytes of fp32 weights and 8
of Adam moments per parameter (12 Ψ), plus the tied lm_head weight written under its own name.
Restart overhead (kill to first resumed step) is measured by drill.py --drill=kill_rank.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from day24_checkpoint.ckpt import AppState, Checkpointer, latest
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.model import GPT, PRESETS, loss_fn, preset

MB = 1e6


@dataclass
class Config:
    models: str = "tiny,small,gpt2-124m"  # GPT presets, comma-separated
    saves: int = 2  # saves of each kind per model
    seq_len: int = 64  # tokens per sequence
    batch_size: int = 2  # sequences per rank
    out_dir: str = "outputs/day24_checkpoint/bench"  # checkpoints (deleted after each model)

    def validate(self) -> None:
        for name in self.models.split(","):
            if name not in PRESETS:
                raise dtl_config.ConfigError(f"unknown model '{name}'; one of {', '.join(PRESETS)}")


def measure(cfg: Config, name: str, info) -> dict:
    mcfg = preset(name)
    corpus = load_corpus(tokenizer=tokenizer_for(mcfg.vocab_size))
    seq_len = min(cfg.seq_len, mcfg.block_size)
    gpt = GPT(mcfg, seed=0).to(info.device)
    model = DDP(gpt) if info.world_size > 1 else gpt
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = [0]

    def train_step() -> float:
        x, y = get_batch(
            corpus.train,
            seq_len,
            cfg.batch_size,
            seed=0,
            step=step[0],
            dp_rank=info.rank,
            dp_size=info.world_size,
        )
        t0 = time.perf_counter()
        loss_fn(model(x.to(info.device)), y.to(info.device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if info.device.type == "cuda":  # the step's kernels, not their launch
            torch.cuda.synchronize(info.device)
        step[0] += 1
        return time.perf_counter() - t0

    plain = statistics.median(train_step() for _ in range(3))
    app = AppState(model, opt)
    out = dict(model=name, params=sum(p.numel() for p in gpt.parameters()), step_s=plain)
    for mode in ("sync", "async"):
        root = os.path.join(cfg.out_dir, f"{name}-{mode}")
        ckpt = Checkpointer(root, keep=1, async_save=mode == "async")
        beside = []
        for _ in range(cfg.saves):
            ckpt.save(app, step[0])
            beside.append(train_step())  # async: runs while the thread writes
            ckpt.wait()
        out[mode] = dict(
            blocked=statistics.median(r.blocked_s for r in ckpt.records),
            total=statistics.median(r.total_s for r in ckpt.records),
            step_beside=statistics.median(beside),
        )
        out["disk"] = 0
        if info.is_main:  # rank 0 commits, so only rank 0 is sure the folder is final
            path = latest(root)
            out["disk"] = sum(
                os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f != "meta.json"
            )
            shutil.rmtree(root, ignore_errors=True)
    tied = mcfg.vocab_size * mcfg.n_embd * 4 if mcfg.tie_weights else 0
    out["formula"] = 12 * out["params"] + tied
    return out


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    rows = [measure(cfg, name, info) for name in cfg.models.split(",")]
    dtl_dist.print0(
        f"{info.world_size} ranks, DDP, fp32 AdamW; median of {cfg.saves} saves; ms\n"
        f"{'model':<11}{'params':>13}{'step':>8}{'sync blocked':>14}{'async blocked':>15}"
        f"{'async to commit':>17}{'step beside':>13}{'disk MB':>9}{'formula MB':>12}"
    )
    for r in rows:
        dtl_dist.print0(
            f"{r['model']:<11}{r['params']:>13,}{r['step_s'] * 1e3:>8.0f}"
            f"{r['sync']['blocked'] * 1e3:>14.1f}{r['async']['blocked'] * 1e3:>15.1f}"
            f"{r['async']['total'] * 1e3:>17.1f}{r['async']['step_beside'] * 1e3:>13.0f}"
            f"{r['disk'] / MB:>9.2f}{r['formula'] / MB:>12.2f}"
        )
    parts = [
        f"{r['model']} sync {r['sync']['blocked'] * 1e3:.0f} / async "
        f"{r['async']['blocked'] * 1e3:.0f} ms "
        f"(x{r['sync']['blocked'] / r['async']['blocked']:.1f}), "
        f"disk/formula {r['disk'] / r['formula']:.2f}"
        for r in rows
    ]
    dtl_dist.print0(f"summary: day24 bench blocked per save: {'; '.join(parts)}")
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
