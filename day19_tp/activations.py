"""Day 19: activation memory per transformer layer, measured and predicted term by term.

Korthikanti et al. 2022 (arXiv 2205.05198, section 4) count the bytes one layer keeps for
backward, for 16-bit activations, dropout, and attention that materializes the s x s scores:

    no TP       s·b·h·(34 + 5·a·s/h)
    TP over t   s·b·h·(10 + 24/t + 5·a·s/(h·t))

`layer_terms` re-derives the same sum one saved tensor at a time, for the dtype, dropout and
attention kernel actually in use, so each term can be checked against what autograd saves:

    tensor saved for backward              elements     split by t?   in the paper (16-bit bytes)
    ln_1 input                             s·b·h        no            2sbh  (LayerNorm)
    c_attn input (ln_1 output)             s·b·h        no            2sbh
    Q, K, V (the c_attn output)            3·s·b·h      yes           4sbh (Q, K) + 2sbh (V)
    attention: scores softmax              a·s·s·b      yes           2as²b + as²b mask
      (+ the s x s causal mask, 1 B each)                               + 2as²b dropout output
      or fused kernel: logsumexp           a·s·b (fp32) yes           (not in the paper; its output
                                                                      is the c_proj input below)
    c_proj input                           s·b·h        yes           2sbh
    dropout masks after attn and MLP       2·s·b·h (1 B) no           2sbh (two 1-byte masks)
    ln_2 input, c_fc input                 2·s·b·h      no            4sbh
    GELU input, mlp c_proj input           8·s·b·h      yes           16sbh
    LayerNorm mean and rstd                4·s·b (fp32) no            (not in the paper: tiny)

With dropout 0 the masks are not saved; the fused kernel (F.scaled_dot_product_attention: the
flash kernel on this CPU; on CUDA in fp32 the memory-efficient one, not measured) saves its
output and a logsumexp instead of the a·s² scores, which removes the 5as/h term, the reason long
sequences are affordable.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dtl.state import storage_key


def saved_activation_bytes(module: nn.Module, *inputs) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct tensors autograd saves during `module(*inputs)`, parameters left
    out (they exist anyway), each storage counted once (Q, K and V are views of one tensor)."""
    params = {storage_key(p) for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if storage_key(t) not in params:
            seen[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    return sum(seen.values()), out


def layer_terms(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int,
    elem_bytes: int,
    dropout: bool,
    fused_attention: bool,
    ln_stats_bytes: int = 4,
) -> dict[str, float]:
    """Bytes per layer per TP rank, one entry per saved tensor (the table above).

    ln_stats_bytes: LayerNorm keeps its mean and rstd in fp32 for fp32 inputs, and for 16-bit
    ones on CUDA (its accumulation type); the CPU kernel keeps them in the input's 16-bit type
    (measured here with torch 2.13: pass 2 for a CPU bf16 run)."""
    e, sbh = elem_bytes, s * b * h
    terms = {
        "ln_1 input": sbh * e,
        "c_attn input": sbh * e,
        "Q, K, V": 3 * sbh * e / t,
        "c_proj input": sbh * e / t,
        "ln_2 input": sbh * e,
        "c_fc input": sbh * e,
        "GELU input": 4 * sbh * e / t,
        "mlp c_proj input": 4 * sbh * e / t,
        "LayerNorm mean, rstd": 2 * 2 * s * b * ln_stats_bytes,
    }
    if fused_attention:
        # the kernel's output is laid out (B, T, nh, hs), so transposing it back for c_proj is
        # free: it *is* the c_proj input already counted; only the logsumexp is new
        terms["logsumexp (fused kernel)"] = a * s * b * 4 / t
    else:
        terms["softmax(QK^T)"] = a * s * s * b * e / t
        terms["causal mask (s x s bool)"] = s * s
        if dropout:
            terms["attention dropout mask + output"] = a * s * s * b * (1 + e) / t
    if dropout:
        terms["residual dropout masks"] = 2 * sbh * 1
    return terms


# the terms the attention core saves: what selective recomputation drops (layer_terms' keys)
ATTENTION_CORE = (
    "softmax(QK^T)",
    "causal mask (s x s bool)",
    "attention dropout mask + output",
    "logsumexp (fused kernel)",
)


def recompute_terms(terms: dict[str, float], mode: str, layer_input: float) -> dict[str, float]:
    """layer_terms under activation recomputation (dtl.model's set_recompute):
    none       every term;
    selective  all but the attention core's (recomputed in backward from Q, K, V, kept anyway);
    full       the layer's input only, `layer_input` bytes (the block reruns in backward)."""
    if mode == "none":
        return dict(terms)
    if mode == "selective":
        return {k: v for k, v in terms.items() if k not in ATTENTION_CORE}
    if mode == "full":
        return {"layer input": layer_input}
    raise ValueError(f"unknown recompute '{mode}'; one of none, selective, full")


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int) -> float:
    """The paper's per-layer formula (16-bit, dropout, scores materialized)."""
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def korthikanti_recompute_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, mode: str):
    """The paper's Table 2, per layer per rank (16-bit, dropout): no recomputation, selective
    (the 5as/h attention-core term gone), full (the layer's input only: 2sbh, as the table
    writes it; under SP a rank's input is its s/t tokens, so 2sbh/t, which the run measures)."""
    scores = 5 * a * s / (h * t)
    rest = 34 / t if sp else 10 + 24 / t
    per = {"none": rest + scores, "selective": rest, "full": 2 / t if sp else 2}[mode]
    return s * b * h * per
