"""The small GPT every later day parallelizes: nanoGPT's shape, per-parameter init, an MoE option.

Module names follow nanoGPT / GPT-2 so readers can map them onto checkpoints and papers:
`wte`, `wpe`, `blocks.<i>.ln_1`, `blocks.<i>.attn.c_attn` (fused QKV), `.attn.c_proj`,
`blocks.<i>.ln_2`, `.mlp.c_fc`, `.mlp.c_proj`, `ln_f`, `lm_head` (tied to `wte`).

What makes it ready to be split:
- `blocks` is a ModuleDict keyed "0".."L-1" (torchtitan's choice): a pipeline stage deletes the
  blocks it does not own and sets `wte`/`wpe` or `ln_f`/`lm_head` to None, and every remaining
  parameter keeps its one-process name (`blocks.5.mlp.c_fc.weight`), which is what per-parameter
  init and distributed checkpoints key on. `forward` skips the pieces a stage does not hold.
- Attention reads its local head count from the width of `c_attn`, so a `c_attn` holding one
  tensor-parallel rank's heads (Q, K and V each split by heads: `dtl.tp_plan.TP_PLAN`) runs
  unchanged.
- Attention is a plain function `attn_fn(q, k, v) -> y` on (B, nh, T, hs) tensors, causal: ring
  attention (day 21) plugs in with `model.set_attention(fn)`.
- Every parameter's initial value is a pure function of `(seed, its name)` (`init_tensor`), so a
  stage, a TP shard or a ZeRO-3 shard built on the meta device can materialize only its own
  parameters and equal the one-process model bit for bit, whatever the world size.
- The loss is outside `forward` (`loss_fn`), and `forward`/`embed` take position ids, so a
  context-parallel rank can hold non-contiguous (zig-zag) chunks of the sequence and a
  vocabulary-parallel loss can replace the plain one.
- Activation recomputation is one call, `model.set_recompute(mode)`, before or after a strategy
  wraps the blocks: "selective" recomputes the attention core (softmax(QK^T)V) in backward
  instead of keeping what it saved, "full" keeps only each block's input and reruns the whole
  block (Korthikanti et al. 2022, section 5). It changes no parameter, so it is not in
  GPTConfig. Both go through torch.utils.checkpoint, non-reentrant: collectives inside a block
  (TP's, SP's) run again in backward, in the same order on every rank. Gradients are those of
  the run without recomputation, bit for bit (tests/test_dtl_recompute.py).

Presets. `tiny` is for the many multi-rank tests. Its attention key bias has a gradient that is
zero in exact arithmetic (q·b_k is the same for every key, and softmax ignores a constant), so in
floating point it is pure rounding noise; SGD moves it by ~lr·1e-9, but Adam divides by sqrt(v)
and turns that noise into lr-sized steps that differ between a parallel run and its reference.
`tiny-nobias` (no biases, as in many modern GPTs) has no such parameter: use it for Adam checks.
One caveat stays, element by element: Adam's step lr·g/(|g| + eps) is most sensitive to a
gradient's rounding difference delta where |g| ~ eps, by up to lr·delta/(4·eps). With fp32
gradients summed in another order (delta ~ 2e-9 on tiny-nobias) that is 5e-4 at torch's default
eps = 1e-8 and 5e-6 at eps = 1e-6: Adam checks use eps = 1e-6 and say their tolerance.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal, cast, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dtl.moe import MoE, MoEConfig
from dtl.precision import at_least_fp32

GPT2_VOCAB_SIZE = 50257  # the real GPT-2 BPE vocabulary: the size the notes count


def pad_vocab_size(vocab_size: int, multiple: int = 1, tp_size: int = 1) -> int:
    """Round the vocabulary up to a multiple of `multiple * tp_size`.

    Megatron's --make-vocab-size-divisible-by (default 128, times the TP size, so every TP rank
    holds an equal, aligned slice of the embedding); nanoGPT pads 50,257 to 50,304 (= 64 · 786)
    for faster matmuls. The extra rows are never a target, so they only cost memory.
    """
    if min(vocab_size, multiple, tp_size) < 1:
        raise ValueError(
            f"vocab_size, multiple and tp_size must be >= 1, got {vocab_size}, "
            f"{multiple}, {tp_size}"
        )
    step = multiple * tp_size
    return -(-vocab_size // step) * step


# what a block keeps for backward: everything it saves, all but the attention core's, its input
Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 32  # the longest sequence (positions in wpe)
    vocab_size: int = 256  # rows of wte: the tokenizer's vocabulary, possibly padded
    bias: bool = True  # GPT-2 has biases in Linear and LayerNorm
    dropout: float = 0.0
    tie_weights: bool = True  # lm_head shares wte's weight, as in GPT-2
    moe: MoEConfig | None = None  # every block's MLP a mixture of experts (dtl.moe); None: dense

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PRESETS: dict[str, GPTConfig] = {
    # tests: fast enough to run dozens of multi-rank checks on 2 CPU cores
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256),
    # tests with Adam: no bias anywhere, so no gradient is rounding noise (module docstring)
    "tiny-nobias": GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256, bias=False
    ),
    # expert parallelism: 4 experts of 4C, top-2 (tiny-nobias's trunk, for Adam checks)
    "tiny-moe": GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256, bias=False, moe=MoEConfig()
    ),
    # CPU demos: the real GPT-2 vocabulary, padded to a multiple of 64 as nanoGPT does (50,304)
    "small": GPTConfig(
        n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=pad_vocab_size(50257, 64)
    ),
    # GPT-2 small (Radford et al. 2019): 124,439,808 parameters with tied embeddings
    "gpt2-124m": GPTConfig(
        n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=GPT2_VOCAB_SIZE
    ),
    # GPT-3 Small (Brown et al. 2020, Table 2.1): same trunk, context 2048 -> 125,226,240
    "gpt3-125m": GPTConfig(
        n_layer=12, n_head=12, n_embd=768, block_size=2048, vocab_size=GPT2_VOCAB_SIZE
    ),
}


# a config field that names a preset: dtl.config checks it is one ("unknown model 'x'; one of ...")
PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # built at run time


def preset(name: str, **overrides: Any) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset '{name}'; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# --- the model --------------------------------------------------------------------------------

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (the fused c_attn output (B, T, 3*nh*hs), nh, hs) -> q, k, v, each (B, T, nh*hs)
QkvSplit = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, ...]]


def qkv_in_blocks(qkv: torch.Tensor, nh: int, hs: int) -> tuple[torch.Tensor, ...]:
    """c_attn's rows as [Q; K; V], each nh heads side by side: the one-process layout (a TP
    rank of dtl.tp_plan holds [Q_t; K_t; V_t], the same layout for its heads)."""
    q, k, v = qkv.split(nh * hs, dim=2)
    return q, k, v


def qkv_per_head(qkv: torch.Tensor, nh: int, hs: int) -> tuple[torch.Tensor, ...]:
    """c_attn's rows as [q_0; k_0; v_0; q_1; k_1; v_1; ...] (Megatron's layout,
    dtl.tp_plan.per_head_rows): any contiguous cut at whole heads holds their q, k and v, so a
    plain row split (DTensor's Shard(0)) splits by heads at every TP size."""
    B, T, _ = qkv.shape
    per_head = qkv.view(B, T, nh, 3, hs)  # (B, T, nh, [q k v], hs)
    return tuple(t.reshape(B, T, nh * hs) for t in per_head.unbind(3))


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


def _recomputing(on: bool) -> bool:
    """Recompute only where a backward will follow (not under no_grad, e.g. evaluation)."""
    return on and torch.is_grad_enabled()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused Q, K, V
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.attn_fn: AttentionFn = sdpa_attention
        self.split_qkv: QkvSplit = qkv_in_blocks  # how c_attn's rows are laid out
        self.recompute_core = False  # GPT.set_recompute("selective")

    @property
    def n_local_heads(self) -> int:
        """Heads this module holds: all of them, or one TP rank's share (c_attn split by heads)."""
        return self.c_attn.out_features // (3 * self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hs = self.head_dim
        qkv = self.c_attn(x)  # (B, T, 3*nh*hs); T from here: under SP x holds T/t tokens
        B, T, width = qkv.shape
        nh = width // (3 * hs)  # the heads this rank holds: n_local_heads (a DTensor's too)
        q, k, v = self.split_qkv(qkv, nh, hs)  # 3 x (B, T, nh*hs)
        # (B, T, nh*hs) -> (B, nh, T, hs): heads become a batch dimension
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))
        if _recomputing(self.recompute_core):  # keep q, k, v (views of the c_attn output, kept
            # anyway); what the core saves (scores, or the fused kernel's logsumexp) is not kept
            y = checkpoint(self.attn_fn, q, k, v, use_reentrant=False)
        else:
            y = self.attn_fn(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y))  # under TP: a partial sum, (B, T, C)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.dropout(self.c_proj(self.gelu(self.c_fc(x)))))


def _mlp(cfg: GPTConfig) -> nn.Module:
    """The block's MLP: dense, or E expert MLPs behind a router (named `mlp` either way)."""
    moe = cfg.moe
    if moe is None:
        return MLP(cfg)
    return MoE(cfg.n_embd, moe, lambda: MLP(cfg, moe.hidden(cfg.n_embd)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = _mlp(cfg)
        self.recompute_all = False  # GPT.set_recompute("full")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _recomputing(self.recompute_all):  # keep x only; backward reruns the block first
            return cast(torch.Tensor, checkpoint(self._layer, x, use_reentrant=False))
        return self._layer(x)

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return cast(torch.Tensor, x + self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int | None = None) -> None:
        """Fill every parameter from (seed, its name); a no-op on the meta device."""
        self.seed = self.seed if seed is None else seed
        if any(p.is_meta for p in self.parameters()):
            return  # shapes only (counting, or before to_empty + materialize)
        self.tie_weights()  # to_empty() after a meta build unties them
        init_parameters(self, self.seed, self.cfg.n_layer, tied=self.cfg.tie_weights)

    def tie_weights(self) -> None:
        """lm_head shares wte's weight (GPT-2), where the config ties them and both are here."""
        if self.cfg.tie_weights and self.wte is not None and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight

    def set_attention(self, attn_fn: AttentionFn) -> None:
        for block in cast("Iterable[Block]", self.blocks.values()):
            block.attn.attn_fn = attn_fn

    def set_recompute(self, mode: Recompute) -> None:
        """What each block keeps for backward: "none" everything it saves, "selective" all but
        the attention core's (recomputed in backward), "full" its input (the block reruns)."""
        set_recompute(cast("Iterable[Block]", self.blocks.values()), mode)

    # --- the three pieces a pipeline stage composes -----------------------------------------
    def embed(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) token ids, optional (T,) or (B, T) position ids -> (B, T, C) hidden states."""
        T = idx.size(1)
        if pos is None:
            if T > self.cfg.block_size:
                raise ValueError(f"sequence of {T} exceeds block_size {self.cfg.block_size}")
            pos = torch.arange(T, device=idx.device)
        elif pos.size(-1) != T:
            raise ValueError(f"position ids cover {pos.size(-1)} tokens but the input has {T}")
        return cast(torch.Tensor, self.drop(self.wte(idx) + self.wpe(pos)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, vocab) logits."""
        return cast(torch.Tensor, self.lm_head(self.ln_f(x)))

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids -> logits; a pipeline stage without wte takes and/or returns hidden states."""
        if self.wte is not None:
            x = self.embed(x, pos)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.lm_head is not None else x


def set_recompute(blocks: Iterable[Block], mode: Recompute) -> None:
    """GPT.set_recompute for any blocks (a pipeline stage's, a strategy's own module list)."""
    if mode not in get_args(Recompute):
        raise ValueError(f"unknown recompute '{mode}'; one of {', '.join(get_args(Recompute))}")
    for block in blocks:
        block.recompute_all = mode == "full"
        block.attn.recompute_core = mode == "selective"


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose target is not `ignore_index`."""
    return F.cross_entropy(
        logits.flatten(0, -2).to(at_least_fp32(logits.dtype)),
        targets.flatten(),
        ignore_index=ignore_index,
    )


# --- initialization: a pure function of (seed, parameter name) --------------------------------

# what DDP, torch.compile, activation checkpointing and FSDP1 insert into parameter names
_WRAPPERS = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def canonical_name(name: str) -> str:
    """A parameter's one-process name, without the prefixes wrappers add (DDP, compile, ...)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_tensor(name: str, shape: tuple[int, ...], seed: int, n_layer: int) -> torch.Tensor:
    """The initial value of parameter `name` (GPT-2's init), from (seed, name) alone.

    Biases 0, LayerNorm weights 1, residual projections (`c_proj.weight`) N(0, 0.02/sqrt(2L)),
    every other weight N(0, 0.02). Full shape, fp32, on the CPU: a shard slices it.
    """
    if name.endswith("bias"):
        return torch.zeros(shape)  # host: init on the CPU, the same on every machine
    if name.startswith("ln_") or ".ln_" in name:
        return torch.ones(shape)  # host
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
    gen = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.randn(shape, generator=gen) * std  # host: a CPU generator


@torch.no_grad()
def init_parameters(
    module: nn.Module, seed: int, n_layer: int, prefix: str = "", tied: bool = False
) -> None:
    """Fill every parameter of `module` (named `prefix + name` in the one-process GPT).

    `tied`: lm_head.weight is wte.weight in one process; a pipeline's last stage that holds its
    own copy must start from wte's values, so its name is read as "wte.weight".
    """
    for name, p in module.named_parameters():  # a tied lm_head is visited once, as wte
        full = canonical_name(prefix + name)
        if tied and full == "lm_head.weight":
            full = "wte.weight"
        p.copy_(init_tensor(full, p.shape, seed, n_layer))


def materialize(
    module: nn.Module, seed: int, n_layer: int, prefix: str = "", device: torch.device | str = "cpu"
) -> nn.Module:
    """Allocate a meta-device module on `device` and fill it as the one-process GPT would be.

    Only the parameters `module` holds are created: a pipeline stage, or one block, costs only
    its own memory. A GPT with tied weights is re-tied first (to_empty unties them).
    """
    module.to_empty(device=device)
    tied = isinstance(module, GPT) and module.cfg.tie_weights
    if tied and isinstance(module, GPT):  # isinstance again, for mypy
        module.tie_weights()
    init_parameters(module, seed, n_layer, prefix, tied=tied)
    return module


# --- sizes and FLOPs, computed from the config alone (no weights allocated) -----------------


def num_params(
    cfg: GPTConfig, exclude_position_embedding: bool = False, active: bool = False
) -> int:
    """Parameter count of GPT(cfg), by formula. Tested against the built module (meta device).
    `active`: an MoE's parameters one token uses (the router and k of the E experts)."""
    C, L, V, T, b = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size, int(cfg.bias)
    ln = C * (1 + b)
    per_block = 2 * ln + (C * 3 * C + 3 * C * b) + (C * C + C * b)  # ln_1, ln_2, c_attn, c_proj
    if cfg.moe is None:
        per_block += (C * 4 * C + 4 * C * b) + (4 * C * C + C * b)  # mlp.c_fc, mlp.c_proj
    else:  # the router and E experts (k of them, active)
        per_block += cfg.moe.layer_params(C, cfg.bias, cfg.moe.top_k if active else None)
    total = V * C + L * per_block + ln + (0 if cfg.tie_weights else V * C)
    return total + (0 if exclude_position_embedding else T * C)


def flops_per_token(
    cfg: GPTConfig, seq_len: int | None = None, causal_halved: bool = False
) -> float:
    """Training FLOPs per token: 6N + 12·L·H·Q·T (PaLM App. B; nanoGPT's estimate_mfu).

    N counts the parameters but the position embedding (a lookup, no matmul); with tied
    weights wte is counted once, standing for the lm_head matmul; untied, wte is a lookup too
    and is left out (lm_head counts). Biases and LayerNorm weights are in N (as in nanoGPT).
    The attention term counts the full T x T score matrix (nanoGPT, torchtitan); with
    `causal_halved=True` it is halved for the causal mask (llm.c, current Megatron). An MoE
    counts its active parameters: a token runs the router and k experts, not E.
    """
    T = seq_len or cfg.block_size
    N = num_params(cfg, exclude_position_embedding=True, active=True)
    if not cfg.tie_weights:
        N -= cfg.vocab_size * cfg.n_embd  # the untied wte: a lookup
    attn = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T
    return 6 * N + (attn / 2 if causal_halved else attn)
