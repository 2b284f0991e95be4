"""Day 28: the training recipe of a ~125M GPT, as small functions the strategies share.

    lr = lr_at(step, Recipe())                  # linear warm-up, cosine decay to min_lr
    opt = make_adamw(params_or_groups, r)       # decay on matrices, fused where it exists
    with autocast(r, device): loss = ...        # r.precision, decided once by the run
    text = generate(model, tokenizer, "ROMEO:", 40)

The numbers are GPT-3 Small's and llm.c's GPT-2 124M run (Brown et al. 2020, Table 2.1;
karpathy/llm.c scripts/run_gpt2_124M.sh): AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
the matrices only, gradient clipping at 1.0, peak lr 6e-4, warm-up then cosine to 10% of it,
524,288 tokens per step (0.5M: micro-batch x sequence x accumulation x DP ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dtl.optim import OptimConfig, warmup_cosine
from dtl.precision import ANY_DEVICE, GPU_ONLY, PRECISIONS, declare


@dataclass
class Recipe:
    lr: float = 6e-4  # peak learning rate
    min_lr: float = 6e-5  # the cosine ends here (10% of the peak)
    warmup: int = 2  # linear warm-up steps
    steps: int = 8  # total optimizer steps (the cosine's length)
    weight_decay: float = 0.1  # on matrices and embeddings only
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip: float = 1.0  # global gradient-norm clip (0: off)
    precision: str = "fp32"  # the dtl.precision row the run trains in, decided once by its config

    @property
    def optim(self) -> OptimConfig:
        """AdamW's settings at the peak lr, decay on the matrices only (dtl.optim)."""
        return OptimConfig(
            lr=self.lr,
            eps=self.eps,
            weight_decay=self.weight_decay,
            betas=self.betas,
            decay="matrices",
        )


def lr_at(step: int, r: Recipe) -> float:
    """Linear warm-up over `warmup` steps, then a cosine from lr to min_lr at `steps`."""
    return r.lr * warmup_cosine(step, warmup=r.warmup, steps=r.steps, min_ratio=r.min_lr / r.lr)


def make_adamw(
    params, r: Recipe, fused: bool | None = None, foreach: bool | None = None
) -> torch.optim.AdamW:
    """The recipe's AdamW (r.optim: decay on the matrices only) over a module or a list of
    parameters, `fused` (one kernel for every tensor) by default where the device has it: a GPU.
    Unfused, `foreach` picks torch's multi-tensor path (True) or its per-tensor loop (False)."""
    if fused is None:
        first = next(iter(params.parameters() if hasattr(params, "parameters") else params))
        fused = first.device.type == "cuda"
    return r.optim.make(params, fused=fused, foreach=foreach)


# The recipe's autocast: bf16 on GPUs (the CPU checks run fp32), and fp8 (bf16 autocast around
# float8 linears, dtl.conversion, applied to the GPT before it is wrapped); fp16 would need a
# GradScaler. DDP, FSDP2 and the ablation train through it.
AUTOCAST = declare(
    "day 28's autocast (ddp, fsdp2, the ablation)",
    {"fp32": ANY_DEVICE, "bf16": GPU_ONLY, "fp8": GPU_ONLY},
    why="fp16 needs a GradScaler, which is not wired",
)


def autocast(r: Recipe, device: torch.device):
    """Autocast to the recipe's precision (dtl.precision), which the run decided once for its
    strategy and device; a no-op in fp32."""
    return PRECISIONS[r.precision].autocast(device.type)


@torch.no_grad()
def generate(model, tokenizer, prompt: str, new_tokens: int, top_k: int = 40, seed: int = 0):
    """Sample `new_tokens` after `prompt` (top-k, temperature 1) from a one-process GPT; only
    the tokenizer's words are drawn (a vocabulary padded for TP has rows it cannot decode)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([tokenizer.encode(prompt)], device=device)
    for _ in range(new_tokens):
        logits = model(ids[:, -model.cfg.block_size :])[:, -1, : tokenizer.vocab_size].float()
        top, idx = logits.topk(min(top_k, logits.size(-1)))
        nxt = idx.gather(1, torch.multinomial(F.softmax(top, dim=-1), 1, generator=g))
        ids = torch.cat([ids, nxt], dim=1)
    return tokenizer.decode(ids[0].tolist())
