"""Day 27: the achievable matmul FLOP/s of this device, at the shapes and dtype a run uses.

A datasheet peak (H100 SXM: 989 dense BF16 TFLOP/s) is a number no kernel reaches: the best
large matmuls measure ~80% of it (the "maximum achievable matmul FLOPS", MAMF: H100 SXM 795).
A CPU has no datasheet figure in the peak table at all. So MFU is reported against both: the
datasheet where there is one, and a ceiling measured here, the FLOP/s of the very matmuls the
GPT's step runs, for its batch of tokens M = B·T:

    c_attn (M, C) x (C, 3C)   attn.c_proj (M, C) x (C, C)   c_fc (M, C) x (C, 4C)
    mlp.c_proj (M, 4C) x (4C, C)                            lm_head (M, C) x (C, V)

each timed alone (best of `reps` after a warm-up), and combined weighted by its share of the
step's FLOPs: total FLOPs / total time, the rate the step would run at if it were only matmuls,
each as fast as alone.
"""

from __future__ import annotations

import time

import torch

from dtl.model import GPTConfig


def step_matmuls(cfg: GPTConfig, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of each weight matmul of one layer and of the output layer."""
    C = cfg.n_embd
    return {
        "c_attn": (tokens, C, 3 * C),
        "attn.c_proj": (tokens, C, C),
        "mlp.c_fc": (tokens, C, 4 * C),
        "mlp.c_proj": (tokens, 4 * C, C),
        "lm_head": (tokens, C, cfg.vocab_size),
    }


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops_per_s(
    m: int, k: int, n: int, dtype=torch.float32, device="cpu", reps: int = 5
) -> float:
    """Best-of-`reps` FLOP/s of one (m, k) @ (k, n) matmul."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    torch.mm(a, b)  # warm-up: first-call allocation and kernel selection
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best


def step_ceiling(
    cfg: GPTConfig, tokens: int, dtype=torch.float32, device="cpu", reps: int = 5
) -> dict:
    """Per matmul FLOP/s, and the FLOPs-weighted ceiling of the step (L layers + lm_head)."""
    rows, flops, seconds = {}, 0.0, 0.0
    for name, (m, k, n) in step_matmuls(cfg, tokens).items():
        rate = matmul_flops_per_s(m, k, n, dtype, device, reps)
        count = 1 if name == "lm_head" else cfg.n_layer
        work = 2 * m * k * n * count
        rows[name] = rate
        flops += work
        seconds += work / rate
    return dict(per_matmul=rows, ceiling=flops / seconds)


def square_ceiling(size: int, dtype=torch.float32, device="cpu", reps: int = 5) -> float:
    """One large square matmul: the best case of this device (the MAMF idea)."""
    return matmul_flops_per_s(size, size, size, dtype, device, reps)
