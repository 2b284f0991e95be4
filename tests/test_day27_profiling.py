"""Day 27: FLOP conventions against published figures and FlopCounterMode; the ceiling's
weighting; the trace breakdown on a hand-made trace and on real CPU traces of days 17 and 20.
"""

import contextlib
import json

import pytest
import torch

from day27_profiling import bench, ceiling, mfu, trace_analysis
from day27_profiling.profile import nvtx_context, trace_path, wrapped_line
from dtl import config as dtl_config
from dtl.model import GPT, preset


def test_flops_per_token_equal_the_published_figures_for_gpt2_124m():
    checks = {row["source"]: row for row in mfu.published_checks()}
    nano = checks["karpathy/nanoGPT model.py estimate_mfu"]
    llmc = checks["karpathy/llm.c train_gpt2.cu"]
    assert nano["ours"] == 855_166_464  # 6 x 123,653,376 + 12 x 12 x 12 x 64 x 1024
    assert llmc["ours"] == 803_478_528  # 6 x 124,475,904 + 6 x 12 x 768 x 1024
    for row in checks.values():
        if row["published"] < 1:  # MFU figures derived from published step times
            assert row["ours"] == pytest.approx(row["published"], abs=0.01), row["what"]


def test_conventions_differ_exactly_by_the_attention_and_recompute_terms():
    cfg = preset("gpt2-124m")
    attn = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * 1024
    palm = mfu.flops_per_token(cfg, 1024, "palm")
    assert palm - mfu.flops_per_token(cfg, 1024, "causal") == attn / 2
    assert mfu.flops_per_token(cfg, 1024, "kaplan") == 72 * cfg.n_layer * cfg.n_embd**2
    megatron = mfu.flops_per_token(cfg, 1024, "megatron")
    assert megatron == pytest.approx(palm, rel=0.01)  # the same model FLOPs, counted apart
    hfu = mfu.flops_per_token(cfg, 1024, "megatron_recompute")
    # full recompute runs every layer's forward twice (4 passes, not 3): + 24·l·h²·(1 + s/6h);
    # the output layer is not recomputed, so its 6·h·V per token is in both
    L, h = cfg.n_layer, cfg.n_embd
    assert hfu - megatron == pytest.approx(24 * L * h * h * (1 + 1024 / (6 * h)))
    assert hfu - megatron == 207_618_048  # exactly, as the notes say, for GPT-2 124M at s = 1024
    with pytest.raises(ValueError, match="unknown convention"):
        mfu.flops_per_token(cfg, 1024, "chinchilla")


@pytest.mark.parametrize(
    "name, seq, tied", [("tiny", 32, True), ("small", 128, True), ("small", 128, False)]
)
def test_flop_counter_mode_is_6n_plus_attention_plus_the_recompute_minus_the_vectors(
    name, seq, tied
):
    """Exactly, as the notes decompose it (CPU kernels): the flash backward recomputes Q·Kᵀ
    (+2·L·H·Q·T per token), and 6N counts biases and LayerNorm weights that no matmul touches
    (-6 per such parameter). Small, T = 128: +131,072 - 41,472 = +89,600 per token."""
    cfg = preset(name, tie_weights=tied)  # untied: wte is a lookup, not in N
    x = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    gpt = GPT(cfg, seed=0)
    counted = mfu.counted_flops_per_token(gpt, x, x)
    formula = mfu.flops_per_token(cfg, seq, "palm")
    recompute = 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq
    vectors = sum(p.numel() for p in gpt.parameters() if p.dim() < 2)
    assert counted - formula == recompute - 6 * vectors, (counted, formula)
    assert abs(counted / formula - 1) < 0.01  # and so within 1% of the formula


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_adds_the_flops_the_formula_says_hfu_over_mfu(mode):
    """FlopCounterMode over a step with set_recompute(mode), minus the same step without it, is
    recompute_flops_per_token exactly: the attention core's forward again (selective), or each
    block's forward but mlp.c_proj, which torch's checkpoint never reruns (full: early stop)."""
    cfg = preset("tiny")
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    counted = {}
    for m in ("none", mode):
        gpt = GPT(cfg, seed=0)
        gpt.set_recompute(m)
        counted[m] = mfu.counted_flops_per_token(gpt, x, x)
    assert counted[mode] - counted["none"] == mfu.recompute_flops_per_token(cfg, 32, mode)
    whole_layers = 2 * 12 * cfg.n_layer * cfg.n_embd**2  # what a rerun of whole blocks adds
    if mode == "full":
        assert counted[mode] - counted["none"] < whole_layers


def test_mfu_is_model_flops_over_peak():
    assert mfu.mfu(1e9, 1e3, 1e13) == pytest.approx(1e-1)


def test_the_step_ceiling_weights_each_matmul_by_its_share_of_the_flops(monkeypatch):
    cfg = preset("tiny")
    rates = {"c_attn": 1e9, "attn.c_proj": 2e9, "mlp.c_fc": 4e9, "mlp.c_proj": 4e9, "lm_head": 5e8}
    shapes = ceiling.step_matmuls(cfg, 64)
    by_shape = {shape: rates[name] for name, shape in shapes.items()}
    monkeypatch.setattr(ceiling, "matmul_flops_per_s", lambda m, k, n, *a, **kw: by_shape[m, k, n])
    got = ceiling.step_ceiling(cfg, 64)
    work = {
        n: 2 * m * k * nn * (1 if n == "lm_head" else cfg.n_layer)
        for n, (m, k, nn) in shapes.items()
    }
    want = sum(work.values()) / sum(work[n] / rates[n] for n in work)
    assert got["ceiling"] == pytest.approx(want)
    assert min(rates.values()) < got["ceiling"] < max(rates.values())


def test_a_real_matmul_rate_is_positive_and_finite():
    rate = ceiling.matmul_flops_per_s(64, 64, 64, reps=2)
    assert 0 < rate < float("inf")


# --- trace analysis ------------------------------------------------------------------------------


def test_interval_algebra():
    a, b = [(0, 10), (20, 30)], [(5, 25)]
    assert trace_analysis.intersect(a, b) == [(5, 10), (20, 25)]
    assert trace_analysis.subtract(a, b) == [(0, 5), (25, 30)]
    assert trace_analysis.total(a + b) == 30


def _event(name, ts_us, dur_us, tid):
    return dict(ph="X", name=name, ts=ts_us, dur=dur_us, tid=tid, pid=1)


def test_breakdown_of_a_hand_made_trace(tmp_path):
    # a 100 ms step: compute 0-40 and 50-80 ms on the main thread; a blocking all-reduce call
    # 40-50 ms; gloo's work 30-50 ms on its own thread (10 ms under compute, 10 exposed)
    events = [
        _event("ProfilerStep#2", 0, 100_000, 1),
        _event("aten::mm", 0, 40_000, 1),
        _event("c10d::allreduce_", 40_000, 10_000, 1),
        _event("aten::empty", 41_000, 1_000, 1),  # inside the call: not compute
        _event("autograd::engine::evaluate_function: MmBackward0", 50_000, 30_000, 1),
        _event("gloo:all_reduce", 30_000, 20_000, 2),
        _event("aten::mm", 200_000, 10_000, 1),  # after the step: ignored
    ]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    b = trace_analysis.breakdown(str(path))
    assert (b.step_ms, b.compute_ms, b.hidden_ms, b.exposed_ms, b.idle_ms) == pytest.approx(
        (100, 70, 10, 10, 20)
    )
    assert b.not_computing == pytest.approx(0.3) and b.hidden_share == pytest.approx(0.5)


def test_real_cpu_traces_naive_sync_hides_nothing_and_bucketed_sync_some(tmp_path):
    # day 20's 1F1B trace against its own measured idle: the registered `traces` line, whose
    # smoke run profiles pp_1f1b and must print "within 10% yes" (tests/test_lessons.py)
    out = {}
    for name in ("ddp_naive", "ddp_bucket"):
        output, trace_dir = bench.profile_run(name, str(tmp_path))
        ranks = [trace_analysis.breakdown(trace_path(trace_dir, r)) for r in (0, 1)]
        out[name] = (output, ranks)
    naive = out["ddp_naive"][1]
    bucket = out["ddp_bucket"][1]
    assert all(b.comm_ms > 0 for b in naive + bucket)
    assert all(b.hidden_share < 0.02 for b in naive), [b.line() for b in naive]
    hidden = sum(b.hidden_ms for b in bucket) / sum(b.comm_ms for b in bucket)
    assert hidden > 0.05, [b.line() for b in bucket]


def test_nvtx_ranges_only_where_cuda_is(monkeypatch):
    import contextlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(nvtx_context(True), contextlib.nullcontext)
    with nvtx_context(True):  # no error on a CPU
        torch.ones(2) @ torch.ones(2)


def test_a_registered_line_gets_the_wrapper_before_its_module():
    line = wrapped_line(20, "1f1b", "out/t", 2)
    i = line.index("-m")
    assert line[:i] == ["torchrun", "--standalone", "--nproc_per_node=2"]
    assert line[i + 1 : i + 3] == ["day27_profiling.profile", "--target=day20_pp.train"]
    assert line[line.index("--") + 1 :] == ["--schedule=1f1b", "--pp=2"]


@pytest.mark.parametrize(
    "cls, args, message",
    [
        (bench.Config, ["--part=flops"], "unknown part 'flops'"),
        (bench.Config, ["--runs=ddp_magic"], "unknown run 'ddp_magic'"),
        (bench.Config, ["--seq_len=4096"], "exceeds small's block_size"),
        (bench.Config, ["--precision=fp64"], "unknown precision 'fp64'"),
    ],
)
def test_bad_input_is_one_line(cls, args, message):
    with pytest.raises(dtl_config.ConfigError, match=message) as info:
        dtl_config.load(cls, args)
    assert "\n" not in str(info.value)


def test_profile_needs_a_target_or_a_lesson():
    from day27_profiling.profile import Config

    with pytest.raises(dtl_config.ConfigError, match="either --target"):
        dtl_config.load(Config, [])
    with pytest.raises(dtl_config.ConfigError, match="has no run 'nope'"):
        wrapped_line(20, "nope", "t", 2)


def test_profiler_records_cuda_only_for_a_gpu_run(monkeypatch):
    from day27_profiling import profile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("DTL_BACKEND", raising=False)
    assert profile.run_on_gpu()
    monkeypatch.setenv("DTL_BACKEND", "gloo")
    assert not profile.run_on_gpu()
    assert isinstance(profile.nvtx_context(True), contextlib.nullcontext)
