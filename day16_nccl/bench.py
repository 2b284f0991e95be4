"""An nccl-tests-style sweep: built-in collectives and the hand-written all-reduces, with algbw,
busbw, a correctness check at every size, CSV + PNG, and the alpha-beta model fitted to it.

CPU (gloo), reduced sweep 4 KiB .. 64 MiB (~45 s for 4 ranks on 2 cores):
    torchrun --standalone --nproc_per_node=2 -m day16_nccl.bench
    torchrun --standalone --nproc_per_node=2 -m day16_nccl.bench --full    # 1 KiB .. 256 MiB
GPUs (NCCL): force an algorithm / protocol for the built-ins (passed through to NCCL's env):
    torchrun --standalone --nproc_per_node=gpu -m day16_nccl.bench --full --nccl_algo=Ring
    torchrun --standalone --nproc_per_node=gpu -m day16_nccl.bench --full --nccl_algo=Tree \
        --nccl_proto=Simple
Ctrl-C prints the rows measured so far and writes them to the CSV.

algbw = S / t; busbw = algbw * factor(n) with nccl-tests' factors (dtl.comm.BUSBW_FACTOR), S =
the all-reduce/broadcast buffer, the all-gather output, the reduce-scatter input.
One rank (a 1-GPU machine) runs and checks every op, but nothing crosses a link: busbw and the
ring / built-in ratio print n/a and no alpha-beta model is fitted; the lesson needs >= 2 ranks.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from day16_nccl import algorithms, cost_model, report
from day16_nccl.ops import OPS, make_case
from dtl import config as dtl_config
from dtl import dist as dtl_dist

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
NCCL_ALGOS = ("ring", "tree", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat")
NCCL_PROTOS = ("ll", "ll128", "simple")


@dataclass
class Config:
    min_bytes: int = 4096  # smallest message S
    max_bytes: int = 64 * 2**20  # largest message S
    factor: int = 4  # sizes grow by this factor (nccl-tests -f)
    warmup: int = 1  # untimed calls per size (nccl-tests -w)
    iters: int = 2  # timed calls per repetition (nccl-tests -n)
    reps: int = 5  # repetitions; the median is reported, the model fits the 25th percentile
    ops: str = "all"  # comma list from: all_reduce,all_gather,reduce_scatter,broadcast,ring,...
    dtype: str = "float32"  # element type of the messages
    # tree pipeline chunk: NCCL uses 512 KiB on GPUs; on CPU a round costs ~100x more, and the
    # model's best chunk (printed) is MiBs
    chunk_kib: int = 2048
    full: bool = False  # 1 KiB .. 256 MiB, factor 2, 5 reps
    nccl_algo: str = ""  # NCCL_ALGO for the built-ins on GPUs, e.g. Ring, Tree ("" = NCCL decides)
    nccl_proto: str = ""  # NCCL_PROTO, e.g. LL, LL128, Simple
    fit_min_bytes: int = 2**20  # the model's errors are reported from this size up
    out_dir: str = "outputs/day16_nccl/bench"  # CSV, PNG and the fitted model

    def validate(self) -> None:
        if self.full:
            self.min_bytes, self.max_bytes, self.factor, self.reps = 1024, 256 * 2**20, 2, 5
        bad = [
            k
            for k in ("min_bytes", "max_bytes", "iters", "reps", "chunk_kib")
            if getattr(self, k) < 1
        ] + (["factor"] if self.factor < 2 else [])
        if bad or self.warmup < 0 or self.min_bytes > self.max_bytes:
            raise dtl_config.ConfigError(
                f"bad sizes: need 1 <= min_bytes <= max_bytes, factor >= 2, iters, reps, "
                f"chunk_kib >= 1, warmup >= 0 (got {bad or 'min_bytes > max_bytes'})"
            )
        if self.dtype not in DTYPES:
            raise dtl_config.ConfigError(f"dtype '{self.dtype}' not in {list(DTYPES)}")
        unknown = [o for o in self.op_list() if o not in OPS]
        if unknown:
            raise dtl_config.ConfigError(f"unknown op(s) {unknown}; valid: all, {', '.join(OPS)}")
        _check_nccl_list("nccl_algo", self.nccl_algo, NCCL_ALGOS)
        _check_nccl_list("nccl_proto", self.nccl_proto, NCCL_PROTOS)

    def op_list(self) -> list[str]:
        return list(OPS) if self.ops == "all" else [o for o in self.ops.split(",") if o]

    def sizes(self) -> list[int]:
        out, s = [], self.min_bytes
        while s <= self.max_bytes:
            out.append(s)
            s *= self.factor
        return out


def _check_nccl_list(key: str, value: str, valid: tuple[str, ...]) -> None:
    # NCCL accepts "Ring", "Tree,Ring", "^LL128" and, since 2.24, "allreduce:tree;broadcast:ring"
    for item in value.lstrip("^").replace(";", ",").split(","):
        name = item.split(":")[-1].strip().lstrip("^").lower()  # "allreduce:^tree"
        if item and name not in valid:
            raise dtl_config.ConfigError(f"{key}: '{item}' is not one of {', '.join(valid)}")


def time_op(run, reps: int, iters: int, device) -> list[float]:
    """Per repetition: barrier, `iters` calls, seconds per call; the slowest rank's time counts."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        sync()
        times.append((time.perf_counter() - t0) / iters)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective is done when its last rank is done
    return t.tolist()


def measure(cfg: Config, op: str, nbytes: int, device) -> dict:
    n = dist.get_world_size()
    case = make_case(op, nbytes, n, DTYPES[cfg.dtype], device, cfg.chunk_kib * 1024)
    for _ in range(cfg.warmup):
        case.run()
    times = time_op(case.run, cfg.reps, cfg.iters, device)
    t = statistics.median(times)
    p25, p75 = np.percentile(times, [25, 75])  # the quiet end, and how wide the spread is
    wrong = case.check()  # fresh integer-valued input, compared with its closed form
    s = case.numel * case.elem
    algbw = s / t / 1e9
    return dict(
        op=op,
        nbytes=s,
        count=case.numel,
        dtype=cfg.dtype,
        n=n,
        time_us=t * 1e6,
        min_us=min(times) * 1e6,
        p25_us=p25 * 1e6,
        spread=p75 / p25,
        algbw=algbw,
        # busbw = the bytes a link carries per second; one rank has no link: None, printed n/a
        busbw=algbw * case.factor if n > 1 else None,
        wrong=wrong,
    )


def count_check(cfg: Config, device) -> bool:
    """Each hand-written all-reduce once at the largest size: every rank's Stats (rounds, bytes it
    sent) beside the closed forms of cost_model.ring_counts / tree_counts."""
    n, nbytes, chunk = dist.get_world_size(), cfg.sizes()[-1], cfg.chunk_kib * 1024
    elem = DTYPES[cfg.dtype].itemsize  # bytes per element
    numel, ok = nbytes // elem, True
    for op, name in (
        ("ring_all_reduce", "ring"),
        ("tree_all_reduce", "tree"),
        ("dbt_all_reduce", "dbt"),
    ):
        x = torch.zeros(numel, dtype=DTYPES[cfg.dtype], device=device)
        kw = {} if name == "ring" else {"chunk_bytes": chunk}
        stats = algorithms.ALL_REDUCES[name](x, **kw)
        got: list = [None] * n
        dist.all_gather_object(got, (stats.steps, stats.bytes_sent))
        steps, sent = (
            cost_model.ring_counts(numel, n, elem)
            if name == "ring"
            else cost_model.tree_counts(name, numel, n, elem, chunk)
        )
        match = [g[0] for g in got] == [steps] * n and [g[1] for g in got] == sent
        ok &= match
        dtl_dist.print0(
            f"counts {op} S = {nbytes} B: steps {got[0][0]} (formula {steps}), bytes "
            f"sent per rank {[g[1] for g in got]} (formula {sent}) "
            f"{'ok' if match else 'MISMATCH'}"
        )
    return ok


def sweep(cfg: Config, device, rows: list[dict]) -> None:
    dtl_dist.print0(report.HEADER)
    for op in cfg.op_list():
        for nbytes in cfg.sizes():
            row = measure(cfg, op, nbytes, device)
            rows.append(row)
            dtl_dist.print0(report.format_row(row))


def main() -> None:
    cfg = dtl_config.parse(Config)  # a bad key or size exits here, before any collective
    for key, env in (("nccl_algo", "NCCL_ALGO"), ("nccl_proto", "NCCL_PROTO")):
        if getattr(cfg, key):
            os.environ[env] = getattr(cfg, key)  # NCCL reads these when a communicator is created
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir)
    report.print_env(info)
    rows: list[dict] = []
    try:
        sweep(cfg, info.device, rows)
    except KeyboardInterrupt:  # every rank gets SIGINT from the terminal; rank 0 reports
        dtl_dist.print0(f"\ninterrupted: {len(rows)} rows measured so far")
        report.write(cfg, rows, final=False)
        dist.destroy_process_group()  # no barrier: the other ranks may be gone
        raise SystemExit(130) from None
    # on 1 rank too: every schedule is 0 rounds and 0 bytes there, and the formulas say so
    counts_ok = count_check(cfg, info.device)
    cores = os.cpu_count() if info.device.type == "cpu" else None  # CPU: ranks share cores
    report.write(cfg, rows, final=True, cores=cores)
    dtl_dist.print0(
        f"summary: step and byte counts of ring/tree/dbt "
        f"{'match' if counts_ok else 'DO NOT match'} the formulas on every rank"
        + (" (1 rank: 0 rounds and 0 bytes, trivially)" if info.world_size == 1 else "")
    )
    failed = sum(r["wrong"] for r in rows) > 0 or not counts_ok
    dtl_dist.finish(not failed)


if __name__ == "__main__":
    main()
