"""Run all-reduces with NCCL's debug log on, then read back from the log what NCCL did.

GPUs (NCCL), one process per GPU:
    torchrun --standalone --nproc_per_node=gpu -m day16_nccl.forensics
    NCCL_ALGO=Tree NCCL_PROTO=Simple torchrun --standalone --nproc_per_node=gpu \
        -m day16_nccl.forensics                    # then check the report says TREE / SIMPLE
CPU: NCCL needs GPUs, so the same all-reduces run on gloo, and the report is shown for a bundled
log fixture (hand-written in NCCL's line formats, labelled as such):
    torchrun --standalone --nproc_per_node=2 -m day16_nccl.forensics
A real hang, on any machine (gloo): rank R skips the last all-reduce, the others time out, every
rank dumps its Flight Recorder buffer and rank 0 names the rank behind from the dumps alone
(flight_recorder.py; ~10 s):
    torchrun --standalone --nproc_per_node=2 -m day16_nccl.forensics \
        --hang_rank=1 --hang_timeout_s=5

The environment this script sets before the first NCCL call (yours win if already set):
    NCCL_DEBUG=INFO  NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING,COLL
    NCCL_DEBUG_FILE=<out_dir>/nccl.%h.%p.log   (%h = host, %p = pid: one file per process)
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from day16_nccl import flight_recorder, nccl_log
from dtl import config as dtl_config
from dtl import dist as dtl_dist

FIXTURES = os.path.join(os.path.dirname(__file__), "nccl_logs")


@dataclass
class Config:
    sizes: str = "4096,1048576,67108864"  # bytes per all-reduce: small (LL) to large (Simple)
    fixture: str = "multinode.log"  # the log shown on machines without GPUs (in nccl_logs/)
    out_dir: str = "outputs/day16_nccl/forensics"  # the NCCL log of this run and the report
    hang_rank: int = -1  # drill: this rank skips the last all-reduce (-1: no drill)
    hang_timeout_s: float = 10.0  # drill: the process group's timeout (the others' wait)

    def validate(self) -> None:
        try:
            sizes = [int(s) for s in self.sizes.split(",")]
        except ValueError:
            raise dtl_config.ConfigError(f"sizes must be integers, got '{self.sizes}'") from None
        if not sizes or min(sizes) < 4:
            raise dtl_config.ConfigError(f"sizes must be >= 4 bytes (one float), got {sizes}")
        world = dtl_dist.launch_world_size()
        if self.hang_rank < -1 or self.hang_rank >= world or (self.hang_rank >= 0 and world < 2):
            raise dtl_config.ConfigError(
                f"hang_rank {self.hang_rank} needs a rank of a world of >= 2 (world is {world})"
            )
        if self.hang_timeout_s <= 0:
            raise dtl_config.ConfigError(f"hang_timeout_s must be > 0, got {self.hang_timeout_s}")
        if not os.path.isfile(os.path.join(FIXTURES, self.fixture)):
            raise dtl_config.ConfigError(
                f"fixture '{self.fixture}' not in {FIXTURES}: {sorted(os.listdir(FIXTURES))}"
            )

    def byte_sizes(self) -> list[int]:
        return [int(s) for s in self.sizes.split(",")]


def nccl_env(out_dir: str) -> dict[str, str]:
    """The debug knobs, set before init: NCCL reads them once, at its first call in the process."""
    env = {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,TUNING,COLL",
        "NCCL_DEBUG_FILE": os.path.abspath(os.path.join(out_dir, "nccl.%h.%p.log")),
    }
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in env}


def run_all_reduces(sizes: list[int], device) -> bool:
    """all_reduce of (rank + 1) at each size: every element must equal n(n+1)/2."""
    n, ok = dist.get_world_size(), True
    for nbytes in sizes:
        x = torch.full((nbytes // 4,), float(dist.get_rank() + 1), device=device)
        dist.all_reduce(x)
        ok &= bool((x == n * (n + 1) / 2).all())
    if device.type == "cuda":
        torch.cuda.synchronize()  # the log lines of these calls are written by now
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def report_lines(rep: nccl_log.Report) -> str:
    """The one-line digest the summary prints."""
    calls = [c for c in rep.calls if c["algo"]]
    chosen = "; ".join(
        f"{c['nbytes']} B -> {c['algo']}/{c['proto']}"
        for c in calls
        if c["rank"] in (None, min(x["rank"] or 0 for x in calls))
    )
    hosts = len({r.get("host") for r in rep.ranks.values()})
    return (
        f"NCCL {rep.version}, {len(rep.ranks)} ranks on {hosts} host(s), transports "
        f"{nccl_log.summarize_transports(rep)}, {rep.n_channels} channels, "
        f"all-reduce {chosen or 'algorithm not stated'}"
    )


def hang_drill(cfg: Config) -> None:
    """One rank stops taking part; the rest wait until the timeout; the dumps say who and where.

    gloo raises in the waiting ranks at the timeout, so they can dump and report. (On NCCL the
    watchdog does the dumping: TORCH_FR_DUMP_TEMP_FILE=<prefix> writes <prefix><rank> for every
    rank at the timeout, before it aborts; the same report reads those.)"""
    prefix = os.path.join(os.path.abspath(cfg.out_dir), "fr_trace_rank_")
    os.makedirs(cfg.out_dir, exist_ok=True)
    flight_recorder.enable(prefix)  # before the process group: torch reads it at creation
    info = dtl_dist.init(backend="gloo", timeout=cfg.hang_timeout_s)
    dtl_config.save(cfg, cfg.out_dir)
    dtl_dist.print0(
        "note: the hang drill runs gloo on the CPU even on a GPU machine (gloo raises at the "
        "timeout, so every rank can dump and report); this is not an NCCL result"
    )
    sizes = cfg.byte_sizes()
    device = dtl_dist.run_device()  # the CPU here (gloo); the rule holds if the drill moves
    for nbytes in sizes[:-1]:  # every rank takes part in these
        dist.all_reduce(torch.ones(nbytes // 4, device=device))
    if info.rank == cfg.hang_rank:
        dtl_dist.print_rank(f"drill: skipping the all_reduce of {sizes[-1]} bytes")
        time.sleep(cfg.hang_timeout_s + 2)  # a rank busy elsewhere (a data loader, a bug)
    else:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(sizes[-1] // 4, device=device))
        except RuntimeError as e:  # gloo: "Timed out waiting ... for recv operation"
            waited = time.monotonic() - t0
            why = str(e).splitlines()[0][-60:]
            dtl_dist.print_rank(f"all_reduce timed out after {waited:.1f} s: {why}")
    flight_recorder.dump(prefix, info.rank)  # gloo has no watchdog dump: write it by hand
    ok = True
    if info.is_main:
        paths = [f"{prefix}{r}" for r in range(info.world_size)]
        deadline = time.monotonic() + cfg.hang_timeout_s + 30
        while not all(os.path.isfile(p) for p in paths) and time.monotonic() < deadline:
            time.sleep(0.2)  # the group is broken: the dumps meet on disk, not by collective
        findings = flight_recorder.report(paths)
        for f in findings:
            print(f"FLIGHT RECORDER: {f.line()}", flush=True)
        named = sorted({r for f in findings for r in f.behind})
        ok = named == [cfg.hang_rank]
        print(
            f"summary: forensics drill (Flight Recorder, gloo, {info.world_size} ranks): rank "
            f"{cfg.hang_rank} skipped an all_reduce; the dumps name {named}: "
            f"{'yes' if ok else 'NO'}",
            flush=True,
        )
    # no cleanup(): the group's last collective never completed, so a barrier would time out too
    os._exit(0 if ok else 1)


def main() -> None:
    cfg = dtl_config.parse(Config)  # bad input exits here, before any collective
    if cfg.hang_rank >= 0:
        hang_drill(cfg)
    gpus = torch.cuda.device_count()
    try:
        use_nccl = dtl_dist.planned_backend() == "nccl"  # the kit's rule (and DTL_BACKEND)
    except dtl_dist.BackendError as e:
        dtl_dist.exit_with_error(e)
    # why gloo, said as it is: no (or too few) GPUs, or DTL_BACKEND=gloo on a GPU machine
    local = dtl_dist.local_world_size()
    why = (
        "DTL_BACKEND=gloo"
        if os.environ.get("DTL_BACKEND") == "gloo"
        else f"NCCL needs GPUs: found {gpus} CUDA device(s) for {local} local ranks"
    )
    os.makedirs(cfg.out_dir, exist_ok=True)
    env = nccl_env(cfg.out_dir) if use_nccl else {}
    info = dtl_dist.init(backend="nccl" if use_nccl else "gloo")
    dtl_config.save(cfg, cfg.out_dir)
    if not use_nccl:
        dtl_dist.print0(f"{why}: running the same all-reduces on gloo, which has no such log")
    else:
        dtl_dist.print0("NCCL debug environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
    ok = run_all_reduces(cfg.byte_sizes(), info.device)
    dtl_dist.print0(
        f"all_reduce at {cfg.byte_sizes()} bytes on {info.world_size} ranks "
        f"({info.backend}): {'correct' if ok else 'WRONG'}"
    )
    if use_nccl and info.world_size == 1:
        dtl_dist.print0(
            "note: on 1 rank NCCL runs no ring or tree (a local copy): its log has the version "
            "and the init, but names no algorithm or protocol"
        )
    # every rank's pid (a collective, so every rank's log is written by now): the folder also
    # holds the logs of earlier runs, nccl.<host>.<pid>.log, which must not enter this report
    pids: list = [None] * info.world_size
    dist.all_gather_object(pids, os.getpid())
    if info.is_main:
        if use_nccl:
            paths = sorted(
                p for pid in pids for p in glob.glob(os.path.join(cfg.out_dir, f"nccl.*.{pid}.log"))
            )
            source = f"this run's NCCL log ({len(paths)} files in {cfg.out_dir})"
        else:
            paths = [os.path.join(FIXTURES, cfg.fixture)]
            source = (
                f"fixture {cfg.fixture}: hand-written in NCCL's line formats, "
                f"NOT captured from this machine"
            )
        rep = nccl_log.parse_files(paths)
        print(f"--- report from {source}\n{nccl_log.format_report(rep)}", flush=True)
        print(
            f"summary: forensics {'nccl' if use_nccl else f'gloo ({why})'} path on "
            f"{info.world_size} ranks, all_reduce {'ok' if ok else 'WRONG'}",
            flush=True,
        )
        print(
            f"summary: forensics report ({'log' if use_nccl else 'fixture'}): {report_lines(rep)}",
            flush=True,
        )
    dtl_dist.finish(ok)


if __name__ == "__main__":
    main()
