"""Day 21: the costs of SP and CP as functions of t and cp, in one place (printed beside runs).

Symbols: b micro-batch, s sequence, h hidden (n_embd), a heads, t TP size, cp CP size, e bytes
per element, L layers. "Bytes" are what one rank sends (CommCounter's ring bytes per rank).

Activation memory per layer (Korthikanti et al. 2022, Table 2, 16-bit, dropout, s x s scores):
    none       s·b·h·(34 + 5as/h)          TP      s·b·h·(10 + 24/t + 5as/(ht))
    TP + SP    s·b·h·(34/t + 5as/(ht))     CP      s·b·h/cp·34: ring and Ulysses never keep
                                                   the scores (a rank's s/cp queries meet all
                                                   s keys, so kept scores would be a·(s/cp)·s·b)
`layer_terms` re-derives them tensor by tensor for the dtype, dropout and kernel in use.

Communication per layer per rank, forward + backward:
    TP         4 all-reduces of (b, s, h)                         8 (t-1)/t · sbh·e
    TP + SP    4 all-gathers + 4 reduce-scatters of (b, s, h)     8 (t-1)/t · sbh·e  (the same)
               + 2 all-gathers in backward when the column layers keep only their input shard
    ring       K and V, cp-1 steps, forward and backward          2 (cp-1) · (s/cp)·b·h/t·e each
               + dK and dV, cp steps (fp32 or wider)              2 cp · (s/cp)·b·h/t·e_acc
    Ulysses    4 all-to-alls forward (q, k, v, out), 4 backward   8 (cp-1)/cp · (s/cp)·b·h/t·e
"""

from __future__ import annotations

from day19_tp.activations import korthikanti_bytes
from day19_tp.activations import layer_terms as tp_layer_terms
from day19_tp.formulas import comm_elements_per_step, ring_bytes
from dtl.model import GPTConfig, num_params

GB = 1e9

# --- activation memory -----------------------------------------------------------------------

# day 19's terms that are whole on every TP rank, and become 1/t under SP
NOT_SPLIT_BY_TP = (
    "ln_1 input",
    "c_attn input",
    "ln_2 input",
    "c_fc input",
    "LayerNorm mean, rstd",
    "residual dropout masks",
)


def layer_terms(
    s: int,
    b: int,
    h: int,
    a: int,
    *,
    t: int = 1,
    cp: int = 1,
    sp: bool = False,
    elem_bytes: int = 4,
    dropout: bool = False,
    attention: str = "fused",
    save_gathered: bool = False,
    ln_stats_bytes: int = 4,
) -> dict[str, float]:
    """Bytes one layer saves for backward on one rank, one entry per saved tensor.

    attention: "materialized" (softmax scores kept), "fused" (SDPA: output + logsumexp), "ring"
    (ours: the same as fused) or "ulysses" (fused on whole sequences, plus the output it keeps
    before the all-to-all back). Under CP each rank holds s/cp tokens; under SP the terms TP
    leaves whole are split by t, except the column layers' inputs if they keep them gathered.
    """
    fused = attention != "materialized"
    if cp > 1 and not fused:
        raise ValueError("CP attention here is ring or Ulysses: no s x s scores are kept")
    terms = tp_layer_terms(s // cp, b, h, a, t, elem_bytes, dropout, fused, ln_stats_bytes)
    if sp:
        for name in NOT_SPLIT_BY_TP:
            if name in terms and not (save_gathered and name in ("c_attn input", "c_fc input")):
                terms[name] /= t
    if attention == "ulysses":
        terms["attention output (heads layout)"] = (s // cp) * b * h * elem_bytes / t
    return terms


LAYOUTS = {  # the layouts the notes compare, over n ranks -> layer_terms' keywords
    "none": lambda n: {},
    "tp": lambda n: dict(t=n),
    "tp_sp": lambda n: dict(t=n, sp=True),
    "ring": lambda n: dict(cp=n, attention="ring"),
    "ulysses": lambda n: dict(cp=n, attention="ulysses"),
}


def layout_bytes(layout: str, s: int, b: int, h: int, a: int, n: int) -> float:
    """One layer's saved bytes per rank for a named layout over n ranks (fp32, no dropout)."""
    return sum(layer_terms(s, b, h, a, **LAYOUTS[layout](n)).values())


def korthikanti_sp_bytes(s: int, b: int, h: int, a: int, t: int) -> float:
    """The paper's TP + SP formula (16-bit, dropout, scores materialized)."""
    return s * b * h * (34 / t + 5 * a * s / (h * t))


def long_context_rows(cfg: GPTConfig, seqs, b: int = 1, t: int = 8, cp: int = 8):
    """Activations of the whole model in GB (16-bit, dropout, the paper's formulas) at each
    sequence length: none with s x s scores, none with a fused kernel (34·sbh), TP t + SP,
    TP t + SP + CP cp. Embeddings and the output layer left out (they are small next to L layers
    at long s, except the (s, V) logits, which the notes discuss)."""
    h, a, L = cfg.n_embd, cfg.n_head, cfg.n_layer
    rows = []
    for s in seqs:
        rows.append(
            dict(
                s=s,
                scores=L * korthikanti_bytes(s, b, h, a, 1) / GB,
                fused=L * 34 * s * b * h / GB,
                tp_sp=L * 34 * s * b * h / t / GB,
                tp_sp_cp=L * 34 * (s // cp) * b * h / t / GB,
            )
        )
    return rows


# --- compute: the attention term against the rest ---------------------------------------------

# a 7 B GPT of LLaMA-2 7B's shape (32 layers, 4,096 wide, 32 heads, 32,000 words; its MLP and
# norms differ from this GPT's, so N here is 6.6 B): the long-context side of the comparison
SEVEN_B = GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=4096, vocab_size=32000)


def attention_flops_rows(cfg: GPTConfig, seqs) -> list[dict]:
    """Training FLOPs per token at each sequence length (day 27's PaLM convention): the weights'
    6N and the attention scores' 12·L·C·T (Q·K^T and P·V, forward and backward, full T x T),
    and the share attention takes."""
    n = num_params(cfg, exclude_position_embedding=True)
    rows = []
    for s in seqs:
        attn = 12 * cfg.n_layer * cfg.n_embd * s
        rows.append(dict(s=s, dense=6 * n, attn=attn, share=attn / (attn + 6 * n)))
    return rows


def attention_crossover(cfg: GPTConfig) -> float:
    """The sequence length where attention's 12·L·C·T equals the weights' 6N: T = N / (2·L·C)."""
    return num_params(cfg, exclude_position_embedding=True) / (2 * cfg.n_layer * cfg.n_embd)


# --- communication ---------------------------------------------------------------------------


def tp_layer_bytes(b: int, s: int, h: int, t: int, e: int = 4) -> float:
    """One layer under TP: 4 all-reduces of (b, s, h)."""
    return ring_bytes(4 * b * s * h, e, t)


def sp_layer_bytes(b: int, s: int, h: int, t: int, e: int = 4, save_gathered=False) -> dict:
    """One layer under TP + SP, by collective (the activations only; parameter gradients below)."""
    one = (t - 1) / t * b * s * h * e
    return {
        "all_gather": (4 + (0 if save_gathered else 2)) * one,
        "reduce_scatter": 4 * one,
    }


def sp_grad_sync_bytes(cfg: GPTConfig, t: int, e: int = 4) -> float:
    """All-reduce of the gradients SP leaves partial: LayerNorms and row-parallel biases."""
    h, L, bias = cfg.n_embd, cfg.n_layer, int(cfg.bias)
    per_layer = 2 * h * (1 + bias) + 2 * h * bias  # ln_1, ln_2; attn and mlp c_proj biases
    return ring_bytes(L * per_layer + h * (1 + bias), e, t)  # + ln_f


def sp_step_bytes(cfg: GPTConfig, b: int, s: int, t: int, e: int = 4, save_gathered=False):
    """One training step of the TP + SP GPT, by collective: measured equals this exactly."""
    h, L = cfg.n_embd, cfg.n_layer
    one = (t - 1) / t * b * s * h * e
    per_layer = sp_layer_bytes(b, s, h, t, e, save_gathered)
    head_ag = 1 + (0 if save_gathered else 1)  # forward, and again in backward
    return {
        # blocks; embedding backward; output layer; the wpe gradient (its cut's backward)
        "all_gather": L * per_layer["all_gather"] + one + head_ag * one + (t - 1) / t * s * h * e,
        # blocks; embedding forward; output layer backward
        "reduce_scatter": L * per_layer["reduce_scatter"] + one + one,
        # vocab-parallel loss (3 x b·s numbers) + the partial parameter gradients
        "all_reduce": ring_bytes(3 * b * s, e, t) + sp_grad_sync_bytes(cfg, t, e),
    }


def tp_step_bytes(cfg: GPTConfig, b: int, s: int, t: int, e: int = 4) -> float:
    """Day 19's TP step, all-reduces only."""
    return ring_bytes(sum(comm_elements_per_step(cfg, b * s).values()), e, t)


def ring_layer_bytes(b: int, s: int, h: int, cp: int, t: int = 1, e: int = 4, acc_e: int = 4):
    """Ring attention, one layer, one rank: bytes sent forward and backward."""
    block = b * (s // cp) * (h // t)  # elements of one K (or V) block
    return {
        "forward": 2 * (cp - 1) * block * e,
        "backward": 2 * (cp - 1) * block * e + 2 * cp * block * acc_e,
    }


def ulysses_layer_bytes(b: int, s: int, h: int, cp: int, t: int = 1, e: int = 4):
    """Ulysses, one layer, one rank: 4 all-to-alls each way of a (b, s/cp, h/t) tensor."""
    one = (cp - 1) / cp * b * (s // cp) * (h // t) * e
    return {"forward": 4 * one, "backward": 4 * one}
