"""Day 17: make a data-parallel step observable: per-step timings, bucket layouts, the timeline.

Timings, the same definitions for all four sync modes (t = time.perf_counter(), seconds):
    blocked     = time the training thread waits for all-reduces after the last gradient is ready
    bwd compute = backward wall time - blocked
    comm span   = first all-reduce launch -> last all-reduce done
    overlap     = (comm span - blocked) / comm span   (the share of communication hidden by compute)
Hand-written syncs record these themselves (ddp_manual.CommStats); torch DDP's Reducer records
the same instants with its CPU timer, read back from `_get_ddp_logging_data()`.
"""

from __future__ import annotations

import json

MiB = 1024 * 1024


def sync_times(model) -> dict[str, float]:
    """(compute_end, comm_start, comm_end, blocked) of the last synced backward, in seconds."""
    if hasattr(model, "_get_ddp_logging_data"):  # torch DDP: the Reducer's CPU timer, in ns
        # DDP copies the timer into its logging data at the *next* forward; do it now instead
        model.logger.set_runtime_stats_and_log()
        log = model._get_ddp_logging_data()
        compute_end = log["backward_compute_time_end"] / 1e9
        start, end = log["backward_comm_time_start"] / 1e9, log["backward_comm_time_end"] / 1e9
        return dict(
            compute_end=compute_end,
            comm_start=start,
            comm_end=end,
            blocked=max(0.0, end - compute_end),
        )
    s = model.stats
    return dict(
        compute_end=s.compute_end,
        comm_start=min(e[0] for e in s.events),
        comm_end=max(e[1] for e in s.events),
        blocked=s.blocked_s,
    )


def step_breakdown(model, fwd_s: float, bwd_s: float) -> dict[str, float]:
    """Milliseconds: forward, backward compute, blocked on communication, comm span; overlap."""
    t = sync_times(model)
    comm = max(t["comm_end"] - t["comm_start"], 1e-9)
    blocked = min(t["blocked"], bwd_s)
    return dict(
        fwd_ms=fwd_s * 1e3,
        bwd_compute_ms=(bwd_s - blocked) * 1e3,
        blocked_ms=blocked * 1e3,
        comm_ms=comm * 1e3,
        overlap=min(1.0, max(0.0, (comm - blocked) / comm)),
    )


def bucket_layout(model, names: list[str]) -> tuple[list[int], list[list[str]]]:
    """Bytes per bucket and parameter names per bucket, in launch order (first bucket first)."""
    if hasattr(model, "_get_ddp_logging_data"):
        log = model._get_ddp_logging_data()
        if "rebuilt_bucket_sizes" not in log:  # find_unused_parameters=True: never rebuilt
            sizes = [int(s) for s in str(log["bucket_sizes"]).split(",")]
            return sizes, [["(initial layout, parameter order not logged)"] for _ in sizes]
        sizes = [int(s) for s in str(log["rebuilt_bucket_sizes"]).split(",")]
        groups = [
            [names[int(i)] for i in g.split()]
            for g in str(log["rebuilt_per_bucket_param_indices"]).split(",")
        ]
        return sizes, groups
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


def trace_spans(path: str) -> dict[str, list[tuple[float, float]]]:
    """(start, end) in ms from the trace's first event, per lane, from a chrome trace file."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    marks = {e["name"]: e for e in events if e["name"] in ("forward", "backward", "optimizer")}
    main_tid = marks["backward"]["tid"]
    t0 = min(e["ts"] for e in marks.values())
    lanes: dict[str, list] = {
        "forward": [],
        "backward compute": [],
        "grad ready": [],
        "all-reduce": [],
        "optimizer": [],
    }
    for name in ("forward", "optimizer"):
        lanes[name].append(_span(marks[name], t0))
    bwd = _span(marks["backward"], t0)
    for e in events:
        s, end = _span(e, t0)
        if e["tid"] == main_tid and e["name"].startswith("autograd::engine::evaluate_function"):
            if bwd[0] <= s <= bwd[1]:
                lanes["grad ready" if "AccumulateGrad" in e["name"] else "backward compute"].append(
                    (s, end)
                )
        elif e["name"] == "gloo:all_reduce" or "nccl:all_reduce" in e["name"]:
            lanes["all-reduce"].append((s, end))
    lanes["backward compute"] = _merge(lanes["backward compute"])
    lanes["all-reduce"].sort()
    return lanes


def _span(e: dict, t0: float) -> tuple[float, float]:
    return (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [tuple(m) for m in merged]


def trace_overlap(lanes: dict) -> tuple[float, float]:
    """From the trace: all-reduce busy ms, and the share of it inside the backward compute span."""
    if not lanes["all-reduce"]:
        return 0.0, 0.0
    compute_end = max(e for _, e in lanes["backward compute"]) if lanes["backward compute"] else 0
    busy = _merge(lanes["all-reduce"])
    total = sum(e - s for s, e in busy)
    hidden = sum(max(0.0, min(e, compute_end) - s) for s, e in busy)
    return total, hidden / total if total else 0.0


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
