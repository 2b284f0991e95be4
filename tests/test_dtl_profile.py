"""dtl.profile: timers, StepTimes, interval arithmetic, and collectives found in real traces."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from dtl import profile as prof
from dtl.testing import run_distributed


def test_timer_accumulates_named_regions_on_the_host_clock_on_cpu():
    timer = prof.Timer("cpu")
    for _ in range(2):
        with timer("forward"):
            time.sleep(0.02)
    with timer("backward"):
        time.sleep(0.01)
    ms = timer.ms()
    assert 39 <= ms["forward"] < 80 and 9 <= ms["backward"] < 40
    timer.reset()
    assert timer.ms() == {}


def test_step_times_remainder_is_the_unmeasured_rest_and_goes_to_tensorboard_tags():
    t = prof.StepTimes(step_ms=100, forward_ms=20, backward_ms=50, blocked_ms=10, comm_ms=40)
    assert t.remainder_ms == 20  # optimizer + rest: what the step spent outside fwd/bwd/blocked
    scalars = t.scalars()
    assert scalars["time/optimizer_and_rest_ms"] == 20 and "time/overlap" not in scalars
    assert prof.StepTimes(step_ms=10, forward_ms=20).remainder_ms == 0  # never negative


@pytest.mark.parametrize(
    "span, blocked, expected",
    [(40, 40, 0.0), (40, 0, 1.0), (40, 10, 0.75), (0, 5, 0.0), (10, 30, 0.0)],
)
def test_overlap_fraction_on_synthetic_numbers(span, blocked, expected):
    # a naive sync waits for every all-reduce after backward: blocked == span -> 0% overlap
    assert prof.overlap_fraction(span, blocked) == expected


def test_interval_union_and_hidden_share():
    assert prof.merge([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert prof.busy_ms([(0, 2), (1, 3), (5, 7)]) == 5
    # comm busy 0-4 and 6-8 (6 ms); compute 0-3 and 7-10 hides 3 + 1 = 4 ms of it
    assert prof.hidden_fraction([(0, 4), (6, 8)], [(0, 3), (7, 10)]) == pytest.approx(4 / 6)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("c10d::allreduce_", ("all_reduce", "call")),
        ("c10d::_allgather_base_", ("all_gather", "call")),
        ("c10d::_reduce_scatter_base_", ("reduce_scatter", "call")),
        ("c10d::alltoall_base_", ("all_to_all", "call")),
        ("c10d::recv_", ("recv", "call")),
        ("gloo:all_reduce", ("all_reduce", "work")),
        ("gloo:send", ("send", "work")),
        ("nccl:all_reduce", ("all_reduce", "work")),
        ("nccl:_reduce_scatter_base", ("reduce_scatter", "work")),
        (
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            ("all_reduce", "work"),
        ),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", ("reduce_scatter", "work")),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", ("send/recv", "work")),
        ("ncclKernel_Broadcast_RING_LL_Sum_int8_t", ("broadcast", "work")),
        ("aten::mm", (None, None)),
        ("autograd::engine::evaluate_function: AllReduceBackward", (None, None)),
    ],
)
def test_comm_kind_names_the_collective_of_gloo_nccl_and_c10d_events(name, expected):
    assert prof.comm_kind(name) == expected


def _trace_every_collective(tmp):
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1000)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather_into_tensor(torch.empty(1000 * n), t)
        dist.reduce_scatter_tensor(torch.empty(1000 // n), t)
        dist.all_to_all_single(torch.empty(1000), t)
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))
    path = f"{tmp}/rank{rank}.json"
    p.export_chrome_trace(path)
    spans = prof.parse_trace(path)
    calls = [s.kind for s in prof.comm_spans(spans, phase="call") if s.kind != "barrier"]
    work = sorted({s.kind for s in prof.comm_spans(spans, phase="work")})
    compute = [s.name for s in spans if s.kind is None and s.name == "aten::mm"]
    return calls, work, compute, spans[0].start_ms


def test_a_real_gloo_trace_yields_every_collective_call_in_order(tmp_path):
    results = run_distributed(_trace_every_collective, str(tmp_path), world_size=2)
    for rank, (calls, work, compute, first) in enumerate(results):
        p2p = "send" if rank == 0 else "recv"
        assert calls == [
            "all_reduce",
            "broadcast",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            p2p,
        ]
        # gloo's worker runs reduce_scatter_tensor as an all_reduce: no reduce_scatter work span
        assert {"all_reduce", "all_gather", "all_to_all", "broadcast", p2p} <= set(work)
        assert compute == ["aten::mm"] and first == 0.0


def test_quiet_native_stderr_silences_fd_2_only_inside_the_block(capfd):
    import os

    from dtl.profile import quiet_native_stderr

    with quiet_native_stderr():
        os.write(2, b"USDT: profiler_start\n")  # what C++ code writes
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "after" in err


# --- named ranges ------------------------------------------------------------------------------


def test_a_named_range_is_a_record_function_in_a_cpu_trace_and_a_decorator_too(tmp_path):
    @prof.range(prof.OPTIMIZER)
    def update():
        torch.ones(4).add_(1)

    with profile(activities=[ProfilerActivity.CPU]) as p:
        with prof.range(prof.FORWARD):
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        update()
        update()  # a fresh range per call
    path = tmp_path / "trace.json"
    p.export_chrome_trace(str(path))
    spans = prof.parse_trace(str(path))
    forward = [s for s in spans if s.name == prof.FORWARD]
    assert len(forward) == 1 and [s.name for s in spans].count(prof.OPTIMIZER) == 2
    mm = next(s for s in spans if s.name == "aten::mm")  # the op lies inside its range
    assert forward[0].start_ms <= mm.start_ms and mm.end_ms <= forward[0].end_ms


def test_a_named_range_enters_no_record_function_without_a_profiler(monkeypatch):
    """Without a profiler a range is a flag check (~0.5 us here): no record_function made."""

    def refuse(name):
        raise AssertionError(f"record_function({name!r}) without a profiler")

    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    with prof.range(prof.STEP):
        pass


def test_a_named_range_pushes_and_pops_nvtx_where_cuda_is(monkeypatch):
    calls = []
    monkeypatch.setattr(prof, "nvtx_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    with prof.range(prof.comm_name("all_reduce", "bucket 3")):
        with prof.range(prof.comm_name("all_reduce", wait=True)):
            pass
    assert calls == [
        ("push", "all_reduce bucket 3"),
        ("push", "wait all_reduce"),
        ("pop",),
        ("pop",),
    ]


def test_nvtx_follows_cuda_and_dtl_nvtx_overrides(monkeypatch):
    for forced, want in (("0", False), ("1", True)):
        monkeypatch.setenv("DTL_NVTX", forced)
        prof.nvtx_enabled.cache_clear()
        assert prof.nvtx_enabled() is want
    monkeypatch.delenv("DTL_NVTX")
    prof.nvtx_enabled.cache_clear()
    assert prof.nvtx_enabled() is torch.cuda.is_available()  # a CPU build: no NVTX, no error
    with prof.range(prof.STEP):
        pass


def test_step_watchers_see_every_step_range_open_and_close_outside_it():
    seen = []
    stop = prof.watch_steps(lambda entering: seen.append(("watch", entering)))
    try:
        with prof.range(prof.STEP):
            seen.append("body")
        with prof.range(prof.FORWARD):  # not a step: not watched
            pass
    finally:
        stop()
    with prof.range(prof.STEP):
        pass
    assert seen == [("watch", True), "body", ("watch", False)]


def test_nccl_kernels_are_told_from_compute_kernels():
    assert prof.is_nccl_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    assert prof.is_nccl_kernel("ncclKernel_Broadcast_RING_LL_Sum_int8_t")
    assert prof.is_nccl_kernel("void ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)")
    assert not prof.is_nccl_kernel("ampere_sgemm_128x64_nn")
    assert not prof.is_nccl_kernel("void at::native::vectorized_elementwise_kernel<4>")
