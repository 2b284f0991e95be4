"""Day 27: FLOPs per token in each convention, MFU and HFU, checked against published figures and
against torch's own FlopCounterMode.

A training step multiplies every weight twice in forward (2 FLOPs per multiply-add) and four
times in backward (the gradients of the input and of the weight): 6 FLOPs per weight per token.
Attention adds matmuls that have no weights: Q·K^T and P·V, 2·T·Q FLOPs each per head per token
forward, so 12·L·H·Q·T forward + backward. Conventions differ on what they count:

    kaplan     6·N_nonembedding: 12·L·C² weights only (Kaplan et al. 2020), no attention term
    palm       6·N + 12·L·H·Q·T: PaLM App. B, nanoGPT's estimate_mfu, torchtitan. N excludes the
               position embedding (a lookup, no matmul); with tied weights wte counts once, as
               the lm_head matmul. Full T x T attention.
    causal     6·N + 6·L·H·Q·T: llm.c, current Megatron: a causal mask needs half the scores.
               llm.c counts N as every parameter (the position embedding too).
    megatron   Narayanan et al. 2021, eq. 3: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) per iteration
               without recomputation (96·… and V/(16·l·h) with full recomputation: that one is
               *hardware* FLOPs, HFU, since the forward runs twice)

MFU = model FLOPs per token x tokens/s / peak FLOP/s (Chowdhery et al. 2022, App. B): what the
model needs, whatever the implementation recomputes. HFU counts what the hardware executed,
recomputation included (Korthikanti et al. 2022), so HFU >= MFU: model FLOPs plus
recompute_flops_per_token, which bench.py's part mfu checks against FlopCounterMode per mode.
"""

from __future__ import annotations

import torch

from dtl.exercise_seam import exercise
from dtl.model import GPTConfig, num_params
from dtl.precision import PRECISIONS

CONVENTIONS = ("kaplan", "palm", "causal", "megatron", "megatron_recompute")


@exercise("day27.flops_per_token")
def flops_per_token(
    cfg: GPTConfig, seq_len: int, convention: str = "palm", n_params: int | None = None
) -> float:
    """Training FLOPs per token for GPT(cfg) at `seq_len` in `convention`.

    `n_params` overrides N (llm.c counts every parameter, the position embedding included)."""
    L, H, Q, C, V, T = cfg.n_layer, cfg.n_head, cfg.head_dim, cfg.n_embd, cfg.vocab_size, seq_len
    if convention == "kaplan":
        return 6 * 12 * L * C * C
    if convention in ("palm", "causal"):
        # 6N + the attention term. N: the weights a matmul multiplies, as dtl.model counts them
        # (num_params(cfg, exclude_position_embedding=True) is every parameter but wpe; an
        # untied wte is a lookup too, while a tied one stands for lm_head's matmul). Attention:
        # per layer, head and token, Q·K^T and P·V are 2·T·Q FLOPs each forward, twice that
        # backward; "causal" counts half the scores. -> a float, FLOPs per token
        # exercise day27.flops_per_token: begin
        if n_params is None:
            n_params = num_params(cfg, exclude_position_embedding=True)
            if not cfg.tie_weights:
                n_params -= V * C  # the untied wte: a lookup, no matmul
        attention = 12 * L * H * Q * T  # 3 passes x 2 matmuls x 2·T·Q, per layer and head
        return 6 * n_params + (attention / 2 if convention == "causal" else attention)
        # exercise day27.flops_per_token: end
    if convention == "megatron":
        return 72 * L * C * C * (1 + T / (6 * C) + V / (12 * L * C))
    if convention == "megatron_recompute":
        return 96 * L * C * C * (1 + T / (6 * C) + V / (16 * L * C))
    raise ValueError(f"unknown convention '{convention}'; one of {', '.join(CONVENTIONS)}")


def recompute_flops_per_token(cfg: GPTConfig, seq_len: int, mode: str) -> float:
    """FLOPs per token that activation recomputation (dtl.model's set_recompute) adds: the
    forwards it runs again in backward, counted as FlopCounterMode counts (matmuls only).

    selective  the attention core's forward, Q·K^T and P·V: 4·L·H·Q·T
    full       each block's forward but its last matmul: c_attn, c_proj and c_fc, 2 x 8·C² per
               layer, and the core. torch's non-reentrant checkpoint stops recomputing once it
               has every tensor backward needs (early stop, its default); mlp.c_proj's output is
               not one of them (its backward needs its input and the incoming gradient), so its
               4·C² weights are never rerun: FlopCounterMode shows it (day 27's bench).
    The head (ln_f, lm_head) is never recomputed. Megatron's full recomputation reruns the whole
    layer (96/72 in the `megatron_recompute` convention: 2 x 12·C² more per layer)."""
    L, H, Q, C, T = cfg.n_layer, cfg.n_head, cfg.head_dim, cfg.n_embd, seq_len
    core = 4 * L * H * Q * T
    return {"none": 0.0, "selective": core, "full": 2 * 8 * L * C * C + core}[mode]


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization: the FLOP/s the model needs over the FLOP/s available."""
    return flops_per_token * tokens_per_s / peak_flops


def table(cfg: GPTConfig, seq_len: int) -> list[tuple[str, float]]:
    base = flops_per_token(cfg, seq_len, "palm")
    return [
        (c, flops_per_token(cfg, seq_len, c), flops_per_token(cfg, seq_len, c) / base)
        for c in CONVENTIONS
    ]


# --- FlopCounterMode, with the CPU attention kernel it does not know -----------------------------


def _register_cpu_sdpa_formula() -> None:
    """torch counts FLOPs per aten op from a registry of formulas; the CPU flash-attention op
    (`_scaled_dot_product_flash_attention_for_cpu`) has none, so a GPT on a CPU counts 0 FLOPs
    for attention. Register the same formula the CUDA kernels use (full T x T, no causal
    discount: FlopCounterMode counts what the kernel is asked to compute)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    fwd = aten._scaled_dot_product_flash_attention_for_cpu
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
    if fwd in fc.flop_registry or fwd.default in fc.flop_registry:
        return  # registered already (this process, or a torch that knows the op)

    @fc.register_flop_formula(fwd)
    def _fwd(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
        return fc.sdpa_flop_count(query_shape, key_shape, value_shape)

    @fc.register_flop_formula(bwd)
    def _bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def counted_flops_per_token(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward + backward FLOPs of one step as torch's FlopCounterMode counts them, per token."""
    from torch.utils.flop_counter import FlopCounterMode

    from dtl.model import loss_fn

    _register_cpu_sdpa_formula()
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x), y).backward()
    return counter.get_total_flops() / x.numel()


# --- published figures, recomputed ----------------------------------------------------------------

GPT2_PADDED_VOCAB = 50304  # nanoGPT and llm.c pad GPT-2's 50,257 words to a multiple of 64


def published_checks() -> list[dict]:
    """Figures other codebases print for GPT-2 124M at T = 1024, recomputed here; and MFU
    figures derived from published step times."""
    from dtl.model import preset

    gpt2 = preset("gpt2-124m")  # 50,257 words (nanoGPT's from_pretrained)
    padded = preset("gpt2-124m", vocab_size=GPT2_PADDED_VOCAB)  # llm.c, nanoGPT from scratch
    llmc_n = num_params(padded)  # llm.c's num_parameters: every parameter, wpe included
    llmc = flops_per_token(padded, 1024, "causal", n_params=llmc_n)
    A100 = PRECISIONS["bf16"].peak_flops("NVIDIA A100-SXM4-80GB")  # the peak table's, dense bf16
    return [
        dict(
            what="nanoGPT estimate_mfu, GPT-2 124M (from_pretrained, 50,257 words), "
            "FLOPs per token: 6N + 12LHQT, N without wpe",
            ours=flops_per_token(gpt2, 1024, "palm"),
            published=855_166_464,
            source="karpathy/nanoGPT model.py estimate_mfu",
        ),
        dict(
            what="llm.c gpt2_estimate_mfu, GPT-2 124M (padded 50,304), FLOPs per token: "
            "6N + 6LCT, N = num_parameters",
            ours=llmc,
            published=803_478_528,
            source="karpathy/llm.c train_gpt2.cu",
        ),
        dict(
            what="llm.c GPT-2 124M on 8 x A100: 524,288 tokens per ~300 ms step -> MFU",
            ours=mfu(llmc, 524_288 / 0.300, 8 * A100),
            published=0.56,
            source="karpathy/llm.c scripts/run_gpt2_124M.sh, derived",
        ),
        dict(
            what="Megatron GPT 1T (Narayanan 2021): 502 PFLOP/s on 3,072 A100 -> % of peak",
            # the course's MFU and peak table on the paper's aggregate rate: 502 PFLOP/s of
            # model FLOPs (its eq. 3, full recompute included) over 3,072 GPUs' peaks
            ours=mfu(502e15, 1.0, 3072 * A100),
            published=0.52,
            source="Narayanan et al. 2021, Table 1",
        ),
    ]
