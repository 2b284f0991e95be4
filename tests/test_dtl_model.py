"""dtl.model: parameter counts (large presets on the meta device), seed-only init, sliceable
blocks, swappable attention, and flops_per_token against a FLOP counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dtl.model import GPT, PRESETS, flops_per_token, naive_attention, num_params, preset

# Published sizes: GPT-2 small 124M (nanoGPT prints 123.65M, which excludes wpe's 786,432);
# GPT-3 Small "125M" (Brown et al. 2020, Table 2.1).
KNOWN_COUNTS = {
    "tiny": 34_688,
    "small": 7_248_640,
    "gpt2-124m": 124_439_808,
    "gpt3-125m": 125_226_240,
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_formula_matches_the_built_module_without_allocating(name):
    cfg = preset(name)
    with torch.device("meta"):  # shapes only: the 124M presets cost no memory here
        model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg) == KNOWN_COUNTS[name]


def test_untied_head_adds_one_vocab_by_width_matrix():
    cfg = preset("tiny", tie_weights=False)
    assert num_params(cfg) - num_params(preset("tiny")) == cfg.vocab_size * cfg.n_embd


def test_init_depends_only_on_the_seed():
    torch.manual_seed(123)  # the global RNG must not matter
    a = GPT(preset("tiny"), seed=7).state_dict()
    torch.manual_seed(999)
    b = GPT(preset("tiny"), seed=7).state_dict()
    c = GPT(preset("tiny"), seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["wte.weight"], c["wte.weight"])


def test_embed_blocks_head_compose_to_forward_as_pipeline_stages_would():
    model = GPT(preset("tiny"), seed=0)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    x = model.embed(idx)
    for block in model.blocks[:1]:  # stage 0
        x = block(x)
    for block in model.blocks[1:]:  # stage 1
        x = block(x)
    torch.testing.assert_close(model.head(x), model(idx)[0], rtol=0, atol=0)


def test_swapping_attention_for_the_written_out_version_changes_nothing():
    model = GPT(preset("tiny"), seed=0)
    idx, targets = torch.randint(0, 256, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    fused, loss_fused = model(idx, targets)
    model.set_attention(naive_attention)
    written, loss_written = model(idx, targets)
    torch.testing.assert_close(written, fused, rtol=1e-5, atol=1e-6)  # fp32, reordered sums
    torch.testing.assert_close(loss_written, loss_fused, rtol=1e-5, atol=1e-6)
    # std-0.02 init: logits near zero, so the loss on random targets is near ln(256) = 5.545
    assert abs(loss_fused.item() - 5.545) < 0.05


def test_flops_per_token_matches_a_flop_counter_within_3_percent():
    cfg = preset("tiny")
    model = GPT(cfg, seed=0)
    model.set_attention(naive_attention)  # CPU SDPA has no FLOP formula; matmuls do
    B, T = 2, cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    measured = counter.get_total_flops() / (B * T)
    predicted = flops_per_token(cfg)
    # 6N counts biases and LayerNorm weights as if they were matmul weights: 2.7% of tiny's N
    assert abs(predicted - measured) / measured < 0.03, (predicted, measured)
    assert flops_per_token(cfg, causal_halved=True) < predicted


def test_bad_model_shapes_are_one_line_errors():
    with pytest.raises(ValueError, match="n_embd 30 is not divisible by n_head 4"):
        preset("tiny", n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        preset("huge")
    with pytest.raises(ValueError, match="sequence of 33 exceeds block_size 32"):
        GPT(preset("tiny"))(torch.zeros(1, 33, dtype=torch.long))


def test_a_meta_device_build_materialized_later_equals_the_eager_build_and_stays_tied():
    cfg = preset("tiny")
    with torch.device("meta"):
        model = GPT(cfg, seed=3)
    model.to_empty(device="cpu")  # what FSDP2 / DCP flows do before filling the weights
    model.reset_parameters(seed=3)
    assert model.lm_head.weight is model.wte.weight
    eager = GPT(cfg, seed=3).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, eager[name]), name
