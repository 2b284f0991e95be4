"""Day 19: train the shared GPT with tensor parallelism (and data parallelism beside it).

CPU (gloo), ~10-20 s:
    torchrun --standalone --nproc_per_node=2 -m day19_tp.train --tp=2
    torchrun --standalone --nproc_per_node=4 -m day19_tp.train --tp=2        # TP 2 x DP 2
    torchrun --standalone --nproc_per_node=4 -m day19_tp.train --tp=4
GPUs (NCCL, TP inside one node):
    torchrun --standalone --nproc_per_node=gpu -m day19_tp.train --tp=2 --config day19_tp/gpu.toml

Environment: OMP_NUM_THREADS=1 (torchrun's default; 2-4 ranks on 2 cores need it).

The grid is ParallelGrid(tp, dp = world / tp): TP ranks are consecutive (Megatron's order), the
DP groups average gradients with torch DDP. Each step prints the loss, this rank's parameters
and the bytes it all-reduced in its TP group (CommCounter), beside the formulas of
day19_tp/formulas.py. At the end rank 0 trains the dense model in one process on the global
batch and compares losses and parameters.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from day19_tp import formulas
from day19_tp.layout import plot_layout
from day19_tp.tp import TPError, apply_tp, check_tp, full_tensors, tp_loss
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import profile as dtl_profile
from dtl.comm import CommCounter
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.grid import ParallelGrid
from dtl.metrics import StepLogger
from dtl.model import GPT, PresetName, preset
from dtl.reference import Verdict, dense_verdict

MB = 1e6


@dataclass
class Config:
    tp: int = 2  # tensor-parallel size (Megatron's tensor_model_parallel_size); dp = world / tp
    model: PresetName = "small"  # GPT preset (`small`: 4 heads, n_embd 128, vocabulary 50,304)
    pad_vocab: bool = False  # pad the vocabulary to a multiple of tp (rows the loss masks out)
    batch_size: int = 4  # sequences per DP rank
    seq_len: int = 64  # tokens per sequence
    steps: int = 5  # optimizer steps
    lr: float = 1e-3  # AdamW learning rate
    check: bool = True  # rank 0 trains the dense model in one process and compares
    seed: int = 0  # model init and batches
    out_dir: str = ""  # where the run writes; empty: outputs/day19_tp/tp<tp>-dp<dp>

    def validate(self) -> None:
        if self.tp < 1:
            raise dtl_config.ConfigError(f"tp must be >= 1, got {self.tp}")
        world = dtl_dist.launch_world_size()
        dp = world // self.tp if world % self.tp == 0 else 0
        self.out_dir = self.out_dir or f"outputs/day19_tp/tp{self.tp}-dp{dp}"
        err = dtl_config.ConfigError
        if world % self.tp:
            raise err(f"tp {self.tp} does not divide the world size {world}")
        try:
            check_tp(preset(self.model), self.tp, self.pad_vocab)
        except TPError as e:
            raise err(str(e)) from None
        if self.seq_len > preset(self.model).block_size:
            raise err(f"seq_len {self.seq_len} exceeds {self.model}'s block_size")


def build(cfg: Config, grid: ParallelGrid, device):
    gpt = apply_tp(GPT(preset(cfg.model), seed=cfg.seed), grid, pad_vocab=cfg.pad_vocab)
    gpt = gpt.to(device)
    model = DDP(gpt, process_group=grid.dp_group) if grid.dp_size > 1 else gpt
    return gpt, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)


def run(cfg: Config, info, grid: ParallelGrid) -> dict:
    mcfg = preset(cfg.model)
    corpus = load_corpus(tokenizer=tokenizer_for(mcfg.vocab_size))
    gpt, model, opt = build(cfg, grid, info.device)
    tokens = cfg.batch_size * cfg.seq_len
    log = StepLogger(cfg.out_dir, cfg.steps, tokens_per_step=tokens * grid.dp_size)
    n_params = sum(p.numel() for p in gpt.parameters())
    losses = []
    for step in range(cfg.steps):
        x, y = get_batch(
            corpus.train,
            cfg.seq_len,
            cfg.batch_size,
            seed=cfg.seed,
            step=step,
            dp_rank=grid.dp_rank,
            dp_size=grid.dp_size,
        )
        x, y = x.to(info.device), y.to(info.device)
        t0 = time.perf_counter()
        # the named ranges of dtl.profile: a torch.profiler trace and Nsight Systems show them
        with dtl_profile.range(dtl_profile.STEP):
            with CommCounter(group=grid.tp_group) as comm:  # the TP group's collectives only
                with dtl_profile.range(dtl_profile.FORWARD):
                    loss = tp_loss(gpt, model(x), y)
                with dtl_profile.range(dtl_profile.BACKWARD):
                    loss.backward()
            with dtl_profile.range(dtl_profile.OPTIMIZER):
                opt.step()
        opt.zero_grad(set_to_none=True)
        if info.device.type == "cuda":  # the step's kernels, not only their launch
            torch.cuda.synchronize(info.device)
        dt = time.perf_counter() - t0
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=grid.dp_group)
        losses.append(mean.item() / grid.dp_size)
        log.log(
            step,
            loss=losses[-1],
            dt_s=dt,
            params_mb=f"{n_params * 4 / MB:.2f}",
            tp_comm_mb=f"{comm.ring_bytes_per_rank() / MB:.3f}",
        )
    log.close()
    return dict(
        gpt=gpt, losses=losses, comm=comm, n_params=n_params, corpus=corpus, full=full_tensors(gpt)
    )


def report(cfg: Config, info, grid: ParallelGrid, result: dict) -> bool:
    mcfg, t = preset(cfg.model), grid.tp_size
    want_params = formulas.params_per_rank(mcfg, t)
    dtl_dist.print0(
        f"parameters per rank: {result['n_params']:,} measured, {want_params:,} formula "
        f"({'exact' if result['n_params'] == want_params else 'MISMATCH'}); dense model "
        f"{formulas.params_per_rank(mcfg, 1):,}"
    )
    tokens = cfg.batch_size * cfg.seq_len
    terms = formulas.comm_elements_per_step(mcfg, tokens)
    want = formulas.ring_bytes(sum(terms.values()), 4, t)
    got = result["comm"].ring_bytes_per_rank()
    calls = result["comm"].calls["all_reduce"]
    dtl_dist.print0(
        f"TP all-reduces in the last step: {calls} calls, {got / MB:.3f} MB sent per rank; "
        f"formula {want / MB:.3f} MB = 2(t-1)/t x 4 B x ("
        + " + ".join(f"{v:,} {k}" for k, v in terms.items())
        + ")"
    )
    verdict = _compare(cfg, info, grid, result)
    ok = verdict.ok and result["n_params"] == want_params and got == want
    dtl_dist.print0(
        f"summary: day19 tp={t} dp={grid.dp_size} model={cfg.model}: {verdict}; params/rank "
        f"{result['n_params']:,} = formula {want_params:,}; TP comm {got / MB:.3f} MB/step vs "
        f"formula {want / MB:.3f} MB ({'exact' if got == want else 'MISMATCH'})"
    )
    return ok


def _compare(cfg: Config, info, grid: ParallelGrid, result: dict) -> Verdict:
    """rank 0 trains the dense model in one process on the global batch (dtl.reference)."""
    return dense_verdict(
        result["losses"],
        result["full"],
        preset(cfg.model),
        result["corpus"].train,
        seq_len=cfg.seq_len,
        rows=cfg.batch_size * grid.dp_size,
        steps=cfg.steps,
        device=info.device,
        check=cfg.check,
        seed=cfg.seed,
        lr=cfg.lr,
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    info = dtl_dist.init()
    grid = ParallelGrid(tp=cfg.tp, dp=info.world_size // cfg.tp)
    dtl_config.save(cfg, cfg.out_dir, argv)
    dtl_dist.print0(f"grid: {grid}")
    result = run(cfg, info, grid)
    ok = report(cfg, info, grid, result)
    if info.is_main:  # who holds which weight elements, drawn by the TP plan itself
        path = os.path.join(cfg.out_dir, "layout.png")
        plot_layout(preset(cfg.model, n_layer=1), cfg.tp, path)
        print(f"layout: {path}", flush=True)
    dtl_dist.finish(ok)


if __name__ == "__main__":
    main()
