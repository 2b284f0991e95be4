"""Day 16: hang forensics from PyTorch's Flight Recorder, on any backend (gloo here, NCCL on GPUs).

With TORCH_FR_BUFFER_SIZE=N set before the process group exists, every rank keeps a ring buffer
of its last N collectives: sequence number, name ("gloo:all_reduce"), process group, input sizes,
state. When a job hangs, each rank dumps its buffer, and the dumps answer the question the NCCL
debug log answers with opCounts (nccl_log.py): which rank stopped early, and in which collective
the others are stuck. Both use one rule, nccl_log.behind: per process group, the ranks whose last
sequence number is below the highest are the ones behind.

One file format for all: torch's own, a pickle named <prefix><rank>. On NCCL the watchdog writes
exactly these at the timeout (TORCH_FR_DUMP_TEMP_FILE=<prefix>); on gloo `dump` writes them by
hand; both `report` here and torch's analyser (python -m torch.distributed.flight_recorder.fr_trace
<dir> -p <basename of prefix>) read them. Pickles run code when loaded: read only dumps you wrote.

    dump(prefix, rank)                # this rank's buffer -> <prefix><rank>
    report(paths) -> [Finding]        # every rank's dump -> who is behind, where the rest wait
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass

import torch

from day16_nccl.nccl_log import behind

ENV = "TORCH_FR_BUFFER_SIZE"
DUMP_ENV = "TORCH_FR_DUMP_TEMP_FILE"  # where the NCCL watchdog dumps at a timeout
FIELDS = ("collective_seq_id", "profiling_name", "state", "input_sizes", "process_group")


def enable(prefix: str, entries: int = 100) -> None:
    """Ask torch to record collectives (and NCCL's watchdog to dump them to <prefix><rank> at a
    timeout); must run before init_process_group, which reads both."""
    os.environ.setdefault(ENV, str(entries))
    os.environ.setdefault(DUMP_ENV, prefix)


def dump(prefix: str, rank: int) -> str:
    """Write this process's buffer in torch's format to <prefix><rank>; return the path."""
    path = f"{prefix}{rank}"
    with open(path + ".tmp", "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace())
    os.replace(path + ".tmp", path)  # a reader never sees half a dump
    return path


def load(path: str) -> tuple[int, list[dict]]:
    """One dump -> (rank, its entries oldest first, the fields the report reads)."""
    digits = re.search(r"(\d+)$", path)
    if digits is None:
        raise ValueError(f"a Flight Recorder dump is named <prefix><rank>, got {path}")
    with open(path, "rb") as f:
        raw = pickle.load(f)
    return int(digits.group(1)), [{k: e.get(k) for k in FIELDS} for e in raw.get("entries", [])]


@dataclass
class Finding:
    group: str  # the process group's name
    last: dict[int, int]  # rank -> its last collective_seq_id
    behind: list[int]  # the ranks that never reached `top`
    top: int  # the sequence number the others are in
    waiting_in: str  # what the others are stuck in: name and input sizes
    last_of_behind: str  # what the ranks behind did last

    def line(self) -> str:
        seen = ", ".join(f"{r}: {s}" for r, s in sorted(self.last.items()))
        return (
            f"rank(s) {self.behind} fell behind on process group {self.group}: last collective "
            f"per rank {{{seen}}}; the others are waiting in #{self.top} {self.waiting_in}, "
            f"which rank(s) {self.behind} never entered (their last: {self.last_of_behind})"
        )


def report(paths: list[str]) -> list[Finding]:
    """Every rank's dump -> one Finding per process group where ranks disagree."""
    by_group: dict[str, dict[int, dict]] = {}
    for path in paths:
        rank, entries = load(path)
        for e in entries:
            group = "/".join(map(str, e["process_group"] or ["?"]))
            mine = by_group.setdefault(group, {})
            if e["collective_seq_id"] >= mine.get(rank, {}).get("collective_seq_id", -1):
                mine[rank] = e  # the last entry of this rank on this group
    findings = []
    for group, last in by_group.items():
        seqs = {r: e["collective_seq_id"] for r, e in last.items()}
        late = behind(seqs)
        if late is None:
            continue
        ahead = next(e for r, e in last.items() if seqs[r] == late[1])
        tail = last[late[0][0]]
        findings.append(
            Finding(
                group, seqs, late[0], late[1], _what(ahead), f"#{seqs[late[0][0]]} {_what(tail)}"
            )
        )
    return findings


def _what(e: dict) -> str:
    return f"{e['profiling_name']} of {e['input_sizes']} ({e['state']})"
