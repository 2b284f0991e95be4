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

StepTimes. One step's breakdown; `dtl.metrics.StepLogger.log(step, times=...)` writes it to
TensorBoard under `time/...` so every day's timings land beside loss and throughput.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

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
        self._events: dict[str, list] = defaultdict(list)

    @contextmanager
    def __call__(self, name: str):
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
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
        out = {}
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
def quiet_native_stderr():
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


def comm_spans(spans: list[Span], phase: str = "work", kind: str | None = None) -> list[Span]:
    return [s for s in spans if s.phase == phase and (kind is None or s.kind == kind)]


def merge(intervals) -> list[tuple[float, float]]:
    """Union of (start, end) intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def busy_ms(intervals) -> float:
    """Time covered by at least one interval."""
    return sum(e - s for s, e in merge(intervals))


def hidden_fraction(comm, compute) -> float:
    """Share of the communication busy time that falls inside compute intervals."""
    comm, compute = merge(comm), merge(compute)
    total = sum(e - s for s, e in comm)
    if not total:
        return 0.0
    hidden = sum(max(0.0, min(ce, we) - max(cs, ws)) for ws, we in comm for cs, ce in compute)
    return hidden / total
