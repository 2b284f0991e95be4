"""Day 27: an Nsight Systems report, exported to SQLite, cut into compute, comm and idle.

    nsys export --type=sqlite --output=rank0.sqlite rank0.nsys-rep
    python -m day27_profiling.nsys_sqlite outputs/day27_profiling/nsys/rank0.sqlite

The tables read, as the Nsight Systems User Guide documents them ("SQLite Schema Reference"; all
times in ns, on one timeline for host and device):

    StringIds                   id, value: every string of the report, by id
    CUPTI_ACTIVITY_KIND_KERNEL  start, end, deviceId, streamId, globalPid, shortName and
                                demangledName (ids into StringIds): one row per kernel run
    NVTX_EVENTS                 start, end, eventType, text (a plain string) or textId (a
                                registered one, into StringIds), globalTid: NVTX marks and ranges
                                (eventType 59: push/pop, 60: start/end, 34: a mark, no end)

globalPid and globalTid are "serialized global ids": the process id sits in bits 24 to 47, so
pid = (id >> 24) & 0xFFFFFF (the guide's "Serialized process and thread identifiers"). A report
may hold several processes (one `nsys profile` around a whole torchrun job); day 27's capture
writes one report per rank, one process each, and this reads any number.

Per process, the window is its NVTX range `capture` (profile.py opens it around the step it
hands to Nsight Systems; dtl.profile.CAPTURE), else the span of its kernels. Inside it, the cut of
trace_analysis.cut on the device's clock: compute = every kernel but NCCL's, comm = the NCCL
kernels (ncclDevKernel_..., ncclKernel_...), hidden = comm under compute, exposed = comm alone,
idle = neither. Tested on a small database built with these columns (tests/test_day27_profiling.py);
not run on a report from a GPU.
"""

from __future__ import annotations

import sqlite3
import sys
from dataclasses import dataclass, field

from day27_profiling.trace_analysis import Breakdown, cut
from dtl.profile import CAPTURE, is_nccl_kernel

NS_PER_MS = 1e6
PUSH_POP, START_END = 59, 60  # NVTX_EVENTS.eventType of the two kinds of range


def pid_of(global_id: int) -> int:
    """The process id inside a serialized globalPid / globalTid."""
    return (global_id >> 24) & 0xFFFFFF


@dataclass
class Process:
    """One process's kernels and NVTX ranges, in ms on the report's clock."""

    kernels: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, name
    ranges: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, text

    def window(self) -> tuple[float, float] | None:
        """The `capture` range (the first, if the report has several), else the kernels' span."""
        captures = sorted((s, e) for s, e, text in self.ranges if text == CAPTURE)
        if captures:
            return captures[0]
        if self.kernels:
            return min(s for s, _, _ in self.kernels), max(e for _, e, _ in self.kernels)
        return None


def _tables(db: sqlite3.Connection) -> set[str]:
    # nsys creates a table only when it has rows for it: a report without kernels has none
    return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def read(path: str) -> dict[int, Process]:
    """pid -> its kernels and NVTX ranges, from a report exported with `nsys export`."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = _tables(db)
        out: dict[int, Process] = {}
        if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
            rows = db.execute(
                "SELECT k.start, k.end, k.globalPid, COALESCE(s.value, d.value, '?') "
                "FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "
                "LEFT JOIN StringIds AS s ON s.id = k.shortName "
                "LEFT JOIN StringIds AS d ON d.id = k.demangledName"
            )
            for start, end, gpid, name in rows:
                proc = out.setdefault(pid_of(gpid or 0), Process())
                proc.kernels.append((start / NS_PER_MS, end / NS_PER_MS, name))
        if "NVTX_EVENTS" in tables:
            join = "LEFT JOIN StringIds AS s ON s.id = n.textId" if "StringIds" in tables else ""
            text = "COALESCE(n.text, s.value)" if join else "n.text"
            rows = db.execute(
                f"SELECT n.start, n.end, n.globalTid, {text} FROM NVTX_EVENTS AS n {join} "
                f"WHERE n.eventType IN ({PUSH_POP}, {START_END}) AND n.end IS NOT NULL"
            )
            for start, end, gtid, name in rows:
                proc = out.setdefault(pid_of(gtid or 0), Process())
                proc.ranges.append((start / NS_PER_MS, end / NS_PER_MS, name or ""))
        return out
    finally:
        db.close()


def device_cut(proc: Process) -> Breakdown | None:
    """The process's window cut on the device's clock (None: no window, nothing ran)."""
    window = proc.window()
    if window is None:
        return None
    comm = [(s, e) for s, e, name in proc.kernels if is_nccl_kernel(name)]
    compute = [(s, e) for s, e, name in proc.kernels if not is_nccl_kernel(name)]
    return cut(window, compute, comm, clock="device")


def breakdowns(path: str) -> dict[int, Breakdown]:
    """pid -> the cut of its window, for every process of the report with kernels or ranges."""
    out = {}
    for pid, proc in sorted(read(path).items()):
        b = device_cut(proc)
        if b is not None:
            out[pid] = b
    return out


def describe(path: str) -> list[str]:
    """One line per process: its kernels (NCCL's among them) and its cut."""
    lines = []
    procs = read(path)
    for pid, b in breakdowns(path).items():
        kernels = procs[pid].kernels
        nccl = sum(is_nccl_kernel(name) for _, _, name in kernels)
        lines.append(f"pid {pid}: {len(kernels):,} kernels ({nccl:,} NCCL); {b.line()}")
    return lines or [f"{path}: no kernels and no NVTX ranges"]


def main(argv: list[str] | None = None) -> None:
    paths = sys.argv[1:] if argv is None else argv
    if not paths or paths[0] in ("-h", "--help"):
        print("usage: python -m day27_profiling.nsys_sqlite REPORT.sqlite [...]")
        return
    for path in paths:
        for line in describe(path):
            print(f"{path}: {line}")


if __name__ == "__main__":
    main()
