"""Day 28: operator acceleration, one switch at a time: fused attention, fused AdamW,
torch.compile. Each measured as the speed-up of a training step over its baseline, on the device
the run has (one process).

CPU:  torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.ablation
GPU:  torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.ablation --model=gpt2-124m \\
          --seq_len=1024 --batch_size=8 --precision=bf16

    attention  written out (dtl.model.naive_attention: the (T, T) scores materialized, softmax,
               then V) vs F.scaled_dot_product_attention (fused; FlashAttention on a GPU)
    AdamW      a Python loop over tensors (foreach=False) vs foreach (a few kernels for many
               tensors) vs fused (one kernel; torch has it for CUDA and CPU)
    compile    eager vs torch.compile (Inductor: fused elementwise kernels around the matmuls);
               the first, compiling step is left out of the timing
Every variant trains the same model from the same init on the same batches, so the losses are
printed too: a speed-up that changed the math would show there. Timings on a shared 2-core box
are noisy: each variant runs once, in the order above, and each figure is a median over the
steps after the first.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch

from day28_gpt125m.recipe import AUTOCAST, Recipe, autocast, make_adamw
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.conversion import apply_conversion
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.deepspeed import DsConfigError, planned_device_type
from dtl.metrics import write_csv
from dtl.model import GPT, PRESETS, GPTConfig, loss_fn, naive_attention
from dtl.precision import PRECISIONS, PrecisionError, PrecisionName

# the CPU default: a small GPT at a long sequence (512 tokens, 128 wide), where attention is a
# large share of the step; `small` at 128 tokens spends it in its 50,304-word head instead
MODELS = {
    **PRESETS,
    "long-tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=512, vocab_size=256),
}

VARIANTS = {  # name -> (attention, optimizer mode, compile); the first of a group is its baseline
    "attention: written out": ("naive", "foreach", False),
    "attention: fused SDPA": ("sdpa", "foreach", False),
    "AdamW: for-loop": ("sdpa", "loop", False),
    "AdamW: foreach": ("sdpa", "foreach", False),
    "AdamW: fused": ("sdpa", "fused", False),
    "compile: eager": ("sdpa", "foreach", False),
    "compile: torch.compile": ("sdpa", "foreach", True),
}


@dataclass
class Config:
    model: str = "long-tiny"  # a GPT preset, or long-tiny (4 x 128, 512 positions, bytes)
    seq_len: int = 512  # tokens per sequence
    batch_size: int = 4  # sequences per step
    steps: int = 6  # timed steps per variant (plus one warm-up)
    only: str = ""  # comma-separated groups to run (attention, AdamW, compile); empty: all
    precision: PrecisionName = "fp32"  # autocast to it (bf16 on GPUs: recipe.AUTOCAST)
    out_dir: str = "outputs/day28_gpt125m/ablation"  # ablation.csv

    def validate(self) -> None:
        if self.model not in MODELS:
            raise dtl_config.ConfigError(f"unknown model '{self.model}'; {', '.join(MODELS)}")
        if self.seq_len > MODELS[self.model].block_size:
            raise dtl_config.ConfigError(f"seq_len {self.seq_len} exceeds the model's block_size")
        unknown = [g for g in self.only.split(",") if g and g not in GROUPS]
        if unknown:
            raise dtl_config.ConfigError(f"unknown group(s) {unknown}; {', '.join(GROUPS)}")
        try:  # the run's device, known before anything is built (dtl.dist's rule)
            AUTOCAST.require(self.precision, planned_device_type())
        except (PrecisionError, DsConfigError) as e:
            raise dtl_config.ConfigError(str(e)) from None


GROUPS = ("attention", "AdamW", "compile")  # what --only picks from

OPTIMIZER_MODES = {  # mode -> make_adamw's (fused, foreach)
    "loop": (False, False),
    "foreach": (False, True),
    "fused": (True, None),
}


def measure(cfg: Config, variant: tuple, tokens, device) -> dict:
    attention, opt_mode, compiled = variant
    gpt = apply_conversion(GPT(MODELS[cfg.model], seed=0), PRECISIONS[cfg.precision]).to(device)
    if attention == "naive":
        gpt.set_attention(naive_attention)
    r = Recipe(precision=cfg.precision)
    fused, foreach = OPTIMIZER_MODES[opt_mode]
    opt = make_adamw(gpt, r, fused=fused, foreach=foreach)
    model = torch.compile(gpt) if compiled else gpt
    # the first step allocates, selects kernels, and (compile) compiles: left out of the timing
    times, losses = timed_steps(
        model, opt, r, tokens, cfg.seq_len, cfg.batch_size, steps=cfg.steps, warmup=1
    )
    params = {n: p.detach().clone() for n, p in gpt.named_parameters()}  # after the last step
    return dict(ms=statistics.median(times) * 1e3, losses=losses, params=params)


def timed_steps(
    model, opt, r: Recipe, tokens, seq_len: int, batch_size: int, *, steps: int, warmup: int
) -> tuple[list[float], list[float]]:
    """`warmup + steps` training steps on dtl.data.get_batch rows (seed 0, one row set per
    step); returns the seconds of the last `steps` (the device synchronized around each) and
    every step's loss."""
    device = next(model.parameters()).device
    times, losses = [], []
    for step in range(warmup + steps):
        x, y = (t.to(device) for t in get_batch(tokens, seq_len, batch_size, seed=0, step=step))
        _sync(device)
        t0 = time.perf_counter()
        with autocast(r, device):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times, losses


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    mcfg = MODELS[cfg.model]
    tokens = load_corpus(tokenizer=tokenizer_for(mcfg.vocab_size)).train
    groups = [g for g in cfg.only.split(",") if g] or list(GROUPS)
    rows = []
    for name, variant in VARIANTS.items():
        group = name.split(":")[0]
        if group not in groups:
            continue
        m = measure(cfg, variant, tokens, info.device)
        base = next((r for r in rows if r["group"] == group), None)
        rows.append(
            dict(
                group=group,
                variant=name.split(": ")[1],
                ms=m["ms"],
                speedup=(base["ms"] / m["ms"]) if base else 1.0,
                final_loss=m["losses"][-1],
            )
        )
        dtl_dist.print0(f"{name}: {m['ms']:.0f} ms per step, final loss {m['losses'][-1]:.5f}")
    dtl_dist.print0(f"{'group':<11}{'variant':<16}{'ms/step':>9}{'speed-up':>10}{'loss':>10}")
    for r in rows:
        dtl_dist.print0(
            f"{r['group']:<11}{r['variant']:<16}{r['ms']:>9.0f}{r['speedup']:>9.2f}x"
            f"{r['final_loss']:>10.5f}"
        )
    write_csv(rows, os.path.join(cfg.out_dir, "ablation.csv"))
    best = {
        g: max((r for r in rows if r["group"] == g), key=lambda r: r["speedup"]) for g in groups
    }
    same = all(
        abs(r["final_loss"] - rows[0]["final_loss"]) < 1e-2 for r in rows
    )  # the math did not change (compile and fused kernels reorder float sums: ~1e-6)
    where = "GPU" if info.device.type == "cuda" else "CPU"
    dtl_dist.print0(
        f"summary: day28 ablation on {where}, {cfg.model}: "
        + "; ".join(f"{g} best {b['variant']} {b['speedup']:.2f}x" for g, b in best.items())
        + f"; losses agree {'yes' if same else 'NO'}"
    )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
