"""day22_megatron/moe_scale.py: one simulated rank of an N-rank MoE job moves the all-to-all
bytes formulas.ep_bytes says, for every routing assumption, and the checks catch planted bugs.
A small MoE shape keeps each simulation to milliseconds (fake tensors: shapes only)."""

from __future__ import annotations

import pytest

from day22_megatron import formulas, moe_scale
from day22_megatron import routing_assumptions as routing
from day22_megatron.moe_scale import Config, MoEShape

SMALL = MoEShape(64, 4, 128, 16, 4, 2, (8,), "test")  # C 64, H 128, E 16, k 4, 2 layers
N, EP, TOKENS = 64, 8, 256
HIST = [40, 30, 20, 10, 5, 3, 1, 1]  # a measured-like histogram of 8 experts


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.setitem(moe_scale.MODELS, "small", SMALL)
    return Config(models="small", ns=str(N), tokens=TOKENS)


@pytest.mark.parametrize("routing", moe_scale.DISTRIBUTIONS)
def test_simulated_bytes_and_state_equal_the_formulas_at_64_ranks(small: Config, routing: str):
    r = moe_scale.row("small", N, EP, routing, small, HIST)
    assert r["a2a_sim"] == r["a2a_formula"] > 0
    assert r["state_sim"] == r["state_formula"] > 0
    assert (r["rows_sent"], r["rows_received"]) == (
        r["rows_sent_formula"],
        r["rows_received_formula"],
    )
    if routing != "uniform":  # the simulated rank is the hottest one
        assert r["imbalance"] > 1 and r["rows_received"] > r["rows_sent"]


def test_counts_answered_for_the_wrong_rank_are_caught(
    small: Config, monkeypatch: pytest.MonkeyPatch
):
    right = routing.received_counts
    monkeypatch.setattr(
        routing, "received_counts", lambda counts, ep, rank: right(counts, ep, rank + 1)
    )
    r = moe_scale.row("small", N, EP, "zipf", small, HIST)
    assert moe_scale.gap(r, "a2a") > 0.01
    assert r["rows_received"] != r["rows_received_formula"]


def test_a_formula_without_the_backward_all_to_alls_is_caught(
    small: Config, monkeypatch: pytest.MonkeyPatch
):
    right = formulas.ep_bytes

    def forward_only(cfg, sent: int, received: int, calls: int) -> float:
        return (right(cfg, sent, received, calls) - calls * cfg.moe.n_expert * 8) / 2 + (
            calls * cfg.moe.n_expert * 8
        )

    monkeypatch.setattr(moe_scale.formulas, "ep_bytes", forward_only)
    r = moe_scale.row("small", N, EP, "uniform", small, HIST)
    assert moe_scale.gap(r, "a2a") > 0.4  # the simulation counts 4 row all-to-alls, not 2


def test_routing_table_gives_k_distinct_experts_per_token_and_the_counts():
    counts = routing.expert_counts(routing.zipf(16, 1.0), TOKENS, 4)
    table = routing.routing_table(counts, TOKENS)
    assert table.shape == (TOKENS, 4)
    assert all(len(set(row.tolist())) == 4 for row in table)
    assert table.flatten().bincount(minlength=16).tolist() == counts
    assert max(counts) <= TOKENS  # Zipf's head capped at one slot per token


def test_the_measured_histogram_sums_to_n_times_k_rows():
    hist = routing.measured_histogram(steps=2)
    assert len(hist) == 8 and sum(hist) == 2 * 16 * 32 * 2  # layers x B x T x k
    for n_expert in (8, 256):
        p = routing.stretch(hist, n_expert)
        counts = routing.expert_counts(p, 4096, 8 if n_expert == 256 else 2)
        assert sum(counts) == 4096 * (8 if n_expert == 256 else 2)
        assert counts == sorted(counts, reverse=True)  # hottest first: ep rank 0 simulated


def test_the_table_states_its_routing_assumption(small: Config):
    lines = moe_scale.assumptions(small, HIST)
    assert lines[0].startswith("routing assumption")
    assert any("measured: tiny-moe E=8 after 20 steps" in line for line in lines)
    assert any(line.strip().startswith("zipf") for line in lines)
