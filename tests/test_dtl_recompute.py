"""Activation recomputation (dtl.model's set_recompute): the gradients of the run without it, bit
for bit, and what each block keeps for backward equal to day 19's terms under recompute_terms.

A recomputation that did nothing would keep what "none" keeps and fail the bytes test; one that
recomputed something else (another dropout mask, a stale input) would fail the gradient test."""

from __future__ import annotations

import pytest
import torch

from day19_tp.activations import recompute_terms, saved_activation_bytes
from day21_sp_cp import formulas
from dtl.model import GPT, loss_fn, naive_attention, preset, sdpa_attention

MODES = ("none", "selective", "full")
ATTENTIONS = {"materialized": naive_attention, "fused": sdpa_attention}


def _grads(mode: str, attention: str, dropout: float) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = preset("tiny", dropout=dropout)
    gpt = GPT(cfg, seed=0)
    gpt.set_attention(ATTENTIONS[attention])
    gpt.set_recompute(mode)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g)
    torch.manual_seed(7)  # dropout's masks: the recomputed forward must draw the same
    loss = loss_fn(gpt(x[:, :-1]), x[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in gpt.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_recomputation_gives_the_gradients_of_the_run_without_it_bit_for_bit(attention, dropout):
    loss, want = _grads("none", attention, dropout)
    for mode in ("selective", "full"):
        got_loss, got = _grads(mode, attention, dropout)
        assert got_loss == loss, mode
        for name in want:
            assert torch.equal(got[name], want[name]), (mode, name)


@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_each_mode_keeps_what_the_formula_says(attention):
    """One block of a 64-wide, 4-head GPT at s = 32, fp32: the bytes autograd keeps equal
    layer_terms (day 21's, t = 1) with recompute_terms applied; each mode keeps less."""
    cfg = preset("tiny", n_embd=64, n_head=4)
    s, h = cfg.block_size, cfg.n_embd
    kept = {}
    for mode in MODES:
        gpt = GPT(cfg, seed=0)
        gpt.set_attention(ATTENTIONS[attention])
        gpt.set_recompute(mode)
        x = torch.randn(1, s, h, generator=torch.Generator().manual_seed(1))
        kept[mode], _ = saved_activation_bytes(gpt.blocks["0"], x.requires_grad_())
        terms = formulas.layer_terms(s, 1, h, cfg.n_head, attention=attention)
        want = sum(recompute_terms(terms, mode, layer_input=s * h * 4).values())
        assert kept[mode] == want, (mode, kept[mode], want)
    assert kept["full"] < kept["selective"] < kept["none"]


def test_no_backward_no_recomputation_and_unknown_modes_are_refused():
    gpt = GPT(preset("tiny"), seed=0)
    gpt.set_recompute("full")
    x = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():  # evaluation: nothing is kept, so nothing is checkpointed
        assert gpt(x).shape == (1, 8, gpt.cfg.vocab_size)
    with pytest.raises(ValueError, match="unknown recompute 'some'"):
        gpt.set_recompute("some")
