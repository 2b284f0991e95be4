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

CPU: host ops (aten::..., autograd::...) on the calling thread, gloo's work on its own threads,
and the lessons' named ranges (dtl.profile.range: step, forward, backward, optimizer.step, the
hand-written collectives, the pipeline actions). CUDA: kernels and NCCL kernels on their streams
too (the CUDA activity only for a run on GPUs, by dtl.dist's rule; a gloo run has no kernels).

Under Nsight Systems (--profiler=nsys, or auto: nsys sets NSYS_PROFILING_SESSION_ID) there is no
torch.profiler at all: torch.profiler's CUDA activity and nsys both subscribe to CUPTI, which
takes one subscriber, and emit_nvtx inside torch.profiler fails ("Profiler is already enabled on
this thread", pytorch issue 44881). Instead NsysWindow calls cudaProfilerStart as the lesson's
`step` range number `active_step` opens and cudaProfilerStop as it closes (dtl.profile.watch_steps;
the optimizer hook's window for a lesson without `step` ranges), for `nsys profile
--capture-range=cudaProfilerApi`, and opens the NVTX range `capture` over it: the window
nsys_sqlite.py cuts. The lessons' NVTX ranges name everything inside. nsys.py builds and runs
the whole line, one report per rank.
A lesson that runs its own profiler must turn it off (day 17: --profile_step=-1): torch allows
one profiler at a time, and none may run under nsys.
"""

from __future__ import annotations

import json
import os
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

import torch

from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import profile as dtl_profile


@dataclass
class Config:
    target: str = ""  # the module to run as __main__ (e.g. day17_ddp.train); args after --
    lesson: int = 0  # or: a registered lesson's day ...
    run: str = ""  # ... and the name of its run: its CPU line is wrapped and run
    active_step: int = 2  # optimizer steps run before the one that is traced
    trace_dir: str = "outputs/day27_profiling/traces"  # rank<R>.json
    # torch: torch.profiler, a trace per rank | nsys: cudaProfilerStart/Stop for Nsight Systems
    # (a GPU run) | auto: nsys when run under nsys (NSYS_PROFILING_SESSION_ID), else torch
    profiler: Literal["auto", "torch", "nsys"] = "auto"

    def validate(self) -> None:
        if bool(self.target) == bool(self.lesson):
            raise dtl_config.ConfigError("give either --target=<module> or --lesson=<day> --run=")
        if self.profiler == "auto":
            self.profiler = "nsys" if os.environ.get(NSYS_SESSION) else "torch"
        if self.profiler == "nsys" and self.target and not run_on_gpu():
            raise dtl_config.ConfigError(
                "profiler nsys captures CUDA work, and this run computes on the CPU (gloo, by "
                "dtl.dist's rule); use --profiler=torch"
            )


NSYS_SESSION = "NSYS_PROFILING_SESSION_ID"  # set by `nsys profile` in the processes it records


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


class NsysWindow:
    """Hands Nsight Systems one step: cudaProfilerStart before it, cudaProfilerStop after it, and
    the NVTX range `capture` (start/end: it may span push/pop ranges) over it. The step is the
    lesson's own `step` range number `active_step` (dtl.profile.watch_steps); a lesson that marks
    no step range gets torch.profiler's window instead, from the end of optimizer step
    `active_step` to the end of the next (the optimizer post-hook). The device is synchronized
    at both ends, so the step's kernels, and only they, run inside."""

    def __init__(self, active_step: int):
        self.active_step, self.handle, self.captured = active_step, None, False
        self.ranges = self.steps = 0  # `step` ranges opened; optimizer steps done
        self.by_range = False  # the lesson marks its steps: capture by range, not by hook

    def step_range(self, entering: bool) -> None:  # dtl.profile.watch_steps
        self.by_range = True
        if entering:
            if self.ranges == self.active_step:
                self.open()
            self.ranges += 1
        elif self.ranges == self.active_step + 1:
            self.close()

    def __call__(self, *hook_args) -> None:  # the optimizer post-hook
        self.steps += 1
        if self.by_range:
            return
        if self.steps == self.active_step:
            self.open()
        elif self.steps == self.active_step + 1:
            self.close()

    def open(self) -> None:
        if self.handle is not None or self.captured:
            return
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        self.handle = torch.cuda.nvtx.range_start(dtl_profile.CAPTURE)

    def close(self) -> None:
        if self.handle is None:
            return
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_end(self.handle)
        torch.cuda.profiler.stop()
        self.handle, self.captured = None, True


def profile_module(cfg: Config, target_argv: list[str]) -> None:
    """Run `cfg.target` as __main__ under torch.profiler (trace step `active_step`), or under
    Nsight Systems with that step between cudaProfilerStart and cudaProfilerStop."""
    if cfg.profiler == "nsys":
        capture_module(cfg, target_argv)
        return
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
        with prof:
            runpy.run_module(cfg.target, run_name="__main__", alter_sys=True)
    finally:
        hook.remove()
    if rank == 0:
        print(trace_summary(cfg.target, path), flush=True)


def capture_module(cfg: Config, target_argv: list[str]) -> None:
    """Run `cfg.target` as __main__ with no torch.profiler: NsysWindow hands Nsight Systems one
    step (`nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop`)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    window = NsysWindow(cfg.active_step)
    hook = register_optimizer_step_post_hook(window)
    unwatch = dtl_profile.watch_steps(window.step_range)
    sys.argv = [cfg.target, *target_argv]
    try:
        runpy.run_module(cfg.target, run_name="__main__", alter_sys=True)
    finally:
        hook.remove()
        unwatch()
        window.close()  # a run that ended inside the window: stop the capture there
    if int(os.environ.get("RANK", "0")) == 0:
        print(capture_summary(cfg.target, window), flush=True)


def capture_summary(target: str, window: NsysWindow) -> str:
    by = "its `step` range" if window.by_range else "optimizer steps (no `step` range)"
    what = (
        f"step {window.active_step} by {by} between cudaProfilerStart and cudaProfilerStop, "
        f"NVTX range '{dtl_profile.CAPTURE}' over it"
        if window.captured
        else f"nothing captured ({max(window.ranges, window.steps)} steps, fewer than asked)"
    )
    return f"summary: day27 nsys capture of {target}: {what}"


def trace_summary(target: str, path: str) -> str:
    """One line on what rank 0's trace holds: its events, and the GPU's kernels by kind."""
    if not os.path.exists(path):
        return (
            f"summary: day27 profile of {target}: no trace written (fewer than active_step steps?)"
        )
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    nccl = sum(dtl_profile.is_nccl_kernel(e.get("name", "")) for e in kernels)
    busy_ms = sum(e.get("dur", 0) for e in kernels) / 1e3
    gpu = "no CUDA kernels (a CPU run)"
    if kernels:  # the traced step on the device's clock (trace_analysis.device_cut)
        from day27_profiling import trace_analysis

        cut = trace_analysis.breakdown(path).line()
        gpu = f"{len(kernels):,} CUDA kernels ({nccl} NCCL), {busy_ms:.1f} ms of kernel time; {cut}"
    return f"summary: day27 profile of {target}: {path}, {len(events):,} events, {gpu}"


def wrapped_line(
    lesson: int, run: str, trace_dir: str, active_step: int, gpu: bool = False, extra=()
) -> list[str]:
    """A registered launch line (CPU, or with `gpu` the GPU one) with this wrapper inserted
    before its module; `extra` words go after the wrapper's own (e.g. --profiler=nsys)."""
    from dtl import registry

    lessons = {x.day: x for x in registry.load()}
    if lesson not in lessons:
        raise dtl_config.ConfigError(f"no lesson for day {lesson}")
    runs = {r.name: r for r in lessons[lesson].runs}
    if run not in runs:
        raise dtl_config.ConfigError(f"day {lesson} has no run '{run}'; one of {', '.join(runs)}")
    words = shlex.split(runs[run].gpu if gpu else runs[run].cpu)
    i = words.index("-m")
    module = words[i + 1]
    return [
        *words[:i],
        "-m",
        "day27_profiling.profile",
        f"--target={module}",
        f"--trace_dir={trace_dir}",
        f"--active_step={active_step}",
        *extra,
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
        "with Nsight Systems (GPU machines), one report per rank: python -m day27_profiling.nsys "
        f"--lesson={cfg.lesson} --run_name={cfg.run}",
        flush=True,
    )
    line[0] = "torch.distributed.run" if line[0] == "torchrun" else line[0]
    code = subprocess.run([sys.executable, "-m", *line]).returncode
    print(f"traces: {cfg.trace_dir}/rank<R>.json (exit {code})", flush=True)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
