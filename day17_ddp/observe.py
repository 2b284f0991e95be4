"""Day 17: make a data-parallel step observable: per-step timings, bucket layouts, the timeline.

Timings, the same definitions for all four sync modes (t = time.perf_counter(), seconds):
    blocked     = time the training thread waits for all-reduces after the last gradient is ready
    bwd compute = backward wall time - blocked
    comm span   = first all-reduce launch -> last all-reduce done
    overlap     = (comm span - blocked) / comm span   (the share of communication hidden by compute)
Hand-written syncs record these themselves (ddp_manual.CommStats); torch DDP's Reducer records
the same instants with its CPU timer, read back from `_get_ddp_logging_data()`.
On CUDA all of these are host clocks, so they time launches; the timeline below (trace_spans)
reads the GPU's own kernel times from the profiler trace instead.
"""

from __future__ import annotations

import bisect
import math

from day17_ddp import ddp_logging
from dtl import profile
from dtl.profile import StepTimes, gpu_side

MiB = 1024 * 1024
STEP_MARK = profile.STEP  # the named range around one optimizer step (dtl.profile.range)
OPT_MARK = profile.OPTIMIZER  # ... around opt.step()


def sync_times(model) -> dict[str, float]:
    """(compute_end, comm_start, comm_end, blocked) of the last synced backward, in seconds."""
    if ddp_logging.is_torch_ddp(model):  # the Reducer's own CPU timer
        t = ddp_logging.comm_times_s(model)
        return dict(t, blocked=max(0.0, t["comm_end"] - t["compute_end"]))
    s = model.stats
    return dict(
        compute_end=s.compute_end,
        comm_start=min(e[0] for e in s.events),
        comm_end=max(e[1] for e in s.events),
        blocked=s.blocked_s,
    )


def step_breakdown(model, fwd_s: float, bwd_s: float, step_s: float) -> StepTimes:
    """One step's StepTimes: forward, backward compute, blocked on communication, comm span,
    overlap; the remainder (optimizer + rest) is what the step spent outside those."""
    return breakdown_from_times(sync_times(model), fwd_s, bwd_s, step_s)


def breakdown_from_times(t: dict, fwd_s: float, bwd_s: float, step_s: float) -> StepTimes:
    comm = max(t["comm_end"] - t["comm_start"], 1e-9)
    blocked = min(t["blocked"], bwd_s)
    return StepTimes(
        step_ms=step_s * 1e3,
        forward_ms=fwd_s * 1e3,
        backward_ms=(bwd_s - blocked) * 1e3,
        blocked_ms=blocked * 1e3,
        comm_ms=comm * 1e3,
        overlap=profile.overlap_fraction(comm, blocked),
    )


def bucket_layout(model, names: list[str]) -> tuple[list[int], list[list[str]]]:
    """Bytes per bucket and parameter names per bucket, in launch order (first bucket first)."""
    if ddp_logging.is_torch_ddp(model):
        rebuilt = ddp_logging.rebuilt_buckets(model)
        if rebuilt is None:  # find_unused_parameters=True: never rebuilt
            sizes = ddp_logging.initial_bucket_sizes(model)
            return sizes, [["(initial layout, parameter order not logged)"] for _ in sizes]
        sizes, indices = rebuilt
        return sizes, [[names[i] for i in idx] for idx in indices]
    if hasattr(model, "layout"):
        return model.bucket_sizes(), [[names[i] for i in idx] for idx in model.layout]
    sizes = [p.numel() * p.element_size() for p in model.params]  # one "bucket" per tensor
    return sizes, [[n] for n in names]


def format_layout(sizes: list[int], groups: list[list[str]], limit: int = 12) -> str:
    lines = [f"{len(sizes)} buckets, {sum(sizes) / MiB:.2f} MiB in all, launch order:"]
    for b, (size, group) in enumerate(zip(sizes, groups)):
        if b == limit:
            lines.append(f"  ... {len(sizes) - limit} more")
            break
        shown = ", ".join(group[:3]) + (f", ... {group[-1]}" if len(group) > 3 else "")
        lines.append(f"  bucket {b:>2} {size / MiB:>8.3f} MiB {len(group):>3} params  {shown}")
    return "\n".join(lines)


# --- the profiler trace -> a timeline of backward compute against the all-reduces ------------

EVALUATE = "autograd::engine::evaluate_function"  # one span per backward node autograd runs
# a chrome trace's GPU side (kernels, their launches, the device's copies of the ranges):
# dtl.profile.gpu_side, shared with day 27's device-side cut


def _inside(t: float, intervals: list[tuple[float, float]]) -> bool:
    """Whether t falls in one of the sorted, disjoint intervals."""
    i = bisect.bisect_right(intervals, (t, math.inf)) - 1
    return i >= 0 and intervals[i][0] <= t <= intervals[i][1]


def trace_spans(path: str) -> dict[str, list[tuple[float, float]]]:
    """(start, end) in ms from the step's start, per lane, from a chrome trace file: the last
    step in the trace (the first profiled step pays the profiler's start-up, so it is not drawn).

    Backward compute = the `evaluate_function` spans of the backward nodes, from *any* thread of
    the process: autograd runs the nodes of CPU tensors on the thread that called backward(), and
    those of CUDA tensors on its own worker thread, one per device (where DDP's hooks and their
    all-reduce launches run too). On a CUDA trace both the backward compute and the all-reduce
    lanes are GPU kernel times: the kernels those nodes launched, and NCCL's all-reduce kernels.
    The host spans there only say when work was *queued*."""
    kernels, on_gpu = gpu_side(path)
    # host spans only: a CUDA trace repeats every record_function (step, backward ...) on
    # the GPU's lanes, spanning the kernels it queued, later than the host ran it
    spans = [s for s in profile.parse_trace(path) if (s.name, s.start_ms) not in on_gpu]
    step = max((s for s in spans if s.name == STEP_MARK), key=lambda s: s.start_ms)
    inside = [s for s in spans if step.start_ms <= s.start_ms <= step.end_ms]
    marks = {s.name: s for s in sorted(inside, key=lambda s: s.start_ms)
             if s.name in (profile.FORWARD, profile.BACKWARD, OPT_MARK)}  # fmt: skip
    # (grad_accum > 1: the last forward and backward, the ones that sync)
    t0 = step.start_ms
    lanes: dict[str, list] = {
        "forward": [],
        "backward compute": [],
        "grad ready": [],
        "all-reduce": [],
        "optimizer": [],
    }
    for lane, mark in (("forward", profile.FORWARD), ("optimizer", OPT_MARK)):
        lanes[lane].append((marks[mark].start_ms - t0, marks[mark].end_ms - t0))
    bwd = marks[profile.BACKWARD]
    host_compute = []  # when the backward nodes ran (CPU) or queued their kernels (CUDA)
    for s in inside:
        span = (s.start_ms - t0, s.end_ms - t0)
        if s.name.startswith(EVALUATE) and bwd.start_ms <= s.start_ms <= bwd.end_ms:
            # AccumulateGrad: where the grad hooks, and with them the syncs, fire
            (lanes["grad ready"] if "AccumulateGrad" in s.name else host_compute).append(span)
        elif s.kind == "all_reduce" and s.phase == "work":  # gloo:all_reduce / nccl:all_reduce
            lanes["all-reduce"].append(span)
    host_compute = profile.merge(host_compute)
    compute, all_reduces = _gpu_lanes(kernels, step.start_ms, host_compute)
    if compute:  # CUDA: what the GPU ran, and when, instead of when the host queued it
        lanes["backward compute"], lanes["all-reduce"] = compute, all_reduces
    else:  # CPU: the nodes ran where their spans are
        lanes["backward compute"] = host_compute
    lanes["all-reduce"].sort()
    return lanes


def _gpu_lanes(kernels: list, t0: float, host_compute: list) -> tuple[list, list]:
    """GPU kernels of the drawn step, in ms from its start: (backward compute kernels = those
    launched from inside a backward node, merged; NCCL all-reduce kernels). The step is the
    trace's last, so every kernel from its start on is its own, also those still running after
    the host left the step mark. Both empty on a CPU trace."""
    compute, all_reduces = [], []
    for start, end, name, launch in kernels:
        if start < t0:
            continue
        span, kind = (start - t0, end - t0), profile.comm_kind(name)[0]
        if kind == "all_reduce":
            all_reduces.append(span)
        elif kind is None and launch is not None and _inside(launch - t0, host_compute):
            compute.append(span)
    return profile.merge(compute), all_reduces


def trace_overlap(lanes: dict) -> tuple[float, float]:
    """From the trace: all-reduce busy ms, and the share of it inside the backward compute span."""
    if not lanes["all-reduce"]:
        return 0.0, 0.0
    compute = lanes["backward compute"]
    span = [(0.0, max(e for _, e in compute))] if compute else []
    return profile.busy_ms(lanes["all-reduce"]), profile.hidden_fraction(lanes["all-reduce"], span)


def plot_timeline(lanes: dict, title: str, path: str, sizes: list[int] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "forward": "tab:blue",
        "backward compute": "tab:orange",
        "grad ready": "black",
        "all-reduce": "tab:green",
        "optimizer": "tab:purple",
    }
    fig, ax = plt.subplots(figsize=(12, 3.2))
    names = list(lanes)
    for y, name in enumerate(reversed(names)):
        spans = lanes[name]
        bars = [(s, max(e - s, 0.05)) for s, e in spans]
        ax.broken_barh(
            bars,
            (y - 0.35, 0.7),
            color=colors[name],
            edgecolor="white" if name == "all-reduce" else None,
            linewidth=0.5,
        )
        if name == "all-reduce" and sizes and len(sizes) == len(spans) <= 12:
            for (s, _), b in zip(spans, sizes):
                ax.text(s, y + 0.4, f"{b / MiB:.1f} MiB", fontsize=7)
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlabel("ms since the start of forward (rank 0, from its torch.profiler trace)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
