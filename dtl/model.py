"""The small GPT every later day parallelizes: nanoGPT's shape, seed-only init, swappable attention.

Module names follow nanoGPT / GPT-2 so readers can map them onto checkpoints and papers:
`wte`, `wpe`, `blocks[i].ln_1`, `blocks[i].attn.c_attn` (fused QKV), `blocks[i].attn.c_proj`,
`blocks[i].ln_2`, `blocks[i].mlp.c_fc`, `blocks[i].mlp.c_proj`, `ln_f`, `lm_head` (tied to `wte`).

- `blocks` is a ModuleList: a pipeline stage takes a slice (`embed` -> blocks[a:b] -> `head`).
- Attention is a plain function `attn_fn(q, k, v) -> y` on (B, nh, T, hs) tensors, causal: ring
  attention (day 21) plugs in with `model.set_attention(fn)`.
- The init is a pure function of `seed` (a private generator, parameters visited by name), so a
  1-rank reference and an N-rank run start from bit-identical weights whatever the world size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 32  # the longest sequence (positions in wpe)
    vocab_size: int = 256
    bias: bool = True  # GPT-2 has biases in Linear and LayerNorm
    dropout: float = 0.0
    tie_weights: bool = True  # lm_head shares wte's weight, as in GPT-2

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PRESETS: dict[str, GPTConfig] = {
    # tests: fast enough to run dozens of multi-rank checks on 2 CPU cores
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256),
    # CPU demos: the real GPT-2 vocabulary (padded to a multiple of 64, as nanoGPT does)
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=50304),
    # GPT-2 small (Radford et al. 2019): 124,439,808 parameters with tied embeddings
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),
    # GPT-3 Small (Brown et al. 2020, Table 2.1): same trunk, context 2048 -> 125,226,240
    "gpt3-125m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=2048, vocab_size=50257),
}


def preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset '{name}'; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(hs)) v on (B, nh, T, hs) tensors, PyTorch's fused kernel."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same math written out, for reading and for checking the fused kernel."""
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, nh, T, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return att @ v  # (B, nh, T, hs)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused Q, K, V
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.attn_fn: AttentionFn = sdpa_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attn_fn(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 init from `seed` alone: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L))."""
        if any(p.is_meta for p in self.parameters()):
            return  # counting parameters on the meta device: nothing to fill
        if self.cfg.tie_weights:  # to_empty() after a meta-device build unties them: re-tie
            self.lm_head.weight = self.wte.weight
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():  # tied lm_head is visited once, as wte
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith("c_proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def set_attention(self, attn_fn: AttentionFn) -> None:
        for block in self.blocks:
            block.attn.attn_fn = attn_fn

    # --- the three pieces a pipeline stage composes -----------------------------------------
    def embed(self, idx: torch.Tensor, pos_offset: int = 0) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) hidden states."""
        T = idx.size(1)
        if pos_offset + T > self.cfg.block_size:
            raise ValueError(
                f"sequence of {pos_offset + T} exceeds block_size {self.cfg.block_size}"
            )
        pos = torch.arange(pos_offset, pos_offset + T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, vocab) logits."""
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- sizes and FLOPs, computed from the config alone (no weights allocated) -----------------


def num_params(cfg: GPTConfig, exclude_position_embedding: bool = False) -> int:
    """Parameter count of GPT(cfg), by formula. Tested against the built module (meta device)."""
    C, L, V, T, b = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size, int(cfg.bias)
    ln = C * (1 + b)
    per_block = 2 * ln + (C * 3 * C + 3 * C * b) + (C * C + C * b)  # ln_1, ln_2, c_attn, c_proj
    per_block += (C * 4 * C + 4 * C * b) + (4 * C * C + C * b)  # mlp.c_fc, mlp.c_proj
    total = V * C + L * per_block + ln + (0 if cfg.tie_weights else V * C)
    return total + (0 if exclude_position_embedding else T * C)


def flops_per_token(
    cfg: GPTConfig, seq_len: int | None = None, causal_halved: bool = False
) -> float:
    """Training FLOPs per token: 6N + 12·L·H·Q·T (PaLM App. B; nanoGPT's estimate_mfu).

    N counts every weight that takes part in a matmul: all parameters but the position
    embedding (with tied weights, wte is counted once, standing for the lm_head matmul).
    The attention term counts the full T x T score matrix (nanoGPT, torchtitan); with
    `causal_halved=True` it is halved for the causal mask (llm.c, current Megatron).
    """
    T = seq_len or cfg.block_size
    N = num_params(cfg, exclude_position_embedding=True)
    attn = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T
    return 6 * N + (attn / 2 if causal_halved else attn)
