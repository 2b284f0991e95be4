"""Day 27: MFU with its conventions and a measured ceiling; real traces cut into their parts.

    torchrun --standalone --nproc_per_node=1 -m day27_profiling.bench --part=mfu
    torchrun --standalone --nproc_per_node=1 -m day27_profiling.bench --part=traces
GPU: the same lines; part=mfu then measures the bf16 ceiling and the step of the model given
(lessons.toml's GPU line: gpt2-124m at T = 1024; DTL_BACKEND=gloo measures the CPU instead);
part=traces stays a CPU-host analysis: its runs are gloo on any machine (a `note:` line says so)

mfu: the FLOPs-per-token table in every convention (mfu.py), the published figures recomputed,
FlopCounterMode's count of a real step beside the formula, the matmul ceiling of this device at
the step's shapes (ceiling.py), and the MFU of a measured training step against the ceiling and,
where one exists, the datasheet peak.
traces: day 17's naive and bucketed DDP and day 20's 1F1B, each run under profile.py (2 ranks),
each rank's traced step cut into compute / comm hidden / comm exposed / idle
(trace_analysis.py), a PNG of the lanes, and day 20's idle from the trace beside the idle the
run measured with its own clock.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch

from day27_profiling import ceiling, mfu, trace_analysis
from day27_profiling.profile import trace_path
from day27_profiling.schedule_trace import schedule_idle
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import profile as dtl_profile
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.metrics import peak_flops
from dtl.model import GPT, PresetName, loss_fn, preset
from dtl.precision import ANY_DEVICE, PRECISIONS, Precision, PrecisionError, declare
from dtl.profile import parse_trace
from dtl.registry import child_env

TRACES_BACKEND = "gloo"  # part=traces: the backend of the profiled runs, on any machine
ACTIVE = 2  # part=traces: the step traced (0-based; the first ones pay for warm-up)
# how far the traced step's idle, read from the trace by day 20's rule, may be from the run's
# own figure for that step (the profiler's overhead on the ranges, not two windows apart)
IDLE_RTOL = 0.02  # measured: at most 0.4% apart in 20 runs of the traces line
RUNS = {  # name -> (module, args): the runs part=traces profiles
    "ddp_naive": ("day17_ddp.train", ["--sync=naive", "--profile_step=-1", "--steps=4"]),
    "ddp_bucket": ("day17_ddp.train", ["--sync=bucket", "--profile_step=-1", "--steps=4"]),
    # the trace is the point: day 20's one-process check (rank 0 alone, ~10 s here) is left out
    "pp_1f1b": ("day20_pp.train", ["--schedule=1f1b", "--pp=2", "--check=false"]),
}
_STEP = [dtl_profile.STEP, dtl_profile.OPTIMIZER]
_DDP = [*_STEP, dtl_profile.FORWARD, dtl_profile.BACKWARD, "all_reduce bucket 0"]
RANGES = {  # run -> named ranges (dtl.profile.range, in the lesson's code) its traces must show
    "ddp_naive": [*_DDP, "all_reduce bucket 51"],  # one per gradient: small has 52
    "ddp_bucket": [*_DDP, "all_reduce bucket 1", "wait all_reduce"],
    # 1F1B at p = 2, m = 8: every action by its schedule name; rank 0 sends activations and
    # receives gradients, rank 1 the reverse; the tied embedding's all-reduce on both
    "pp_1f1b": [
        *_STEP,
        "F0",
        "F7",
        "B0",
        "B7",
        "send F0",
        "recv F0",
        "send B7",
        "recv B7",
        "all_reduce tied embedding",
        "wait send",
    ],
}


def missing_ranges(name: str, trace_dir: str, ranks=(0, 1)) -> list[str]:
    """RANGES[name] that no rank's trace holds (names from dtl.profile.parse_trace)."""
    names = {s.name for r in ranks for s in parse_trace(trace_path(trace_dir, r))}
    return [n for n in RANGES[name] if n not in names]


# The precisions the timed step runs in: torch.autocast to the row's dtype around an fp32 model
# (fp16 too: a few timed steps need no loss scaler)
TIMED_STEP = declare(
    "day 27's timed step",
    {"fp32": ANY_DEVICE, "bf16": ANY_DEVICE, "fp16": ANY_DEVICE},
    why="it times torch.autocast steps; no conversion of the linears (fp8) is wired",
)


@dataclass
class Config:
    part: Literal["mfu", "traces"] = "mfu"  # mfu | traces
    model: PresetName = "small"  # part=mfu: the GPT whose step is measured
    batch_size: int = 4  # part=mfu: sequences per step
    seq_len: int = 128  # part=mfu: tokens per sequence
    steps: int = 4  # part=mfu: timed steps (after one warm-up)
    # part=mfu: auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16 (dtl.precision's rows)
    precision: Literal[("auto", *PRECISIONS)] = "auto"
    runs: str = "ddp_naive,ddp_bucket,pp_1f1b"  # part=traces: which of RUNS
    out_dir: str = "outputs/day27_profiling"  # traces/<run>/rank<R>.json, PNGs

    def validate(self) -> None:
        err = dtl_config.ConfigError
        if self.seq_len > preset(self.model).block_size:
            raise err(f"seq_len {self.seq_len} exceeds {self.model}'s block_size")
        for run in self.runs.split(","):
            if run not in RUNS:
                raise err(f"unknown run '{run}'; one of {', '.join(RUNS)}")
        if self.precision != "auto":
            try:
                TIMED_STEP.require(self.precision, run_device().type)
            except PrecisionError as e:
                raise err(str(e)) from None


# --- part mfu ---------------------------------------------------------------------------------


def _precision(cfg: Config, device) -> Precision:
    if cfg.precision == "auto":
        return PRECISIONS["bf16" if device.type == "cuda" else "fp32"]
    return PRECISIONS[cfg.precision]


def measure_step(cfg: Config, device, precision: Precision, recompute: str = "none") -> float:
    """Tokens per second of the model's training step (forward, backward, AdamW)."""
    mcfg = preset(cfg.model)
    corpus = load_corpus(tokenizer=tokenizer_for(mcfg.vocab_size))
    model = GPT(mcfg, seed=0).to(device)
    model.set_recompute(recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(cfg.steps + 1):
        x, y = get_batch(corpus.train, cfg.seq_len, cfg.batch_size, seed=0, step=step)
        x, y = x.to(device), y.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with precision.autocast(device.type):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = sorted(times[1:])[len(times[1:]) // 2]  # the median after the warm-up step
    return cfg.batch_size * cfg.seq_len / best


def run_device() -> torch.device:
    """This one-process run's device, by dtl.dist's rule (no process group is made here): the GPU
    when one exists, the CPU with DTL_BACKEND=gloo (a CPU measurement on a GPU machine)."""
    try:
        backend = dtl_dist.choose_backend(1)
    except dtl_dist.BackendError as e:
        dtl_config.exit_with_error(e)  # one line, exit 2
    return torch.device("cuda" if backend == "nccl" else "cpu")


def part_mfu(cfg: Config) -> str:
    device = run_device()
    precision = _precision(cfg, device)
    dtype = precision.matmul_dtype
    gpt2 = preset("gpt2-124m")
    print("FLOPs per token, GPT-2 124M at T = 1024 (ratio to the PaLM/nanoGPT convention):")
    for name, value, ratio in mfu.table(gpt2, 1024):
        print(f"  {name:<20} {value / 1e6:>10.1f} MFLOP  {ratio:>6.3f}")
    worst_pub = 0.0
    print("published figures, recomputed:")
    for row in mfu.published_checks():
        rel = abs(row["ours"] - row["published"]) / row["published"]
        worst_pub = max(worst_pub, rel) if row["published"] > 1 else worst_pub
        fmt = ",.0f" if row["published"] > 1 else ".3f"
        ours, published = format(row["ours"], fmt), format(row["published"], fmt)
        print(f"  {row['what']}: ours {ours} vs {published} ({row['source']})")
    mcfg = preset(cfg.model)
    model = GPT(mcfg, seed=0).to(device)  # one sequence is enough: FLOPs per token
    x = torch.randint(0, mcfg.vocab_size, (1, cfg.seq_len), device=device)
    counted = mfu.counted_flops_per_token(model, x, x)
    formula = mfu.flops_per_token(mcfg, cfg.seq_len, "palm")
    print(
        f"{cfg.model}, T = {cfg.seq_len}: FlopCounterMode {counted / 1e6:.3f} MFLOP per token, "
        f"6N + 12LHQT {formula / 1e6:.3f} ({counted / formula - 1:+.2%})"
    )
    tokens = cfg.batch_size * cfg.seq_len
    ceil = ceiling.step_ceiling(mcfg, tokens, dtype, device)
    square = ceiling.square_ceiling(4096 if device.type == "cuda" else 1024, dtype, device)
    for name, rate in ceil["per_matmul"].items():
        print(f"  matmul {name:<12} {rate / 1e9:>9.1f} GFLOP/s")
    print(
        f"ceiling at the step's shapes ({dtype}, {device.type}): "
        f"{ceil['ceiling'] / 1e9:.1f} GFLOP/s; one square matmul {square / 1e9:.1f} GFLOP/s"
    )
    tok_s = measure_step(cfg, device, precision)
    achieved = formula * tok_s
    ours = mfu.mfu(formula, tok_s, ceil["ceiling"])
    peak = peak_flops(device, precision.name)
    vs_peak = (
        f"; vs datasheet {mfu.mfu(formula, tok_s, peak):.1%}"
        if peak
        else ("; no datasheet peak for this device")
    )
    print(
        f"step: {tok_s:,.0f} tokens/s x {formula / 1e6:.2f} MFLOP = {achieved / 1e9:.2f} "
        f"GFLOP/s: MFU {ours:.1%} of the measured ceiling{vs_peak}"
    )
    hfu = recompute_rows(cfg, device, precision, x, counted, formula, ceil["ceiling"])
    return (
        f"summary: day27 mfu {cfg.model} T={cfg.seq_len} {device.type} {str(dtype)[6:]}: "
        f"published figures reproduced (worst {worst_pub:.1e}); FlopCounterMode "
        f"{counted / formula - 1:+.2%} vs 6N+12LHQT; ceiling {ceil['ceiling'] / 1e9:.1f} "
        f"GFLOP/s; MFU {ours:.1%} of the ceiling{vs_peak}; recomputation: {hfu}"
    )


def recompute_rows(cfg: Config, device, precision, x, counted_none, model_flops, ceiling) -> str:
    """Per recompute mode: FLOPs FlopCounterMode counts beyond "none" vs recompute_flops_per_token,
    the step's tokens/s, MFU (model FLOPs) and HFU (model + recomputed FLOPs), of the ceiling."""
    mcfg = preset(cfg.model)
    print("activation recomputation (dtl.model set_recompute): FLOPs per token and utilization")
    print(
        f"  {'mode':<10}{'recomputed MFLOP/token':>24}{'formula':>9}{'tokens/s':>10}"
        f"{'MFU':>7}{'HFU':>7}"
    )
    worst, parts = 0.0, []
    for mode in ("none", "selective", "full"):
        model = GPT(mcfg, seed=0).to(device)
        model.set_recompute(mode)
        extra = mfu.counted_flops_per_token(model, x, x) - counted_none
        want = mfu.recompute_flops_per_token(mcfg, cfg.seq_len, mode)
        worst = max(worst, abs(extra - want) / want if want else abs(extra))
        tok_s = measure_step(cfg, device, precision, mode)
        model_u = mfu.mfu(model_flops, tok_s, ceiling)
        hw_u = mfu.mfu(model_flops + want, tok_s, ceiling)
        print(
            f"  {mode:<10}{extra / 1e6:>24.3f}{want / 1e6:>9.3f}{tok_s:>10,.0f}"
            f"{model_u:>7.1%}{hw_u:>7.1%}"
        )
        parts.append(f"{mode} MFU {model_u:.1%} HFU {hw_u:.1%}")
    return f"counted vs formula worst {worst:.1e}; " + ", ".join(parts)


# --- part traces ------------------------------------------------------------------------------


def profile_run(name: str, out_dir: str, active_step: int = ACTIVE) -> tuple[str, str]:
    """Run RUNS[name] on 2 ranks under profile.py; returns (its output, its trace folder)."""
    module, args = RUNS[name]
    trace_dir = os.path.join(out_dir, "traces", name)
    # a torchrun job inside this one: the parent's variables removed; gloo, on a GPU machine
    # too: trace_analysis cuts host ranges (gloo's spans), not GPU kernel lanes
    env = child_env(DTL_BACKEND=TRACES_BACKEND)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "day27_profiling.profile",
        f"--target={module}",
        f"--trace_dir={trace_dir}",
        f"--active_step={active_step}",
        "--",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    return proc.stdout, trace_dir


def _idle_check(name: str, ranks, trace_dir: str, measured: float) -> str:
    """The traced step's idle read from the trace by day 20's rule (schedule_trace.py), mean of
    the two ranks, against the idle the run measured for that same step on its own clock."""
    traced = sum(schedule_idle(trace_path(trace_dir, r)) for r in (0, 1)) / 2
    apart = abs(traced - measured) / measured
    ops = sum(b.not_computing for b in ranks) / len(ranks)
    print(
        f"{name}: idle of step {ACTIVE} {traced:.3f} (trace, day 20's rule, mean of ranks) vs "
        f"{measured:.3f} (the run's clock): {apart:.1%} apart; not computing by the trace's "
        f"own ops {ops:.3f} (a wider window: the whole profiler step)"
    )
    close = apart <= IDLE_RTOL
    return (
        f"idle {traced:.3f} (trace) vs {measured:.3f} (run): within {IDLE_RTOL:.0%} "
        f"{'yes' if close else 'NO'}"
    )


def part_traces(cfg: Config) -> str:
    if torch.cuda.is_available():  # a GPU machine: say that this PASS is no GPU result
        print(
            f"note: {TRACES_BACKEND} on the CPU (forced: the traced runs use "
            f"DTL_BACKEND={TRACES_BACKEND}, since trace_analysis reads host ranges, not GPU "
            "kernel lanes); this PASS is not a GPU result",
            flush=True,
        )
    parts, lanes, named = [], {}, []
    for name in cfg.runs.split(","):
        output, trace_dir = profile_run(name, cfg.out_dir)
        missing = missing_ranges(name, trace_dir)
        named.append(f"{name} " + (f"NO (missing {', '.join(missing)})" if missing else "yes"))
        ranks = [trace_analysis.breakdown(trace_path(trace_dir, r)) for r in (0, 1)]
        for r, b in enumerate(ranks):
            print(f"{name} rank {r}: {b.line()}")
            lanes[f"{name} r{r}"] = b
        hidden = sum(b.hidden_ms for b in ranks) / max(1e-9, sum(b.comm_ms for b in ranks))
        # p2p sends stay "in flight" until the end of a pipeline step (they are waited for
        # there), so their spans say nothing about overlap: hidden share for collectives only
        part = f"{name}" if name.startswith("pp") else f"{name} comm hidden {hidden:.0%}"
        m = re.search(r"^idle by step \(mean over ranks\): ([\d. ]+)$", output, re.M)
        if m:  # day 20: the traced step's idle by the runtime's rule, trace vs the run's clock
            part += ", " + _idle_check(name, ranks, trace_dir, float(m.group(1).split()[ACTIVE]))
        parts.append(part)
    path = os.path.join(cfg.out_dir, "breakdown.png")
    trace_analysis.plot(
        lanes, path, "one traced step per rank: compute, comm hidden, comm exposed, idle"
    )
    print(f"plot: {path}")
    print(f"summary: day27 traces ranges by name: {', '.join(named)}")
    return f"summary: day27 traces: {'; '.join(parts)}"


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    if dtl_dist.launch_world_size() != 1:
        dtl_config.exit_with_error("bench.py runs as one process (--nproc_per_node=1)")
    os.makedirs(cfg.out_dir, exist_ok=True)
    line = part_mfu(cfg) if cfg.part == "mfu" else part_traces(cfg)
    print(line, flush=True)


if __name__ == "__main__":
    main()
