"""Day 19: tensor parallelism's costs as functions of t, in one place (printed beside measurements).

Per rank, for the shared GPT (C = n_embd, L = layers, V = padded vocabulary, B·T tokens):
- parameters: the matrices of c_attn, c_proj, c_fc, mlp.c_proj and the vocabulary are split by t;
  LayerNorms, wpe and the biases of the row-parallel layers are replicated;
- communication per step: 4 all-reduces of B·T·C per layer (attention and MLP, forward g and
  backward f), plus one forward for the embedding, one backward for the output layer (f), and
  3 all-reduces of B·T numbers for the vocab-parallel loss;
- activations: day19_tp/activations.py.
"""

from __future__ import annotations

from dtl.model import GPTConfig, pad_vocab_size

# link bandwidths (GB/s per direction per GPU) for the "why TP stays in a node" estimate
NVLINK_H100_GBS = (
    450.0  # NVLink 4, 18 links x 25 GB/s (NVIDIA H100 datasheet: 900 GB/s bidirectional)
)
IB_NDR_GBS = 50.0  # one 400 Gb/s NDR InfiniBand port per GPU
# an assumed achieved bf16 matmul rate (about 40% of the H100's 989 TFLOP/s dense peak)
ASSUMED_MATMUL_FLOPS = 400e12


def block_params(cfg: GPTConfig, t: int, ep: int = 1) -> int:
    """Parameters of one transformer block on one TP rank (and, for an MoE, one of ep expert-
    parallel ranks: the router and E/ep experts, whole on every TP rank: not in the TP plan)."""
    C, b = cfg.n_embd, int(cfg.bias)
    split = (3 * C * C + 3 * C * b) + C * C  # c_attn, attn.c_proj
    replicated = 2 * C * (1 + b) + C * b  # ln_1, ln_2, attn.c_proj's bias
    if cfg.moe is None:
        split += (4 * C * C + 4 * C * b) + 4 * C * C  # mlp.c_fc, mlp.c_proj
        replicated += C * b  # mlp.c_proj's bias
    else:
        replicated += cfg.moe.layer_params(C, cfg.bias, cfg.moe.n_expert // ep)
    return split // t + replicated


def params_per_rank(cfg: GPTConfig, t: int) -> int:
    """Parameters one TP rank holds (the vocabulary padded to a multiple of t)."""
    C, L, b = cfg.n_embd, cfg.n_layer, int(cfg.bias)
    V = pad_vocab_size(cfg.vocab_size, 1, t)
    vocab = V * C // t * (1 if cfg.tie_weights else 2)
    return L * block_params(cfg, t) + vocab + cfg.block_size * C + C * (1 + b)


def comm_elements_per_step(cfg: GPTConfig, tokens: int) -> dict[str, int]:
    """Elements all-reduced over the TP group per training step (forward + backward)."""
    C, L = cfg.n_embd, cfg.n_layer
    return {
        "blocks (2 forward g + 2 backward f per layer)": 4 * L * tokens * C,
        "embedding (forward g)": tokens * C,
        "output layer (backward f)": tokens * C,
        "loss (max, sum exp, target logit)": 3 * tokens,
    }


def ring_bytes(elements: int, elem_bytes: int, t: int) -> float:
    """What a ring all-reduce sends per rank: 2(t-1)/t of the message."""
    return elements * elem_bytes * 2 * (t - 1) / t if t > 1 else 0.0


def layer_comm_seconds(cfg: GPTConfig, tokens: int, t: int, elem_bytes: int, gbs: float) -> float:
    """Time one layer's 4 all-reduces take at `gbs` GB/s, bandwidth term only."""
    return ring_bytes(4 * tokens * cfg.n_embd, elem_bytes, t) / (gbs * 1e9)


def layer_compute_seconds(cfg: GPTConfig, tokens: int, t: int, flops_per_s: float) -> float:
    """One layer's forward + backward matmul time per rank: 6 x 12·C² FLOPs per token / t."""
    return 6 * 12 * cfg.n_embd**2 * tokens / t / flops_per_s
