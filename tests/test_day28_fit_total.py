"""Day 28: fit.py's per-rank total, pinned to a sum this test makes itself from the formulas in
fit.py's docstring and the day's notes ("Deep dive: will it fit?"), for GPT-2 124M on 8 ranks.

    Ψ            the parameter count, from the architecture: V·h + s_max·h + L·(12h² + 13h) + 2h
    model state  Ψ x bytes per parameter of weights, gradients and Adam's state (+ a master copy
                 for DeepSpeed), each whole or over N; plus what a step holds gathered
    activations  L x 34·s·b·h bytes (x 2 in fp32) / t, plus the fp32 logits and their gradient,
                 8·b·s·V/t

Every term is an integer here (N = 8 divides 16Ψ, t = 2 divides 8·b·s·V), so the total must be
equal, not close: a total scaled by 0.985, or a term dropped, fails.
"""

import pytest

from day28_gpt125m import fit
from day28_gpt125m.strategies import REGISTRY
from dtl.model import preset

M = preset("gpt2-124m")
N, B, S = 8, 2, 1024  # ranks, micro-batch, tokens
L, H, V = M.n_layer, M.n_embd, M.vocab_size
BLOCK = 12 * H * H + 13 * H  # attention 4h² + 4h, MLP 8h² + 5h, two LayerNorms 4h
PSI = V * H + M.block_size * H + L * BLOCK + 2 * H  # tied head: wte counted once; ln_f 2h


def _activations(bytes_per_value: int, t: int) -> int:
    return L * 34 * S * B * H * bytes_per_value // 2 // t + 8 * B * S * V // t


# (strategy, precision) -> its model state per rank, from the notes' table, in bytes
STATE = {
    ("ddp", "fp32"): 16 * PSI,  # 4 param + 4 grad + 8 Adam, whole on every rank
    ("fsdp2", "fp32"): 16 * PSI // N + 4 * BLOCK,  # + the largest block, gathered full
    ("zero2", "fp32"): 4 * PSI + (4 + 12) * PSI // N,  # params whole; grads, master + Adam / N
    ("zero2", "bf16"): 2 * PSI + (2 + 12) * PSI // N,
    ("zero3", "fp32"): (4 + 4 + 12) * PSI // N + 4 * PSI,  # + every parameter, gathered
    ("zero3", "bf16"): (2 + 2 + 12) * PSI // N + 2 * PSI,
}
BYTES = {"fp32": 4, "bf16": 2}


def test_the_parameter_count_is_gpt2_smalls():
    assert PSI == 124_439_808  # the notes' figure (dtl/model.py's preset comment)


@pytest.mark.parametrize(("strategy", "precision"), list(STATE))
def test_fit_total_is_the_sum_of_state_and_activations_to_the_byte(strategy, precision):
    got = fit.predicted_bytes(M, strategy, world=N, micro=B, seq_len=S, precision=precision)
    acts = _activations(BYTES[precision], t=1)
    want = STATE[strategy, precision] + acts
    assert acts > 0 and STATE[strategy, precision] > 0  # both terms count
    assert got["states"] == STATE[strategy, precision], (strategy, precision, got)
    assert got["activations"] == acts, (strategy, precision, got)
    assert got["total"] == want, (strategy, precision, got["total"], want)


@pytest.mark.parametrize("strategy", [s for s, k in REGISTRY.items() if k.model_parallel])
def test_a_model_parallel_total_divides_the_activations_by_tp(strategy):
    # the stage's state is day 22's formula (checked against measured bytes in
    # test_day28_gpt125m.py); what this pins is the rest of the sum: activations / t, added once
    got = fit.predicted_bytes(M, strategy, world=N, tp=2, pp=1, micro=B, seq_len=S)
    want = got["resident"] + got["gathered"] + _activations(4, t=2)
    assert got["activations"] == _activations(4, t=2), (strategy, got)
    assert got["total"] == want, (strategy, got["total"], want)
