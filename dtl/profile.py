"""Where a step's time goes: honest timers, collectives found in traces, a StepTimes record.

Timers. On a CPU, `time.perf_counter()` around a region measures it. On a GPU it measures only
the *launch*: kernels run asynchronously, so the host returns long before the work is done. The
`Timer` below records CUDA events on the current stream instead (read once, after a synchronize)
and falls back to the host clock on a CPU, so the same lesson code is right on both.

Traces. `torch.profiler` writes one chrome trace per rank (`traces/rank<R>.json`). A collective
appears twice in it:
    call   `c10d::allreduce_`, `c10d::_allgather_base_`, `c10d::send` ... on the calling thread:
           what the program asked for (for an async_op it returns at once);
    work   `gloo:all_reduce` (gloo's worker thread) / `nccl:all_reduce` annotations and the
           `ncclDevKernel_AllReduce_...` GPU kernels: what the backend actually ran, and when.
They need not match one for one: gloo runs `reduce_scatter_tensor` as an all_reduce (its trace
shows `c10d::_reduce_scatter_base_` then `gloo:all_reduce`), a lesson in itself.
`parse_trace` turns a trace into `Span`s with a `kind` (all_reduce, all_gather, reduce_scatter,
all_to_all, broadcast, reduce, send, recv, barrier; None for compute) and a `phase`.

Named ranges. `range("forward")` marks a region by name for every profiler at once: a
`record_function` range in a torch.profiler trace (only while a profiler records: ~0.1 us
otherwise) and, where CUDA is, an NVTX range that Nsight Systems draws over the kernels the
region launched. The lessons mark their steps with the names below, so one name finds the same
region in a CPU trace, in an Nsight Systems report and in day 27's analysis:
    step                        one optimizer step of the training loop
    forward, backward           the model's forward (with the loss) and backward
    optimizer.step              the optimizer's update
    <collective> <what>         a hand-written collective: `all_reduce bucket 3` (day 17),
                                `reduce_scatter bucket 1`, `all_gather unit 2` (day 18),
                                `all_reduce tied embedding` (day 20); `wait <collective> ...`
                                where the program blocks on an async one
    F3, B3, I3, W3 (F3.1)       a pipeline action: forward, backward, input-grad, weight-grad of
                                micro-batch 3 (on model chunk 1), day 20's schedule names
    send F3, recv B3            the p2p message an action posts or waits for (day 20)
    capture                     the step day 27's profile.py hands to Nsight Systems
Names are stable: tests and day 27's analysis look them up.

StepTimes. One step's breakdown; `dtl.metrics.StepLogger.log(step, times=...)` writes it to
TensorBoard under `time/...` so every day's timings land beside loss and throughput.
"""

from __future__ import annotations

import functools
import json
import os
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import ContextDecorator, contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Self

import torch

# --- timers ----------------------------------------------------------------------------------


class Timer:
    """Named, accumulating region timer: host clock on a CPU, CUDA events on a GPU.

    timer = Timer(device)
    with timer("forward"):
        ...
    timer.ms()  # {"forward": 12.3}  (sums repeated regions, e.g. micro-steps)
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host: dict[str, float] = defaultdict(float)
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events[name].append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._host[name] += time.perf_counter() - t0

    def ms(self) -> dict[str, float]:
        """Milliseconds per region name (synchronizes the GPU once)."""
        if self.cuda and self._events:
            torch.cuda.synchronize(self.device)
        out = {k: v * 1e3 for k, v in self._host.items()}
        for name, pairs in self._events.items():
            out[name] = out.get(name, 0.0) + sum(s.elapsed_time(e) for s, e in pairs)
        return out

    def reset(self) -> None:
        self._host.clear()
        self._events.clear()


# --- one step's breakdown --------------------------------------------------------------------


@dataclass
class StepTimes:
    """One training step in milliseconds.

    step = forward + backward compute + blocked + remainder, where `blocked` is time the training
    thread waited on communication that compute did not hide, and the remainder is everything
    else: the optimizer step, zero_grad, data movement, Python. `comm_ms` is the span from the
    first collective's launch to the last one's end; `overlap` the share of it hidden by compute.
    """

    step_ms: float
    forward_ms: float = 0.0
    backward_ms: float = 0.0  # backward compute, without the blocked time
    blocked_ms: float = 0.0
    comm_ms: float | None = None
    overlap: float | None = None

    @property
    def remainder_ms(self) -> float:
        """The step minus what was measured: "optimizer + rest" (never negative)."""
        return max(0.0, self.step_ms - self.forward_ms - self.backward_ms - self.blocked_ms)

    @classmethod
    def median(cls, steps: list[StepTimes]) -> StepTimes:
        """Field by field median over several steps (a field missing in any step stays None)."""
        out: dict[str, Any] = {}
        for f in fields(cls):
            values = [getattr(t, f.name) for t in steps]
            out[f.name] = None if None in values else statistics.median(values)
        return cls(**out)

    def scalars(self, prefix: str = "time/") -> dict[str, float]:
        values = {k: v for k, v in asdict(self).items() if v is not None}
        values["optimizer_and_rest_ms"] = self.remainder_ms
        return {prefix + k: float(v) for k, v in values.items()}


def overlap_fraction(comm_span_ms: float, blocked_ms: float) -> float:
    """(comm span - blocked) / comm span: 0 when every byte was waited for, 1 when all hidden."""
    if comm_span_ms <= 0:
        return 0.0
    return min(1.0, max(0.0, (comm_span_ms - blocked_ms) / comm_span_ms))


@contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Silence what C++ writes to stderr (fd 2) inside the block: torch.profiler's start and
    stop each print a `USDT: ... profiler_start/stop` line from libkineto on every rank, which
    lands in the middle of a lesson's step log. Python's own sys.stderr is left alone."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


# --- named ranges ----------------------------------------------------------------------------

STEP, FORWARD, BACKWARD, OPTIMIZER = "step", "forward", "backward", "optimizer.step"
CAPTURE = "capture"  # day 27: the one step handed to Nsight Systems (cudaProfilerStart/Stop)
# fn(entering: bool), called around every `step` range (watch_steps)
_STEP_WATCHERS: list[Callable[[bool], object]] = []


def watch_steps(fn: Callable[[bool], object]) -> Callable[[], None]:
    """Call fn(True) as each `step` range opens (before its own range starts) and fn(False) as
    it closes (after its range ends): day 27 starts and stops Nsight Systems there, so the
    capture is exactly the lesson's step. Returns the function that stops watching."""
    _STEP_WATCHERS.append(fn)
    return lambda: _STEP_WATCHERS.remove(fn)


def comm_name(kind: str, what: str = "", wait: bool = False) -> str:
    """The range name of a hand-written collective: `all_reduce bucket 3`, `wait all_gather`."""
    return " ".join(w for w in ("wait" if wait else "", kind, what) if w)


@functools.cache
def nvtx_enabled() -> bool:
    """NVTX ranges where CUDA is (DTL_NVTX=0 or 1 overrides). A CPU build of torch has no NVTX
    (its torch.cuda.nvtx calls raise); on a GPU build with no tool attached a range costs ~1 us."""
    forced = os.environ.get("DTL_NVTX")
    if forced is not None:
        return forced not in ("", "0")
    return torch.cuda.is_available()


class range(ContextDecorator):  # shadows the builtin here, on purpose: read dtl.profile.range
    """A named region for every profiler: `with profile.range("forward"): ...`, or
    `@profile.range("optimizer.step")` on a function.

    record_function only while a torch profiler records (checked on entry: a profiler that starts
    inside the region misses it), NVTX push/pop where `nvtx_enabled()`. Re-entrant: each entry
    pushes its record on a stack; as a decorator each call gets a fresh range."""

    def __init__(self, name: str):
        self.name = name
        self._open: list[torch.profiler.record_function | None] = []

    def _recreate_cm(self) -> Self:
        # ContextDecorator: one range per decorated call (threads, recursion)
        return type(self)(self.name)

    def __enter__(self) -> Self:
        if self.name == STEP:
            for fn in list(_STEP_WATCHERS):
                fn(True)
        record = None
        if torch.autograd._profiler_enabled():
            record = torch.profiler.record_function(self.name)
            record.__enter__()
        if nvtx_enabled():
            torch.cuda.nvtx.range_push(self.name)
        self._open.append(record)
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        record = self._open.pop()
        if nvtx_enabled():
            torch.cuda.nvtx.range_pop()
        if record is not None:
            record.__exit__(*exc)
        if self.name == STEP:
            for fn in list(_STEP_WATCHERS):
                fn(False)
        return False


# --- traces ----------------------------------------------------------------------------------

# the collective a trace event name stands for; checked in order, first match wins
_KIND_PATTERNS = [
    ("reduce_scatter", r"reduce_?scatter"),
    ("all_reduce", r"all_?reduce"),
    ("all_gather", r"all_?gather"),
    ("all_to_all", r"all_?to_?all"),
    ("broadcast", r"broadcast"),
    ("barrier", r"barrier"),
    ("send/recv", r"sendrecv"),
    ("send", r"send"),
    ("recv", r"recv"),
    ("reduce", r"reduce"),
]
_CALL = re.compile(r"^c10d::")
_WORK = re.compile(r"^(gloo|nccl):|^nccl(Dev)?Kernel_", re.I)
_NCCL_KERNEL = re.compile(r"^(void\s+)?nccl(Dev)?Kernel", re.I)


def is_nccl_kernel(name: str) -> bool:
    """A GPU kernel that NCCL launched (ncclKernel_..., ncclDevKernel_...): communication."""
    return bool(_NCCL_KERNEL.match(name))


def comm_kind(name: str) -> tuple[str | None, str | None]:
    """(kind, phase) of a trace event name; (None, None) when it is not communication."""
    phase = "call" if _CALL.search(name) else "work" if _WORK.search(name) else None
    if phase is None:
        return None, None
    low = name.lower()
    kind = next((k for k, pattern in _KIND_PATTERNS if re.search(pattern, low)), None)
    return (kind, phase) if kind else (None, None)


@dataclass(frozen=True)
class Span:
    name: str
    start_ms: float  # from the trace's first complete event
    end_ms: float
    tid: object
    kind: str | None = None  # the collective, None for compute
    phase: str | None = None  # "call" or "work" for collectives

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


def parse_trace(path: str) -> list[Span]:
    """Every complete ("X") event of a chrome trace as a Span, sorted by start time."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    if not events:
        return []
    t0 = min(e["ts"] for e in events)
    spans = []
    for e in events:
        kind, phase = comm_kind(e["name"])
        start = (e["ts"] - t0) / 1e3
        spans.append(Span(e["name"], start, start + e["dur"] / 1e3, e.get("tid"), kind, phase))
    return sorted(spans, key=lambda s: s.start_ms)


# Kineto's categories: what ran on the GPU (kernels, copies, and every record_function range
# repeated over the kernels it queued), and the host calls (cudaLaunchKernel, cuLaunchKernel)
# whose "correlation" id names the kernel they launched
KERNEL_CATEGORY = "kernel"
DEVICE_CATEGORIES = (KERNEL_CATEGORY, "gpu_user_annotation", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver", "runtime")


def gpu_side(
    path: str,
) -> tuple[list[tuple[float, float, str, float | None]], set[tuple[str, float]]]:
    """A chrome trace's GPU side, on the clock of parse_trace (ms, 0 = the trace's first
    complete event): every kernel as (start, end, name, launch), launch = when the host called
    cudaLaunchKernel for it (None when the trace has no such call); and (name, start) of every
    event that ran on the GPU, to tell them from the host's. Both empty for a CPU-only trace."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    if not events:
        return [], set()
    t0: float = min(e["ts"] for e in events)  # parse_trace's origin: one clock for both

    def ms(ts: float) -> float:
        return (ts - t0) / 1e3

    launched, kernels, device = {}, [], set()
    for e in events:
        cat, args = str(e.get("cat", "")).lower(), e.get("args") or {}
        if cat in LAUNCH_CATEGORIES and "correlation" in args:
            launched[args["correlation"]] = ms(e["ts"])
        if cat in DEVICE_CATEGORIES:
            device.add((e["name"], ms(e["ts"])))
        if cat == KERNEL_CATEGORY:
            kernels.append((e, args.get("correlation")))
    spans = [(ms(e["ts"]), ms(e["ts"] + e["dur"]), e["name"], launched.get(c)) for e, c in kernels]
    return spans, device


def comm_spans(spans: list[Span], phase: str = "work", kind: str | None = None) -> list[Span]:
    return [s for s in spans if s.phase == phase and (kind is None or s.kind == kind)]


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of (start, end) intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def busy_ms(intervals: Iterable[tuple[float, float]]) -> float:
    """Time covered by at least one interval."""
    return sum(e - s for s, e in merge(intervals))


def hidden_fraction(
    comm: Iterable[tuple[float, float]], compute: Iterable[tuple[float, float]]
) -> float:
    """Share of the communication busy time that falls inside compute intervals."""
    comm, compute = merge(comm), merge(compute)
    total = sum(e - s for s, e in comm)
    if not total:
        return 0.0
    hidden = sum(max(0.0, min(ce, we) - max(cs, ws)) for ws, we in comm for cs, ce in compute)
    return hidden / total
