"""dtl.model: parameter counts (large presets on the meta device), per-parameter init that a stage
or one block reproduces alone, pipeline pieces, head-sharded attention and the TP plan, vocabulary
padding, the loss outside forward, position ids, and flops_per_token against a FLOP counter."""

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from dtl.model import (
    GPT,
    PRESETS,
    Block,
    canonical_name,
    flops_per_token,
    init_tensor,
    loss_fn,
    materialize,
    naive_attention,
    num_params,
    pad_vocab_size,
    preset,
)
from dtl.tp_plan import TP_PLAN, shard_tensor, tp_shard_of

# Published sizes: GPT-2 small 124M (nanoGPT prints 123.65M, which excludes wpe's 786,432);
# GPT-3 Small "125M" (Brown et al. 2020, Table 2.1).
KNOWN_COUNTS = {
    "tiny": 34_688,
    "tiny-nobias": 33_952,  # tiny minus 736 biases: 2 x (32 + 32 + 96 + 32 + 128 + 32) + 32
    # tiny-nobias with each MLP (2 x 32 x 128 = 8,192) replaced by a 32 x 4 router and 4 experts:
    # 33,952 + 2 x (128 + 3 x 8,192)
    "tiny-moe": 83_360,
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


def test_an_moe_counts_its_active_parameters_as_the_router_and_k_experts():
    cfg = preset("tiny-moe")  # E = 4, k = 2: a token uses 2 of the 4 experts of 8,192 each
    assert num_params(cfg) - num_params(cfg, active=True) == cfg.n_layer * 2 * 8_192
    dense = preset("tiny-nobias")  # FLOPs by active parameters: 6 x (the router + 1 MLP more)
    extra = cfg.n_layer * (32 * 4 + 8_192)
    assert flops_per_token(cfg) - flops_per_token(dense) == 6 * extra


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
    x = model.blocks["0"](x)  # stage 0: embed + block 0
    x = model.blocks["1"](x)  # stage 1: block 1 + head
    torch.testing.assert_close(model.head(x), model(idx), rtol=0, atol=0)


def test_swapping_attention_for_the_written_out_version_changes_nothing():
    model = GPT(preset("tiny"), seed=0)
    idx, targets = torch.randint(0, 256, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    fused = model(idx)
    loss_fused = loss_fn(fused, targets)
    model.set_attention(naive_attention)
    written = model(idx)
    loss_written = loss_fn(written, targets)
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
        loss_fn(model(idx), idx).backward()
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


# --- per-parameter init: a stage or one block, built alone, equals the one-process model --------


def test_each_parameter_depends_only_on_seed_and_its_name():
    cfg = preset("tiny")
    model = GPT(cfg, seed=5)
    for name, p in model.named_parameters():
        assert torch.equal(p, init_tensor(name, p.shape, seed=5, n_layer=cfg.n_layer)), name
    # different names draw different values, and the residual projections are scaled down
    w = dict(model.named_parameters())
    assert not torch.equal(w["blocks.0.mlp.c_fc.weight"][:32], w["blocks.1.mlp.c_fc.weight"][:32])
    assert w["blocks.0.mlp.c_proj.weight"].std() < 0.6 * w["blocks.0.mlp.c_fc.weight"].std()


def test_a_pipeline_stage_built_on_meta_materializes_only_its_parameters_bit_for_bit():
    cfg = preset("tiny", n_layer=4)
    full = dict(GPT(cfg, seed=11).named_parameters())
    with torch.device("meta"):
        stage = GPT(cfg, seed=11)  # the last of 2 stages: blocks 2, 3 and the head
    del stage.blocks["0"], stage.blocks["1"]
    stage.wte, stage.wpe = None, None
    stage.lm_head.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.n_embd, device="meta"))
    materialize(stage, seed=11, n_layer=cfg.n_layer)
    names = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "")
             for n, _ in stage.named_parameters()}  # fmt: skip
    assert names == {"blocks.2", "blocks.3", "ln_f", "lm_head"}  # nothing else was allocated
    for name, p in stage.named_parameters():
        # the untied stage-local lm_head must equal wte, the weight it is tied to in one process
        ref = full["wte.weight"] if name == "lm_head.weight" else full[name]
        assert torch.equal(p, ref), name
    x = torch.randn(2, 8, cfg.n_embd)
    assert stage(x).shape == (2, 8, cfg.vocab_size)  # hidden states in, logits out


def test_one_block_alone_equals_that_block_of_the_full_model():
    cfg = preset("tiny", n_layer=3)
    full = GPT(cfg, seed=2)
    with torch.device("meta"):
        block = Block(cfg)
    materialize(block, seed=2, n_layer=cfg.n_layer, prefix="blocks.2.")
    for (name, p), (_, q) in zip(block.named_parameters(), full.blocks["2"].named_parameters()):
        assert torch.equal(p, q), name
    # wrappers' prefixes are not part of the name that seeds the init
    assert canonical_name("module._orig_mod.blocks.2.attn.c_attn.weight") == (
        "blocks.2.attn.c_attn.weight"
    )


# --- tensor parallelism: head-sharded attention and the declarative plan -------------------


def _shard_module(module, prefix, tp_rank, tp_size):
    """A copy of `module` whose planned Linears hold rank tp_rank's shard (row biases on rank 0
    only: a row-parallel bias is added once, after the partial outputs are summed)."""
    import copy

    shard = copy.deepcopy(module)
    for name, sub in list(shard.named_modules()):
        plan = tp_shard_of(prefix + name)
        if plan is None or not isinstance(sub, nn.Linear):
            continue
        w = shard_tensor(sub.weight.detach(), plan, False, tp_rank, tp_size)
        new = nn.Linear(w.shape[1], w.shape[0], bias=sub.bias is not None)
        with torch.no_grad():
            new.weight.copy_(w)
            if sub.bias is not None:
                b = shard_tensor(sub.bias.detach(), plan, True, tp_rank, tp_size)
                new.bias.copy_(b if plan.style != "row" or tp_rank == 0 else torch.zeros_like(b))
        parent, _, leaf = name.rpartition(".")
        setattr(shard.get_submodule(parent) if parent else shard, leaf, new)
    return shard


@pytest.mark.parametrize("tp_size", [2, 4])
def test_attention_and_mlp_on_one_tp_ranks_heads_compute_that_ranks_partial_output(tp_size):
    cfg = preset("tiny", n_head=4, n_embd=32)
    block = GPT(cfg, seed=0).blocks["0"]
    x = torch.randn(2, 8, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    for part in ("attn", "mlp"):
        full = getattr(block, part)
        shards = [_shard_module(full, f"blocks.0.{part}.", t, tp_size) for t in range(tp_size)]
        if part == "attn":  # each shard holds n_head / tp heads, read off c_attn's width
            assert all(s.n_local_heads == cfg.n_head // tp_size for s in shards)
        partial = [s(x) for s in shards]  # (B, T, C) each: what the all-reduce would sum
        torch.testing.assert_close(sum(partial), full(x), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(partial[0], full(x), atol=1e-3)  # a shard alone is partial


def test_the_fused_qkv_is_split_by_heads_in_each_of_q_k_v_not_cut_in_n_pieces():
    C, tp = 8, 2
    w = torch.arange(3 * C).float()[:, None].expand(3 * C, 4)  # row i holds i
    shard = shard_tensor(w, TP_PLAN["blocks.*.attn.c_attn"], False, tp_rank=1, tp_size=tp)
    rows = shard[:, 0].int().tolist()
    assert rows == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]  # 2nd half of Q, of K, of V
    assert tp_shard_of("blocks.7.mlp.c_proj").style == "row"
    assert tp_shard_of("blocks.0.ln_1") is None and tp_shard_of("wpe") is None
    with pytest.raises(ValueError, match="does not split into 3 block"):
        shard_tensor(torch.zeros(3 * 5, 4), TP_PLAN["blocks.*.attn.c_attn"], False, 0, 2)


def test_vocabulary_padding_follows_megatron_and_nanogpt():
    assert pad_vocab_size(50257, 64) == 50304  # nanoGPT
    assert pad_vocab_size(50257, 128, tp_size=8) == 51200  # Megatron: 128 x TP
    assert pad_vocab_size(50304, 64) == 50304  # already a multiple: unchanged
    assert preset("small").vocab_size == 50304 and preset("gpt2-124m").vocab_size == 50257
    with pytest.raises(ValueError, match="must be >= 1"):
        pad_vocab_size(50257, 0)


# --- loss outside forward, position ids -----------------------------------------------------


def test_loss_fn_is_mean_cross_entropy_skipping_ignore_index():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[1, 2, -100], [0, -100, 4]])
    keep = targets != -100
    expected = nn.functional.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss_fn(logits, targets), expected, rtol=0, atol=0)


def test_position_ids_let_a_rank_embed_non_contiguous_chunks():
    model = GPT(preset("tiny"), seed=0)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])  # a zig-zag rank's two chunks
    torch.testing.assert_close(model.embed(idx[:, pos], pos), model.embed(idx)[:, pos])
    torch.testing.assert_close(model(idx, torch.arange(16)), model(idx), rtol=0, atol=0)
    with pytest.raises(ValueError, match="position ids cover 8 tokens but the input has 16"):
        model.embed(idx, pos)


# --- the Adam test preset ------------------------------------------------------------------


def _grads(name):
    cfg = preset(name)
    model = GPT(cfg, seed=0)
    idx = torch.randint(0, 256, (4, cfg.block_size), generator=torch.Generator().manual_seed(0))
    loss_fn(model(idx), idx.roll(-1, 1)).backward()
    return model, {n: p.grad.abs().max().item() for n, p in model.named_parameters()}


def test_tiny_key_bias_gradient_is_rounding_noise_and_tiny_nobias_has_none_such():
    model, _ = _grads("tiny")
    C = model.cfg.n_embd
    q_bias, k_bias, _ = model.blocks["0"].attn.c_attn.bias.grad.split(C)
    # K's bias: zero in exact arithmetic (q·b_k is the same for every key; softmax ignores it),
    # so what is left is float noise, ~1e-12 here, 7 orders below Q's bias
    assert k_bias.abs().max() < 1e-6 * q_bias.abs().max()
    _, nobias = _grads("tiny-nobias")
    # every parameter of tiny-nobias gets a real gradient (the smallest, LayerNorm's, ~4e-4)
    assert min(nobias.values()) > 1e-5, sorted(nobias.items(), key=lambda kv: kv[1])[:3]


def test_optimizer_groups_decay_matrices_and_embeddings_not_biases_or_norms():
    from dtl.optim import optimizer_groups

    gpt = GPT(preset("tiny"))
    decay, no_decay = optimizer_groups(gpt, 0.1)
    names = {id(p): n for n, p in gpt.named_parameters()}
    assert {names[id(p)] for p in decay["params"]} == {
        n for n, p in gpt.named_parameters() if p.dim() == 2
    }
    assert all(n.endswith(".bias") or ".ln_" in n or n.startswith("ln_f")
               for n in (names[id(p)] for p in no_decay["params"]))  # fmt: skip
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(gpt.parameters()))
    assert optimizer_groups(list(gpt.parameters()), 0.1)[0]["params"] == decay["params"]
