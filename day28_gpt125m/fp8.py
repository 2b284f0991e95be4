"""Day 28: FP8 training's numbers on any device: the fp8 precision row (bf16 autocast, every
linear but the output head in float8 through dtl.conversion) against bf16, step by step.

CPU:  torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.fp8
GPU:  torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.fp8 --model=gpt2-124m \\
          --seq_len=1024 --batch_size=8

Two runs from the same init on the same batches: the fp8 row and bf16. At every step of the
fp8 run, each float8 layer is held against its own matmul in fp32 on the same inputs
(dtl.float8.LayerBars: output, input gradient, weight gradient), by torchao's bars: output SQNR
>= 18 dB, gradients >= 17 dB. Then the two runs' losses side by side. On a CPU,
torch._scaled_mm computes in fp32 from the float8 values, so the numbers are FP8 training's and
the time is not (not measured here; an H100's datasheet gives float8 matmuls twice its bf16
rate, not run on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.conversion import apply_conversion
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.float8 import LayerBars
from dtl.model import GPT, PresetName, loss_fn, preset
from dtl.precision import PRECISIONS

OUTPUT_BAR_DB, GRAD_BAR_DB = 18.0, 17.0  # torchao's bars for a float8 layer against high precision
LOSS_BAND = 0.01  # the fp8 run's last loss within 1% of bf16's


@dataclass
class Config:
    model: PresetName = "small"  # the GPT preset both runs train
    seq_len: int = 64  # tokens per sequence
    batch_size: int = 4  # sequences per step
    steps: int = 20  # AdamW steps of each run
    lr: float = 1e-3  # AdamW's learning rate, constant

    def validate(self) -> None:
        if self.seq_len > preset(self.model).block_size:
            raise dtl_config.ConfigError(
                f"seq_len {self.seq_len} exceeds {self.model}'s block_size"
            )


def train(cfg: Config, tokens, precision: str, device: torch.device, bars: bool = False) -> dict:
    """`cfg.steps` AdamW steps of the GPT in the row `precision` (its autocast, its conversion)
    on batches of `tokens`; the losses, and with `bars` each step's worst float8-layer SQNR."""
    row = PRECISIONS[precision]
    mcfg = preset(cfg.model)
    model = apply_conversion(GPT(mcfg, seed=0), row).to(device)
    watch = LayerBars(model) if bars else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses, per_step = [], []
    for step in range(cfg.steps):
        x, y = get_batch(tokens, cfg.seq_len, cfg.batch_size, seed=0, step=step)
        x, y = x.to(device), y.to(device)
        with row.autocast(device.type):
            loss = loss_fn(model(x), y)
        loss.backward()
        if watch is not None:
            per_step.append(watch.check_weight_grads())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return dict(losses=losses, per_step=per_step, worst=watch.worst if watch else {})


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    info = dtl_dist.init()
    tokens = load_corpus(tokenizer=tokenizer_for(preset(cfg.model).vocab_size)).train
    fp8 = train(cfg, tokens, "fp8", info.device, bars=True)
    bf16 = train(cfg, tokens, "bf16", info.device)
    dtl_dist.print0(
        f"{cfg.model}, {cfg.steps} AdamW steps of {cfg.batch_size} x {cfg.seq_len} tokens; worst "
        "float8 layer against its fp32 matmul, SQNR dB"
    )
    dtl_dist.print0(f"{'step':>4}{'loss fp8':>10}{'loss bf16':>11}{'output':>8}{'dx':>7}{'dW':>7}")
    for step, (a, b, w) in enumerate(zip(fp8["losses"], bf16["losses"], fp8["per_step"])):
        dtl_dist.print0(
            f"{step:>4}{a:>10.4f}{b:>11.4f}{w['y']:>8.1f}{w['dx']:>7.1f}{w['dW']:>7.1f}"
        )
    worst = fp8["worst"]
    gap = abs(fp8["losses"][-1] - bf16["losses"][-1]) / bf16["losses"][-1]
    ok = worst["y"] >= OUTPUT_BAR_DB and min(worst["dx"], worst["dW"]) >= GRAD_BAR_DB
    ok = ok and gap < LOSS_BAND
    dtl_dist.print0(
        f"summary: day28 fp8 on {info.device.type}, {cfg.model}, {cfg.steps} steps: worst float8 "
        f"layer output {worst['y']:.1f} dB (bar {OUTPUT_BAR_DB:g}), gradients "
        f"{min(worst['dx'], worst['dW']):.1f} dB (bar {GRAD_BAR_DB:g}); last loss "
        f"{fp8['losses'][-1]:.4f} vs bf16 {bf16['losses'][-1]:.4f} ({gap:.2%}); within the bars "
        f"{'yes' if ok else 'NO'}"
    )
    dtl_dist.cleanup()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
