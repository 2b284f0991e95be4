"""Day 27: profile any lesson run, one trace per rank, without touching the lesson's code.

    torchrun --standalone --nproc_per_node=2 -m day27_profiling.profile \\
        --target=day17_ddp.train --trace_dir=outputs/day27_profiling/ddp -- --sync=bucket \\
        --profile_step=-1
    python -m day27_profiling.profile --lesson=20 --run=1f1b     # a registered line, wrapped

The wrapper runs the target module as `__main__` (runpy) inside torch.profiler. Which step is
traced? Every training loop calls optimizer.step() once per step, so a global optimizer
step-post hook advances the profiler's schedule: steps before `active_step` are skipped (the
first ones pay for allocation and warm-up), step `active_step` is recorded and written to
<trace_dir>/rank<R>.json, the rest run unprofiled. The trace holds one `ProfilerStep#N` range:
the window trace_analysis.py cuts the step out with.

CPU: host ops (aten::..., autograd::...) on the calling thread, gloo's work on its own threads.
CUDA: kernels and NCCL kernels on their streams too, and NVTX ranges for every op
(torch.autograd.profiler.emit_nvtx) when Nsight Systems records the run, with this command:

    nsys profile --trace=cuda,nvtx,osrt --output=<trace_dir>/nsys <the torchrun line>

(NVTX and the CUDA activity are only recorded for a run on GPUs, by dtl.dist's rule; a gloo run,
on a GPU machine too, has no kernels to show.)
A lesson that runs its own profiler must turn it off (day 17: --profile_step=-1): torch allows
one profiler at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass

import torch

from dtl import config as dtl_config
from dtl import dist as dtl_dist


@dataclass
class Config:
    target: str = ""  # the module to run as __main__ (e.g. day17_ddp.train); args after --
    lesson: int = 0  # or: a registered lesson's day ...
    run: str = ""  # ... and the name of its run: its CPU line is wrapped and run
    active_step: int = 2  # optimizer steps run before the one that is traced
    trace_dir: str = "outputs/day27_profiling/traces"  # rank<R>.json
    nvtx: bool = True  # emit NVTX ranges on a GPU run (for Nsight Systems)

    def validate(self) -> None:
        if bool(self.target) == bool(self.lesson):
            raise dtl_config.ConfigError("give either --target=<module> or --lesson=<day> --run=")


def trace_path(trace_dir: str, rank: int) -> str:
    return os.path.join(trace_dir, f"rank{rank}.json")


def run_on_gpu() -> bool:
    """Will the wrapped run compute on GPUs? The target's dtl.dist.init() has not run yet, so
    ask its rule: NCCL (GPUs) when every local rank has one, gloo otherwise or with
    DTL_BACKEND=gloo (a CPU run on a GPU machine, whose trace needs no CUDA lanes)."""
    try:
        return dtl_dist.planned_backend() == "nccl"
    except dtl_dist.BackendError:
        return False  # the target's init() reports the bad DTL_BACKEND in one line


def nvtx_context(enabled: bool):
    """NVTX ranges for Nsight Systems, only on a GPU run (a CPU run gets a null context)."""
    if enabled and run_on_gpu():
        return torch.autograd.profiler.emit_nvtx(record_shapes=False)
    return contextlib.nullcontext()


def profile_module(cfg: Config, target_argv: list[str]) -> None:
    """Run `cfg.target` as __main__ under torch.profiler; trace step `active_step`."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(cfg.trace_dir, exist_ok=True)
    path = trace_path(cfg.trace_dir, rank)
    activities = [ProfilerActivity.CPU]
    if run_on_gpu():  # kernels and NCCL on their streams; a gloo run has none to record
        activities.append(ProfilerActivity.CUDA)
    prof = profile(
        activities=activities,
        schedule=schedule(
            wait=max(0, cfg.active_step - 1), warmup=min(1, cfg.active_step), active=1, repeat=1
        ),
        on_trace_ready=lambda p: p.export_chrome_trace(path),
    )
    hook = register_optimizer_step_post_hook(lambda *args: prof.step())
    sys.argv = [cfg.target, *target_argv]
    try:
        with prof, nvtx_context(cfg.nvtx):
            runpy.run_module(cfg.target, run_name="__main__", alter_sys=True)
    finally:
        hook.remove()
    if rank == 0:
        print(trace_summary(cfg.target, path), flush=True)


def trace_summary(target: str, path: str) -> str:
    """One line on what rank 0's trace holds: its events, and the GPU's kernels by kind."""
    if not os.path.exists(path):
        return (
            f"summary: day27 profile of {target}: no trace written (fewer than active_step steps?)"
        )
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    nccl = sum("nccl" in e.get("name", "").lower() for e in kernels)
    busy_ms = sum(e.get("dur", 0) for e in kernels) / 1e3
    gpu = (
        f"{len(kernels):,} CUDA kernels ({nccl} NCCL), {busy_ms:.1f} ms of kernel time"
        if kernels
        else "no CUDA kernels (a CPU run)"
    )
    return f"summary: day27 profile of {target}: {path}, {len(events):,} events, {gpu}"


def wrapped_line(lesson: int, run: str, trace_dir: str, active_step: int) -> list[str]:
    """A registered CPU launch line with this wrapper inserted before its module."""
    from dtl import registry

    lessons = {x.day: x for x in registry.load()}
    if lesson not in lessons:
        raise dtl_config.ConfigError(f"no lesson for day {lesson}")
    runs = {r.name: r for r in lessons[lesson].runs}
    if run not in runs:
        raise dtl_config.ConfigError(f"day {lesson} has no run '{run}'; one of {', '.join(runs)}")
    words = shlex.split(runs[run].cpu)
    i = words.index("-m")
    module = words[i + 1]
    return [
        *words[:i],
        "-m",
        "day27_profiling.profile",
        f"--target={module}",
        f"--trace_dir={trace_dir}",
        f"--active_step={active_step}",
        "--",
        *words[i + 2 :],
    ]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    cfg = dtl_config.parse(Config, argv[:split])
    if cfg.target:
        profile_module(cfg, argv[split + 1 :])
        return
    try:
        line = wrapped_line(cfg.lesson, cfg.run, cfg.trace_dir, cfg.active_step)
    except dtl_config.ConfigError as e:
        dtl_config.exit_with_error(e)  # one line, exit 2
    print("running: " + " ".join(shlex.quote(w) for w in line), flush=True)
    print(
        "with Nsight Systems (GPU machines): nsys profile --trace=cuda,nvtx,osrt "
        f"--output={cfg.trace_dir}/nsys " + " ".join(shlex.quote(w) for w in line),
        flush=True,
    )
    line[0] = "torch.distributed.run" if line[0] == "torchrun" else line[0]
    code = subprocess.run([sys.executable, "-m", *line]).returncode
    print(f"traces: {cfg.trace_dir}/rank<R>.json (exit {code})", flush=True)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
