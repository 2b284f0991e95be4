"""Day 27: one step of a lesson's GPU run in Nsight Systems, exported to SQLite, cut on the device.

    torchrun --standalone --nproc_per_node=1 -m day27_profiling.nsys \
        --lesson=17 --run_name=train-bucket

Three commands, each printed before it runs:

1. capture: the lesson's registered GPU line, every rank under its own `nsys profile` (torchrun
   --no-python starts nsys, nsys starts python), profile.py choosing the step:

       torchrun --standalone --nproc_per_node=gpu --no-python \\
         nsys profile --trace=cuda,nvtx,osrt --capture-range=cudaProfilerApi \\
           --capture-range-end=stop --force-overwrite=true \\
           --output=outputs/day27_profiling/nsys/rank%q{RANK} \\
         python -m day27_profiling.profile --target=day17_ddp.train --profiler=nsys ... -- \\
           --sync=bucket --config day17_ddp/gpu.toml --profile_step=-1

   --trace: CUDA API and kernels, NVTX ranges (the lessons' dtl.profile ranges), OS runtime
   calls. --capture-range=cudaProfilerApi: record only between cudaProfilerStart and Stop, which
   profile.py calls around step `active_step`; --capture-range-end=stop: then stop recording
   and let the run finish. %q{RANK}: nsys puts the rank (torchrun's RANK) in the file name.
2. export, per rank: nsys export --type=sqlite --force-overwrite=true --output=rankR.sqlite
   rankR.nsys-rep
3. read: nsys_sqlite.py cuts each rank's `capture` window into compute, comm and idle.

Why one nsys per rank rather than `nsys profile torchrun ...`: each rank's capture range is its
own step, and each report holds one process. Why no torch.profiler: see profile.py (CUPTI takes
one subscriber). Without a GPU run or without nsys on PATH it prints the commands and a
`skipped:` line (exit 0). Not run on a GPU.
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Annotated

from day27_profiling import nsys_sqlite
from day27_profiling.profile import wrapped_line
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import profile as dtl_profile
from dtl.registry import child_env

# the `nsys profile` switches of the capture (Nsight Systems User Guide, "CLI Profile Command
# Switch Options"); the output file comes after them
NSYS_PROFILE_FLAGS = [
    "--trace=cuda,nvtx,osrt",
    "--capture-range=cudaProfilerApi",
    "--capture-range-end=stop",
    "--force-overwrite=true",
]
# ranges each rank's report must hold by name (dtl.profile.range in the lessons)
EXPECTED_RANGES = {
    "day17_ddp.train": [
        dtl_profile.CAPTURE,
        dtl_profile.STEP,
        dtl_profile.FORWARD,
        dtl_profile.BACKWARD,
        dtl_profile.OPTIMIZER,
        dtl_profile.comm_name("all_reduce", "bucket 0"),
        dtl_profile.comm_name("all_reduce", wait=True),
    ],
}


@dataclass
class Config:
    lesson: int = 17  # the registered lesson whose GPU line is captured ...
    # ... and its run (not --run: torchrun's parser would take it for its own --run-path)
    run_name: str = "train-bucket"
    args: str = "--profile_step=-1"  # appended to its line (day 17: its own torch.profiler off)
    active_step: Annotated[int, dtl_config.NON_NEGATIVE] = 2  # steps run before the captured one
    out_dir: str = "outputs/day27_profiling/nsys"  # rank<R>.nsys-rep and rank<R>.sqlite
    nsys: str = "nsys"  # the Nsight Systems CLI: a name on PATH or a path


def capture_line(cfg: Config) -> list[str]:
    """The lesson's GPU line with one `nsys profile` per rank and profile.py in nsys mode."""
    words = wrapped_line(
        cfg.lesson, cfg.run_name, cfg.out_dir, cfg.active_step, gpu=True, extra=["--profiler=nsys"]
    )
    words += shlex.split(cfg.args)
    i = words.index("-m")  # torchrun and its options before it, the program from it on
    output = f"--output={os.path.join(cfg.out_dir, 'rank%q{RANK}')}"
    nsys = [cfg.nsys, "profile", *NSYS_PROFILE_FLAGS, output]
    return [*words[:i], "--no-python", *nsys, "python", *words[i:]]


def export_line(cfg: Config, report: str) -> list[str]:
    """nsys export of one .nsys-rep to SQLite, beside it."""
    out = report.removesuffix(".nsys-rep") + ".sqlite"
    return [
        cfg.nsys,
        "export",
        "--type=sqlite",
        "--force-overwrite=true",
        f"--output={out}",
        report,
    ]


def _show(words: list[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def _why_not(cfg: Config) -> str | None:
    """Why the capture cannot run here, or None."""
    missing = [] if shutil.which(cfg.nsys) else [f"'{cfg.nsys}' not on PATH (Nsight Systems CLI)"]
    try:
        gpu = dtl_dist.choose_backend(1) == "nccl"
    except dtl_dist.BackendError:
        gpu = False
    if not gpu:
        missing.insert(0, "no GPU run here (dtl.dist's rule: gloo)")
    return "; ".join(missing) or None


def capture(cfg: Config, line: list[str]) -> list[str]:
    """Run the capture line, then export every rank's report; returns the SQLite files."""
    for old in glob.glob(os.path.join(cfg.out_dir, "rank*.nsys-rep")):
        os.remove(old)  # a report of an earlier, wider run must not be read as this one's
    run = [*line]
    run[0:1] = [sys.executable, "-m", "torch.distributed.run"]  # torchrun, this interpreter's
    run[run.index("python")] = sys.executable
    proc = subprocess.run(run, env=child_env(), timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"error: the capture exited {proc.returncode}")
    sqlite = []
    for report in sorted(glob.glob(os.path.join(cfg.out_dir, "rank*.nsys-rep"))):
        export = export_line(cfg, report)
        print("export: " + _show(export), flush=True)
        subprocess.run(export, check=True, timeout=300)
        sqlite.append(report.removesuffix(".nsys-rep") + ".sqlite")
    return sqlite


def read_reports(target: str, paths: list[str]) -> str:
    """Print each rank's cut; the summary line."""
    want = EXPECTED_RANGES.get(target, [dtl_profile.CAPTURE])
    parts, named = [], True
    for path in paths:
        procs = nsys_sqlite.read(path)
        for line in nsys_sqlite.describe(path):
            print(f"{os.path.basename(path)}: {line}")
        names = {text for p in procs.values() for _, _, text in p.ranges}
        missing = [n for n in want if n not in names]
        named = named and not missing
        if missing:
            print(f"{os.path.basename(path)}: ranges missing: {', '.join(missing)}")
        kernels = [k for p in procs.values() for k in p.kernels]
        nccl = sum(dtl_profile.is_nccl_kernel(name) for _, _, name in kernels)
        parts.append(f"{len(kernels):,} kernels ({nccl:,} NCCL)")
    cuts = [b for path in paths for b in nsys_sqlite.breakdowns(path).values()]
    first = cuts[0].line() if cuts else "no window"
    return (
        f"summary: day27 nsys {target}: {len(paths)} ranks, {'; '.join(parts)}; rank 0 {first}; "
        f"ranges {', '.join(want)} {'yes' if named and paths else 'NO'}"
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    if dtl_dist.launch_world_size() != 1:
        dtl_config.exit_with_error("nsys.py runs as one process (--nproc_per_node=1)")
    try:
        line = capture_line(cfg)
    except dtl_config.ConfigError as e:
        dtl_config.exit_with_error(e)
    target = line[line.index("-m") + 2].removeprefix("--target=")
    out = cfg.out_dir
    print("capture: " + _show(line), flush=True)
    print("export: " + _show(export_line(cfg, os.path.join(out, "rank0.nsys-rep"))), flush=True)
    print(f"read: python -m day27_profiling.nsys_sqlite {os.path.join(out, 'rank0.sqlite')}")
    reason = _why_not(cfg)
    if reason:
        print(f"skipped: Nsight Systems capture needs a GPU run and nsys: {reason}", flush=True)
        return
    os.makedirs(out, exist_ok=True)
    print(read_reports(target, capture(cfg, line)), flush=True)


if __name__ == "__main__":
    main()
