"""Day 28: the single-GPU MFU of GPT-2 124M, tuned: bf16, fused attention, fused AdamW,
torch.compile, and the micro-batch that runs fastest; MFU in nanoGPT's convention beside the
datasheet peak and day 27's measured matmul ceiling.

    torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.bench_mfu          # on one GPU
    torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.bench_mfu --compile=false

MFU = 6N + 12·L·H·Q·T FLOPs per token (PaLM appendix B; nanoGPT's estimate_mfu, full attention)
x tokens/s / the dense bf16 peak (dtl.precision's table: H100/H200 SXM 989 TFLOP/s).
Targets (the README's References): llm.c's GPT-2 124M run works out to ~56% on 8 x A100 (from
scripts/run_gpt2_124M.sh's batch and step time); MPT-125M in llm-foundry reports 44.8%. The
script needs a CUDA GPU: on a CPU it prints a `skipped:` line (the tour shows SKIP); day 27's
bench measures a CPU's MFU against its own ceiling instead.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import torch

from day27_profiling.ceiling import step_ceiling
from day28_gpt125m.ablation import timed_steps
from day28_gpt125m.recipe import Recipe, make_adamw
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.data import load_corpus
from dtl.metrics import peak_flops
from dtl.model import GPT, PRESETS, flops_per_token, preset


@dataclass
class Config:
    model: str = "gpt2-124m"  # GPT preset
    seq_len: int = 1024  # tokens per sequence
    micro_batches: str = "8,16,32"  # micro-batch sizes tried (the fastest is reported)
    steps: int = 10  # timed steps per micro-batch (after 3 warm-up steps)
    compile: bool = True  # torch.compile the model
    out_dir: str = "outputs/day28_gpt125m/bench_mfu"  # config.json

    def validate(self) -> None:
        if self.model not in PRESETS:
            raise dtl_config.ConfigError(f"unknown model '{self.model}'; {', '.join(PRESETS)}")
        try:
            sizes = [int(b) for b in self.micro_batches.split(",")]
        except ValueError:
            raise dtl_config.ConfigError(
                f"micro_batches must be integers, got {self.micro_batches!r}"
            ) from None
        if min(sizes) < 1:
            raise dtl_config.ConfigError("micro_batches must be >= 1")
        if self.seq_len > PRESETS[self.model].block_size:
            raise dtl_config.ConfigError(
                f"seq_len {self.seq_len} exceeds {self.model}'s block_size"
            )


def tokens_per_s(cfg: Config, b: int, tokens, device) -> float | None:
    """Median tokens/s of full training steps at micro-batch b; None if it does not fit."""
    gpt = GPT(preset(cfg.model), seed=0).to(device)
    opt = make_adamw(gpt, Recipe(), fused=True)
    model = torch.compile(gpt) if cfg.compile else gpt
    try:  # 3 warm-up steps: allocation, kernel selection, compilation
        times, _ = timed_steps(
            model, opt, Recipe(precision="bf16"), tokens, cfg.seq_len, b, steps=cfg.steps, warmup=3
        )
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        del model, gpt, opt
        torch.cuda.empty_cache()
    return b * cfg.seq_len / statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    if not torch.cuda.is_available():
        reason = "bench_mfu measures one CUDA GPU; this machine has none (day 27's bench "
        print(f"skipped: {reason}--part=mfu measures a CPU against its own ceiling)", flush=True)
        return
    info = dtl_dist.init()
    if info.device.type != "cuda":  # GPUs present, but the run is on the CPU: no GPU to measure
        dtl_dist.print0(
            f"skipped: bench_mfu measures one CUDA GPU; this run's device is the CPU "
            f"({info.backend}: DTL_BACKEND={os.environ.get('DTL_BACKEND', '')!r})"
        )
        dtl_dist.cleanup()
        return
    dtl_config.save(cfg, cfg.out_dir, argv)
    mcfg = preset(cfg.model)
    tokens = load_corpus(tokenizer="auto").train
    torch.backends.cuda.matmul.allow_tf32 = True
    fpt = flops_per_token(mcfg, cfg.seq_len)  # nanoGPT: full attention
    peak = peak_flops(info.device, "bf16")
    results = {}
    for b in (int(v) for v in cfg.micro_batches.split(",")):
        results[b] = tokens_per_s(cfg, b, tokens, info.device)
        shown = f"{results[b]:,.0f} tokens/s" if results[b] else "out of memory"
        dtl_dist.print0(f"micro-batch {b}: {shown}")
    fitting = [b for b in results if results[b]]
    if not fitting:
        dtl_dist.print0(f"error: no micro-batch of {cfg.micro_batches} fits this GPU's memory")
        dtl_dist.cleanup()
        raise SystemExit(1)
    best = max(fitting, key=lambda b: results[b])
    achieved = fpt * results[best]
    ceiling = step_ceiling(mcfg, best * cfg.seq_len, dtype=torch.bfloat16, device=info.device)
    name = torch.cuda.get_device_name(info.device)
    dtl_dist.print0(
        f"summary: day28 bench_mfu {cfg.model} on {name}: micro-batch {best} x {cfg.seq_len}, "
        f"{results[best]:,.0f} tokens/s, {achieved / 1e12:.1f} TFLOP/s: MFU "
        f"{achieved / peak:.1%} of the {peak / 1e12:.0f} TFLOP/s peak (nanoGPT convention), "
        f"{achieved / ceiling['ceiling']:.1%} of the measured matmul ceiling "
        f"{ceiling['ceiling'] / 1e12:.0f} TFLOP/s; compile={cfg.compile}, bf16, fused AdamW, SDPA"
    )
    dtl_dist.cleanup()


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "outputs/day28_gpt125m/inductor")
    main()
