"""Day 27: one rank's traced step, cut into compute, communication (hidden or exposed) and idle.

From a torch.profiler chrome trace (profile.py writes one per rank), inside the step's
`ProfilerStep#N` range:

    compute    host ops (aten::…, autograd::…) on the threads that run the model, minus the time
               they spend inside a collective's call (c10d::…: a blocking wait is not compute)
    comm       what the backend ran: gloo:… spans on gloo's threads (nccl kernels on a GPU)
    hidden     comm ∩ compute: communication the model did not wait for (overlap)
    exposed    comm − compute: communication the step waited for
    idle       the rest of the step: neither computing nor communicating (a pipeline bubble, a
               rank waiting for a slower one, Python between ops)

so that step = compute + exposed + idle. "Communication exposed" is the figure to shrink: what
overlap buys is moving comm from exposed to hidden.

On a GPU (a trace with CUDA kernels) host ranges time launches, not work, so the same cut is made
on the device's clock instead (`device_cut`): the step's kernels are those the host launched
inside `ProfilerStep#N` (cudaLaunchKernel's correlation id names its kernel); compute = the non-
NCCL kernels, comm = the NCCL kernels (ncclDevKernel_...), and the window runs from the step's
start to the end of its last kernel. nsys_sqlite.py makes the same cut (`cut`) from an Nsight
Systems report.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtl.exercise_seam import exercise
from dtl.profile import Span, gpu_side, is_nccl_kernel, merge, parse_trace

Intervals = list[tuple[float, float]]


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """The time covered by both (inputs: any intervals; output: merged)."""
    a, b, out = merge(a), merge(b), []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The time covered by a and not by b."""
    out = []
    b = merge(b)
    for lo, hi in merge(a):
        start = lo
        for blo, bhi in b:
            if bhi <= start or blo >= hi:
                continue
            if blo > start:
                out.append((start, blo))
            start = max(start, bhi)
        if start < hi:
            out.append((start, hi))
    return out


def total(intervals: Intervals) -> float:
    return sum(e - s for s, e in merge(intervals))


@dataclass
class Breakdown:
    step_ms: float
    compute_ms: float
    hidden_ms: float
    exposed_ms: float
    idle_ms: float
    lanes: dict  # name -> intervals, relative to the step's start (for the timeline)
    clock: str = "host"  # "host": host ranges (a CPU run); "device": GPU kernels

    @property
    def comm_ms(self) -> float:
        return self.hidden_ms + self.exposed_ms

    @property
    def not_computing(self) -> float:
        """Share of the step spent not computing (waiting on comm or idle)."""
        return 1 - self.compute_ms / self.step_ms

    @property
    def hidden_share(self) -> float:
        return self.hidden_ms / self.comm_ms if self.comm_ms else 0.0

    def line(self) -> str:
        f = self.step_ms / 100
        clock = " (device clock: kernels)" if self.clock == "device" else ""
        return (
            f"step {self.step_ms:.1f} ms{clock}: compute {self.compute_ms / f:.0f}%, comm exposed "
            f"{self.exposed_ms / f:.0f}%, idle {self.idle_ms / f:.0f}%; comm hidden "
            f"{self.hidden_ms:.1f} of {self.comm_ms:.1f} ms ({self.hidden_share:.0%})"
        )


def _step_window(spans: list[Span]) -> tuple[float, float]:
    steps = [s for s in spans if s.name.startswith("ProfilerStep")]
    if steps:
        return steps[0].start_ms, steps[0].end_ms
    return min(s.start_ms for s in spans), max(s.end_ms for s in spans)


@exercise("day27.trace_cut")
def cut(window: tuple[float, float], compute: Intervals, comm: Intervals, clock="host"):
    """The step [lo, hi] cut into compute, comm hidden (comm ∩ compute), comm exposed (comm −
    compute) and idle (neither): one definition for host ranges, kernels and Nsight reports."""
    lo, hi = window
    clip = [(lo, hi)]
    # compute and comm may run past the window (a kernel still going when it ends): only the
    # step's part counts. Then four lists of intervals, with intersect, subtract (and `+`, a
    # union once merged): compute, hidden, exposed, idle, so that
    # step = compute + exposed + idle and comm = hidden + exposed
    # exercise day27.trace_cut: begin
    compute, comm = intersect(compute, clip), intersect(comm, clip)
    hidden = intersect(comm, compute)
    exposed = subtract(comm, compute)
    idle = subtract(clip, compute + comm)
    # exercise day27.trace_cut: end
    rel = {
        name: [(s - lo, e - lo) for s, e in merge(v)]
        for name, v in dict(compute=compute, hidden=hidden, exposed=exposed, idle=idle).items()
    }
    parts = total(compute), total(hidden), total(exposed), total(idle)
    return Breakdown(hi - lo, *parts, rel, clock)


def breakdown(path: str) -> Breakdown:
    """One rank's traced step: on the device's clock when the trace has CUDA kernels, else from
    host ranges (a CPU run)."""
    kernels, on_gpu = gpu_side(path)
    # host spans only: a CUDA trace repeats ProfilerStep#N and every range on the GPU's lanes
    spans = [s for s in parse_trace(path) if (s.name, s.start_ms) not in on_gpu]
    lo, hi = _step_window(spans)
    if kernels:
        return device_cut(kernels, lo, hi)
    inside = [s for s in spans if s.start_ms < hi and s.end_ms > lo]
    # the threads that run the model: the ones with aten ops (gloo's worker threads have none;
    # gloo's p2p work, though, is recorded on the calling thread, from post to completion)
    model_threads = {s.tid for s in inside if s.name.startswith("aten::")}
    comm = [(s.start_ms, s.end_ms) for s in inside if s.phase == "work"]
    calls = [(s.start_ms, s.end_ms) for s in inside if s.phase == "call"]
    ops = [
        (s.start_ms, s.end_ms)
        for s in inside
        if s.tid in model_threads
        and s.phase is None
        and s.name.startswith(("aten::", "autograd::"))
    ]
    return cut((lo, hi), subtract(ops, calls), comm)


def device_cut(kernels: list, lo: float, hi: float) -> Breakdown:
    """The step's kernels on the GPU's clock: those launched inside the host window [lo, hi]
    (a kernel with no launch in the trace: by its own start). NCCL kernels are comm, every other
    kernel compute; the window ends when the step's last kernel does (the device runs behind)."""
    mine = [
        (start, end, name)
        for start, end, name, launch in kernels
        if lo <= (start if launch is None else launch) <= hi
    ]
    end = max([hi, *(e for _, e, _ in mine)])
    comm = [(s, e) for s, e, name in mine if is_nccl_kernel(name)]
    compute = [(s, e) for s, e, name in mine if not is_nccl_kernel(name)]
    return cut((lo, end), compute, comm, clock="device")


def plot(breakdowns: dict[str, Breakdown], path: str, title: str) -> None:
    """One lane group per trace (rank or run): compute, comm hidden, comm exposed, idle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(compute="tab:blue", hidden="tab:green", exposed="tab:red", idle="lightgray")
    fig, ax = plt.subplots(figsize=(12, 0.9 + 0.7 * len(breakdowns)))
    labels = []
    for y, (name, b) in enumerate(reversed(list(breakdowns.items()))):
        for kind, spans in b.lanes.items():
            ax.broken_barh(
                [(s, max(e - s, 0.02)) for s, e in spans],
                (y - 0.35, 0.7),
                color=colors[kind],
                label=kind if y == 0 else None,
            )
        labels.append(name)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.set_xlabel("ms from the start of the traced step")
    ax.set_title(title)
    ax.legend(loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
