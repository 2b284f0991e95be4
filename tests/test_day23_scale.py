"""Day 23 at scale: DeepSpeed's ZeRO-3 engine, built and stepped as rank 0 of N under
dtl.simulate (fake process group, fake tensors). The `scale` launch line checks that it holds per
location and kind what predict.py says, to the byte, for every template at N = 8 and 64; here the
gathered peak follows predict._gathered's two rules (reuse distance, live-parameter cap) where
they bind, which the small real runs never reach."""

from __future__ import annotations

import pytest

from day23_zero3_offload import predict, scale
from dtl.simulate import SimulateError, deepspeed_under_fake_tensors, fake_world
from dtl.testing import needs_extras

pytestmark = needs_extras("deepspeed")


def _gathered_with(monkeypatch, live: float, reuse: float) -> tuple[float, float, float, list]:
    """(predicted, simulated, the release rule's peak, the non-persistent sizes in forward order)
    gathered elements of a 4 x 256 GPT (its matrices above the template's persistence
    threshold: 196-262 K, wpe 524 K, wte 12.9 M) with the two limits at the size of a few."""
    cfg = predict.gpt_of(4, 256)
    original = scale.ds_config

    def ds_config(template, world):
        ds = original(template, world)
        ds["zero_optimization"].update(
            stage3_max_live_parameters=live, stage3_max_reuse_distance=reuse,
            stage3_prefetch_bucket_size=live,
        )  # fmt: skip
        return ds

    monkeypatch.setattr(scale, "ds_config", ds_config)
    ds = ds_config("zero3", 8)
    e = predict.element_bytes(ds)
    got = scale.simulate(cfg, "zero3", 8)["device"]["gathered"] / e
    want = predict.predict(ds, predict.param_groups(cfg), 8)["device"]["gathered"] / e
    threshold = predict.persistence_threshold(ds["zero_optimization"])
    sizes = [n for g in predict.param_groups(cfg) for n in g if n > threshold]  # non-persistent
    return want, got, predict._retained(sizes, reuse), sizes


def _held_at_the_turn(sizes: list, reuse: float) -> int:
    """A floor of the gathered peak, from the release rule alone (predict._gathered, the notes'
    "a parameter stays gathered only if the trace reuses it within stage3_max_reuse_distance
    elements"): at the forward/backward turn the tied head runs with wte (sizes[0]) gathered,
    and a parameter k used earlier in forward is still gathered if its next use, k's module in
    backward, comes fewer than `reuse` elements later: in between run the modules after k
    (twice: forward, then backward) and the head (wte, twice)."""
    wte = sizes[0]
    between = [2 * sum(sizes[k + 1 :]) + 2 * wte for k in range(len(sizes))]
    return wte + sum(n for k, n in enumerate(sizes) if k > 0 and between[k] < reuse)


# reuse 1.5e6: everything but the running module's parameter is released (the floor is wte);
# 2.8e7: the last blocks' parameters outlive the head, and the peak is the rule's replay. Both
# with the live cap (2e5) below the release rule's peak. Each reuse distance is at least 2.4e5
# away from every parameter's distance at the turn: the persistent parameters (65 K and less,
# outside the rule's trace) cannot move one across it.
@pytest.mark.parametrize("reuse", [1.5e6, 2.8e7])
def test_the_gathered_peak_follows_the_release_rule_where_the_live_cap_is_below_it(
    monkeypatch, reuse
):
    predicted, simulated, released, sizes = _gathered_with(monkeypatch, live=2e5, reuse=reuse)
    everything = sum(n for g in predict.param_groups(predict.gpt_of(4, 256)) for n in g)
    assert simulated < everything  # the rules bind: not every parameter stays gathered
    floor = _held_at_the_turn(sizes, reuse)  # at least the running module's parameter, wte
    if reuse > 2 * sizes[0]:  # not vacuous: parameters kept across the turn, past cap + wte
        assert floor > 2e5 + max(sizes), floor
    assert floor <= released, ("the rule released what must be live", floor, released)
    assert floor <= simulated == released <= predicted, (floor, simulated, released, predicted)


def test_the_gathered_peak_stays_under_the_live_cap_where_prefetch_sets_it(monkeypatch):
    """Prefetch stops once the cap is reached, the last parameter added past it: the bound is
    the cap plus the largest parameter (wte: 12.9 M), and the peak lands over the cap."""
    predicted, simulated, _, _ = _gathered_with(monkeypatch, live=3e6, reuse=1e5)
    cfg = predict.gpt_of(4, 256)
    wte = cfg.vocab_size * cfg.n_embd
    assert predicted == 3e6 + wte
    assert 3e6 < simulated <= predicted


def test_nvme_offload_is_refused_by_the_simulation():
    ds = scale.ds_config("zero3", 8)
    ds["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/tmp"}
    with fake_world(8), pytest.raises(SimulateError, match="NVMe offload"):
        with deepspeed_under_fake_tensors(ds):
            pass


def test_deepspeed_patches_are_refused_outside_a_fake_world():
    with pytest.raises(SimulateError, match="inside fake_world only"):
        with deepspeed_under_fake_tensors(scale.ds_config("zero3", 8)):
            pass
