"""Day 27: FLOP conventions against published figures and FlopCounterMode; the ceiling's
weighting; the trace breakdown on a hand-made trace, on a hand-made CUDA trace (the device's
clock) and on real CPU traces of days 17 and 20; the lessons' named ranges in CPU traces of days
17, 18 and 20; Nsight Systems: the capture line's flags, the capture window, and the SQLite
reader on a database built with the documented schema (no GPU here: none of it ran under nsys).
"""

import argparse
import json
import shlex
import sqlite3
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from day27_profiling import bench, ceiling, mfu, nsys, nsys_sqlite, trace_analysis
from day27_profiling import profile as wrapper
from day27_profiling.profile import trace_path, wrapped_line
from dtl import config as dtl_config
from dtl import profile as dtl_profile
from dtl.model import GPT, flops_per_token, preset


def test_flops_per_token_equal_the_published_figures_for_gpt2_124m():
    checks = {row["source"]: row for row in mfu.published_checks()}
    nano = checks["karpathy/nanoGPT model.py estimate_mfu"]
    llmc = checks["karpathy/llm.c train_gpt2.cu"]
    assert nano["ours"] == 855_166_464  # 6 x 123,653,376 + 12 x 12 x 12 x 64 x 1024
    assert llmc["ours"] == 803_478_528  # 6 x 124,475,904 + 6 x 12 x 768 x 1024
    for row in checks.values():
        if row["published"] < 1:  # MFU figures derived from published step times
            assert row["ours"] == pytest.approx(row["published"], abs=0.01), row["what"]


@pytest.mark.parametrize("name, tied", [("tiny", True), ("small", False), ("gpt2-124m", True)])
def test_palm_and_causal_count_n_as_the_kit_does_so_every_days_mfu_agrees(name, tied):
    """Day 27's 6N + attention is dtl.model.flops_per_token, the count days 22, 23 and 28 plan
    and report with: the same N (no wpe; an untied wte left out), the same attention term."""
    cfg = preset(name, tie_weights=tied)
    for seq in (32, cfg.block_size):
        assert mfu.flops_per_token(cfg, seq, "palm") == flops_per_token(cfg, seq)
        want = flops_per_token(cfg, seq, causal_halved=True)
        assert mfu.flops_per_token(cfg, seq, "causal") == want


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
    # smoke run profiles pp_1f1b and must print "within 2% yes" (tests/test_lessons.py)
    out = {}
    for name in ("ddp_naive", "ddp_bucket"):
        output, trace_dir = bench.profile_run(name, str(tmp_path))
        ranks = [trace_analysis.breakdown(trace_path(trace_dir, r)) for r in (0, 1)]
        out[name] = (output, ranks)
    naive = out["ddp_naive"][1]
    bucket = out["ddp_bucket"][1]
    for name in out:  # day 17's named ranges, by name, in both ranks' traces
        assert not bench.missing_ranges(name, f"{tmp_path}/traces/{name}"), name
    assert all(b.comm_ms > 0 for b in naive + bucket)
    assert all(b.hidden_share < 0.02 for b in naive), [b.line() for b in naive]
    hidden = sum(b.hidden_ms for b in bucket) / sum(b.comm_ms for b in bucket)
    assert hidden > 0.05, [b.line() for b in bucket]


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
    # Nsight Systems' mode records CUDA work: a gloo run is refused in one line, before any run
    with pytest.raises(dtl_config.ConfigError, match="profiler nsys captures CUDA work") as info:
        dtl_config.load(profile.Config, ["--target=day17_ddp.train", "--profiler=nsys"])
    assert "\n" not in str(info.value)
    monkeypatch.setenv(profile.NSYS_SESSION, "1")  # under nsys, auto takes the nsys mode
    monkeypatch.delenv("DTL_BACKEND")
    assert dtl_config.load(profile.Config, ["--target=day17_ddp.train"]).profiler == "nsys"


# --- the device's clock: a CUDA trace cut by its kernels ---------------------------------------


def _k(name, ts_us, dur_us, correlation, tid=7):
    return dict(ph="X", name=name, ts=ts_us, dur=dur_us, pid=0, tid=tid, cat="kernel",
                args=dict(correlation=correlation))  # fmt: skip


def _launch(ts_us, correlation):
    return dict(ph="X", name="cudaLaunchKernel", ts=ts_us, dur=5, pid=1, tid=1,
                cat="cuda_runtime", args=dict(correlation=correlation))  # fmt: skip


def test_on_a_cuda_trace_the_cut_reads_kernels_on_the_device_clock_not_host_ranges(tmp_path):
    # host: the step 0-100 ms, its ops only launch. Device: compute 5-45 and 60-110 ms (the last
    # kernel ends after the host left the step: the device runs behind), NCCL 35-55 ms; one
    # kernel launched before the step and one after it belong to other steps
    events = [
        _event("ProfilerStep#2", 0, 100_000, 1),
        _event("aten::mm", 0, 99_000, 1),  # host time: 99% "compute" if it were read
        _launch(-5_000, 1), _k("ampere_sgemm_128x64_nn", -4_000, 4_000, 1),
        _launch(2_000, 2), _k("ampere_sgemm_128x64_nn", 5_000, 40_000, 2),
        _launch(30_000, 3), _k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 35_000, 20_000, 3,
                                tid=20),
        _launch(50_000, 4), _k("vectorized_elementwise_kernel", 60_000, 50_000, 4),
        _launch(105_000, 5), _k("vectorized_elementwise_kernel", 111_000, 1_000, 5),
        # the trace repeats the step's range on the GPU's lane: not the host window
        dict(ph="X", name="ProfilerStep#2", ts=4_000, dur=106_000, pid=0, tid=7,
             cat="gpu_user_annotation"),
    ]  # fmt: skip
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    b = trace_analysis.breakdown(str(path))
    assert b.clock == "device" and "(device clock: kernels)" in b.line()
    # window 0-110; compute 5-45, 60-110 = 90; comm 35-55: 10 hidden, 10 exposed; idle 0-5, 55-60
    assert (b.step_ms, b.compute_ms, b.hidden_ms, b.exposed_ms, b.idle_ms) == pytest.approx(
        (110, 90, 10, 10, 10)
    )
    assert b.step_ms == pytest.approx(b.compute_ms + b.exposed_ms + b.idle_ms)


# --- the lessons' named ranges in CPU traces -----------------------------------------------------


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process (no spawn): the lessons' own code, run and traced."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _traced_names(tmp_path, name, fn) -> set[str]:
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    path = tmp_path / f"{name}.json"
    prof.export_chrome_trace(str(path))
    return {s.name for s in dtl_profile.parse_trace(str(path))}


def test_the_lessons_named_ranges_appear_by_name_in_cpu_traces_of_days_17_18_and_20(
    one_rank, tmp_path
):
    """One rank, each lesson's own step code under torch.profiler: its ranges by name. The two-
    rank traces (bench --part=traces: day 17's syncs, day 20's 1F1B with its sends and receives)
    are checked by test_real_cpu_traces_... and the registered `traces` line."""
    from day17_ddp import train as day17
    from day18_zero import engines
    from day20_pp import schedules
    from day20_pp.pipeline import PipelineRunner, build_stages
    from dtl.grid import ParallelGrid
    from dtl.optim import OptimConfig

    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
    cfg17 = day17.Config(sync="bucket", model="tiny", seq_len=16, steps=2, profile_step=-1)
    _, model, opt = day17.build(cfg17, one_rank)
    names = _traced_names(tmp_path, "day17", lambda: [
        day17.train_step(model, opt, tokens, cfg17, s, one_rank) for s in range(2)
    ])  # fmt: skip
    want = ["step", "forward", "backward", "optimizer.step", "all_reduce bucket 0",
            "wait all_reduce", "broadcast bucket order"]  # fmt: skip
    assert set(want) <= names, set(want) - names

    x = tokens[:64].view(4, 16)
    batches = [(x[:2], x[:2]), (x[2:], x[2:])]
    for stage, want in (
        (2, ["reduce_scatter bucket 0", "wait reduce_scatter bucket 0", "all_gather bucket 0"]),
        (3, ["all_gather unit 0", "wait all_gather unit 0", "reduce_scatter unit 1",
             "all_gather root"]),
    ):  # fmt: skip
        trainer = engines.build("hand", stage, GPT(preset("tiny-nobias"), seed=0), None,
                                OptimConfig(lr=1e-3), no_sync=True, bucket_cap_mb=0.02)  # fmt: skip
        names = _traced_names(tmp_path, f"day18-{stage}", lambda t=trainer: t.step(batches))
        want = ["step", "forward", "backward", "optimizer.step", *want]
        assert set(want) <= names, (stage, set(want) - names)

    grid = ParallelGrid(pp=1)
    plan = schedules.make("1f1b", 1, 2, 1)
    stages = build_stages(preset("tiny"), grid, plan.placement)
    runner = PipelineRunner(stages, grid, preset("tiny"), (2, 16), placement=plan.placement)
    actions = plan[0]
    names = _traced_names(tmp_path, "day20", lambda: runner.step(actions, batches))
    assert {"F0", "F1", "B0", "B1", "wait send"} <= names  # one stage: no messages


# --- Nsight Systems ------------------------------------------------------------------------------


def _nsys_profile_parser() -> argparse.ArgumentParser:
    """The `nsys profile` switches the capture uses, as the Nsight Systems User Guide spells
    them (long form, `=value`); any other switch is an error."""
    p = argparse.ArgumentParser(prog="nsys profile", add_help=False, allow_abbrev=False,
                                exit_on_error=False)  # fmt: skip
    p.add_argument("-t", "--trace", required=True)
    p.add_argument("-c", "--capture-range", choices=["none", "cudaProfilerApi", "hotkey", "nvtx"])
    p.add_argument("--capture-range-end")
    p.add_argument("-f", "--force-overwrite", choices=["true", "false"])
    p.add_argument("-o", "--output", required=True)
    return p


def test_the_nsys_capture_line_is_the_registered_gpu_line_one_report_per_rank():
    cfg = nsys.Config()
    line = nsys.capture_line(cfg)
    words = shlex.split(" ".join(shlex.quote(w) for w in line))  # it survives the shell
    assert words == line
    n, py = words.index("nsys"), words.index("python")
    # torchrun as registered for day 17's GPU line, each rank's program being nsys itself
    assert words[:n] == ["torchrun", "--standalone", "--nproc_per_node=gpu", "--no-python"]
    assert words[n + 1] == "profile"
    flags = _nsys_profile_parser().parse_args(words[n + 2 : py])
    assert set(flags.trace.split(",")) == {"cuda", "nvtx", "osrt"}
    # the capture is profile.py's cudaProfilerStart/Stop around the lesson's `step` range
    assert (flags.capture_range, flags.capture_range_end) == ("cudaProfilerApi", "stop")
    assert flags.force_overwrite == "true"
    assert flags.output == "outputs/day27_profiling/nsys/rank%q{RANK}"  # nsys puts RANK in it
    program = words[py:]
    assert program[:3] == ["python", "-m", "day27_profiling.profile"]
    wrapper_args = program[3 : program.index("--")]
    assert "--target=day17_ddp.train" in wrapper_args and "--profiler=nsys" in wrapper_args
    lesson_args = program[program.index("--") + 1 :]
    assert lesson_args == ["--sync=bucket", "--config", "day17_ddp/gpu.toml",
                           "--profile_step=-1"]  # fmt: skip
    export = nsys.export_line(cfg, "out/rank0.nsys-rep")
    assert export == ["nsys", "export", "--type=sqlite", "--force-overwrite=true",
                      "--output=out/rank0.sqlite", "out/rank0.nsys-rep"]  # fmt: skip


def test_the_nsys_line_on_a_cpu_box_prints_its_commands_and_skips(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    nsys.main([])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("capture: torchrun --standalone --nproc_per_node=gpu --no-python")
    assert lines[1].startswith("export: nsys export --type=sqlite")
    assert lines[-1].startswith("skipped: Nsight Systems capture needs a GPU run and nsys")


TARGET = """
import torch
from dtl import profile as dtl_profile

model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    with dtl_profile.range(dtl_profile.STEP) if MARKED else dtl_profile.range("not a step"):
        model(torch.ones(1, 2)).sum().backward()
        with dtl_profile.range(dtl_profile.OPTIMIZER):
            opt.step()
        opt.zero_grad()
"""


@pytest.mark.parametrize("marked", [True, False], ids=["step-range", "optimizer-hook"])
def test_under_nsys_one_step_is_handed_over_and_no_torch_profiler_runs(
    marked, tmp_path, monkeypatch, capsys
):
    (tmp_path / "nsys_target.py").write_text(f"MARKED = {marked}\n" + TARGET)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the wrapper hands the target its own
    log = []

    def refuse(*args, **kwargs):
        raise AssertionError("torch.profiler under Nsight Systems")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("sync"))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: log.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: log.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_start", lambda name: log.append(name) or 7)
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", lambda h: log.append(f"end {h}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: log.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: log.append("pop"))
    monkeypatch.setattr(dtl_profile, "nvtx_enabled", lambda: True)
    cfg = wrapper.Config(target="nsys_target", active_step=2, profiler="nsys")
    wrapper.profile_module(cfg, [])
    assert log.count("start") == 1 and log.count("stop") == 1
    window = log[log.index("start") - 1 : log.index("stop") + 1]
    if marked:  # exactly the third `step` range, opened and closed inside the capture
        assert window[:4] == ["sync", "start", "capture", "push step"]
        assert window[-4:] == ["pop", "sync", "end 7", "stop"]
        assert window.count("push step") == 1 and "push optimizer.step" in window
        assert log[: log.index("start")].count("push step") == 2  # steps 0 and 1 before it
    else:  # from the end of optimizer step 2 to the end of step 3: torch.profiler's window
        assert window[:3] == ["sync", "start", "capture"]
        assert window[-3:] == ["sync", "end 7", "stop"]
        assert window.count("push optimizer.step") == 1  # opened in, closed after, the capture
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    by = "its `step` range" if marked else "optimizer steps (no `step` range)"
    assert summary == (
        f"summary: day27 nsys capture of nsys_target: step 2 by {by} between cudaProfilerStart "
        "and cudaProfilerStop, NVTX range 'capture' over it"
    )


# The tables and columns the reader uses, with the types the Nsight Systems User Guide's "SQLite
# Schema Reference" gives them (the kernel table cut to the columns up to shortName, and the
# launch configuration); a real report has more tables and columns.
SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (
    start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
    contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER,
    globalPid INTEGER, demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL,
    mangledName INTEGER, registersPerThread INTEGER NOT NULL, gridX INTEGER NOT NULL,
    gridY INTEGER NOT NULL, gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL,
    blockY INTEGER NOT NULL, blockZ INTEGER NOT NULL);
CREATE TABLE NVTX_EVENTS (
    start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER,
    category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER,
    textId INTEGER REFERENCES StringIds(id), domainId INTEGER);
"""
MS = 1_000_000  # ns
T0 = 5_000 * MS  # the report's clock does not start at 0


def _report(path, pids=(101, 202)):
    """Rank 0 (pid 101): the `capture` range 0-100 ms, its `step` range (a registered string,
    by textId) and a mark; compute kernels 0-40, 50-80 and 95-110 ms (clipped at 100), NCCL
    30-50 ms, one kernel before the window. Rank 1 (pid 202): no capture range; compute 0-10 ms,
    NCCL 10-30 ms."""
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    names = ["ampere_sgemm_128x64_nn", "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
             "void at::native::vectorized_elementwise_kernel<4>", "step"]  # fmt: skip
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", list(enumerate(names, 1)))
    gemm, nccl, elementwise, step = 1, 2, 3, 4
    r0, r1 = (pid << 24 for pid in pids)  # serialized globalPid: the pid in bits 24-47
    kernels = [
        (r0, 0, 40, gemm),
        (r0, 50, 80, elementwise),
        (r0, 95, 110, gemm),
        (r0, 30, 50, nccl),
        (r0, -20, -10, gemm),
        (r1, 0, 10, gemm),
        (r1, 10, 30, nccl),
    ]
    db.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,0,1,?,?,?,?,?,NULL,32,1,1,1,128,1,1)",
        [(T0 + s * MS, T0 + e * MS, 20 if n == nccl else 7, i, g, n, n)
         for i, (g, s, e, n) in enumerate(kernels)],
    )  # fmt: skip
    tid = r0 | 4242  # a thread of rank 0: globalTid = pid << 24 | tid
    db.executemany(
        "INSERT INTO NVTX_EVENTS (start, end, eventType, text, textId, globalTid) "
        "VALUES (?,?,?,?,?,?)",
        [(T0, T0 + 100 * MS, 60, "capture", None, tid),  # start/end range
         (T0 + MS, T0 + 99 * MS, 59, None, step, tid),  # push/pop, registered string
         (T0 + 2 * MS, T0 + 40 * MS, 59, "forward", None, tid),
         (T0 + 3 * MS, None, 34, "a mark", None, tid)],  # a mark: no end
    )  # fmt: skip
    db.commit()
    db.close()


def test_the_sqlite_reader_cuts_an_nsys_report_built_with_the_documented_schema(tmp_path):
    path = str(tmp_path / "report.sqlite")
    _report(path)
    assert nsys_sqlite.pid_of((101 << 24) | 4242) == 101
    procs = nsys_sqlite.read(path)
    assert sorted(procs) == [101, 202]
    assert {t for _, _, t in procs[101].ranges} == {"capture", "step", "forward"}  # not the mark
    cuts = nsys_sqlite.breakdowns(path)
    r0, r1 = cuts[101], cuts[202]
    # rank 0, the capture window 0-100 ms: compute 0-40, 50-80, 95-100 = 75; NCCL 30-50: 10
    # hidden under compute, 10 exposed; idle 80-95 = 15
    assert r0.clock == "device"
    assert (r0.step_ms, r0.compute_ms, r0.hidden_ms, r0.exposed_ms, r0.idle_ms) == pytest.approx(
        (100, 75, 10, 10, 15)
    )
    assert r0.not_computing == pytest.approx(0.25) and r0.hidden_share == pytest.approx(0.5)
    # rank 1, no capture range: the span of its kernels, 0-30 ms; NCCL alone 10-30
    assert (r1.step_ms, r1.compute_ms, r1.exposed_ms, r1.idle_ms) == pytest.approx((30, 10, 20, 0))
    lines = nsys_sqlite.describe(path)
    assert lines[0].startswith("pid 101: 5 kernels (1 NCCL); step 100.0 ms (device clock")


def test_the_nsys_summary_reads_the_cut_and_the_ranges_of_each_rank(tmp_path, capsys):
    path = str(tmp_path / "rank0.sqlite")
    _report(path, pids=(101, 202))
    line = nsys.read_reports("some.module", [path])  # only `capture` expected of an unknown one
    assert line.startswith("summary: day27 nsys some.module: 1 ranks, 7 kernels (2 NCCL); ")
    assert "rank 0 step 100.0 ms (device clock: kernels): compute 75%" in line
    assert line.endswith("ranges capture yes")
    assert "ranges missing" not in capsys.readouterr().out
    line = nsys.read_reports("day17_ddp.train", [path])  # day 17's: not in this fixture
    missing = "ranges missing: backward, optimizer.step, all_reduce bucket 0, wait all_reduce"
    assert line.endswith("NO") and missing in capsys.readouterr().out
