"""The time-boxed GPU check: the GPU lines that matter most, first, inside a budget.

    python -m dtl.tour --gpu-check --budget_s=480            # run it (make gpu-check)
    python -m dtl.tour --gpu-check --budget_s=480 --dry-run  # print the plan, run nothing

The plan is `[[gpu_check]]` in lessons.toml: registry runs by day and name, in order of value,
each with its estimated seconds on one GPU (start-up included), the overrides that size it for
one GPU, and the packages it needs. A line whose estimate no longer fits what is left of the
budget is not started (SKIP, with the reason), and a started line is stopped at what is left, so
the check never runs past its budget. Everything lands in one folder (default
outputs/gpu_check/): each line's full output, env.txt (torch, CUDA, NCCL, the GPUs) and
summary.md, the table below. That folder is all a short GPU slot needs to bring back.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import subprocess
import time
import tomllib
from dataclasses import dataclass, field

from dtl import registry


@dataclass
class CheckLine:
    day: int
    run: str  # a run name of that day in lessons.toml
    estimate_s: int  # seconds on one GPU, start-up included
    why: str  # what the line shows that no CPU run can
    args: str = ""  # overrides appended to the GPU line (they size it for the check)
    needs: list[str] = field(default_factory=list)  # importable modules it needs (deepspeed)


@dataclass
class Planned:
    check: CheckLine
    lesson: registry.Lesson
    run: registry.Run

    @property
    def line(self) -> str:
        return f"{self.run.gpu} {self.check.args}".strip()


def load_plan(path: str = registry.REGISTRY) -> list[Planned]:
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("gpu_check", [])
    runs = {(x.day, r.name): (x, r) for x in registry.load(path) for r in x.runs}
    plan = []
    for entry in entries:
        check = CheckLine(**entry)
        if (check.day, check.run) not in runs:
            raise ValueError(f"lessons.toml gpu_check: no run '{check.run}' on day {check.day}")
        if check.estimate_s < 1:
            raise ValueError(f"lessons.toml gpu_check {check.run}: estimate_s must be >= 1")
        plan.append(Planned(check, *runs[(check.day, check.run)]))
    return plan


def fits(plan: list[Planned], budget_s: float) -> list[bool]:
    """Which lines fit if every line takes its estimate (a line that does not fit is skipped,
    and the ones after it may still fit)."""
    used, out = 0.0, []
    for p in plan:
        ok = used + p.check.estimate_s <= budget_s
        used += p.check.estimate_s if ok else 0
        out.append(ok)
    return out


def plan_table(plan: list[Planned], budget_s: float) -> str:
    rows = [f"gpu check plan: {len(plan)} lines, budget {budget_s:.0f} s"]
    rows.append(f"{'#':>2}  {'day':<4}{'run':<16}{'est.':>6}{'total':>7}  fits  line")
    total = 0
    for i, (p, ok) in enumerate(zip(plan, fits(plan, budget_s)), 1):
        total += p.check.estimate_s if ok else 0
        mark = "yes" if ok else "no "
        rows.append(
            f"{i:>2}  {p.lesson.day:<4}{p.run.name:<16}{p.check.estimate_s:>5}s{total:>6}s"
            f"  {mark}   {p.line}"
        )
        rows.append(f"{'':>36}{p.check.why}")
    fitting = sum(fits(plan, budget_s))
    rows.append(
        f"gpu check plan: {fitting} of {len(plan)} lines fit, {total} s estimated of "
        f"{budget_s:.0f} s"
    )
    return "\n".join(rows)


def environment() -> str:
    """What the results depend on: Python, torch, CUDA, NCCL, the GPUs, the libraries."""
    import torch

    lines = [f"python {platform.python_version()} ({platform.platform()})"]
    lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        lines.append(f"NCCL {nccl}, {torch.cuda.device_count()} GPU(s):")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gib, sms = p.total_memory / 2**30, p.multi_processor_count
            lines.append(f"  cuda:{i} {p.name}, {gib:.0f} GiB, {sms} SMs")
    else:
        lines.append("no CUDA GPU visible")
    for name in ("deepspeed", "megatron.core", "numpy", "tensorboard"):
        spec = importlib.util.find_spec(name.split(".")[0])
        lines.append(f"{name}: {_version(name) if spec else 'not installed'}")
    smi = _command(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"])
    lines.append(f"nvidia-smi: {smi}")
    return "\n".join(lines)


def _version(name: str) -> str:
    from importlib import metadata

    dist = {"megatron.core": "megatron-core"}.get(name, name)
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "installed (version unknown)"


def _command(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return " | ".join(out.stdout.strip().splitlines()) or out.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not available ({e.__class__.__name__})"


def _missing(needs: list[str]) -> list[str]:
    return [m for m in needs if importlib.util.find_spec(m) is None]


def run_plan(
    plan: list[Planned], budget_s: float, out_dir: str, n_gpus: int
) -> list[tuple[Planned, registry.Result]]:
    """Run the plan in order inside the budget; returns (Planned, Result) pairs."""
    os.makedirs(out_dir, exist_ok=True)
    start, results = time.monotonic(), []
    for i, p in enumerate(plan, 1):
        left = budget_s - (time.monotonic() - start)
        result = _skip_reason(p, left, n_gpus)
        if result is None:
            print(
                f"  gpu check {i}/{len(plan)} day {p.lesson.day} {p.run.name}: {p.line}", flush=True
            )
            # a line may overrun its estimate (twice it, or a minute more), never the budget
            cap = min(left, max(2 * p.check.estimate_s, p.check.estimate_s + 60))
            run = dataclasses.replace(p.run, timeout_s=int(max(1, cap)), gpu_timeout_s=None)
            result = registry.execute(p.lesson, run, gpu=True, extra_args=p.check.args)
        else:
            print(
                f"  gpu check {i}/{len(plan)} day {p.lesson.day} {p.run.name}: "
                f"SKIP ({result.skip_reason})",
                flush=True,
            )
        name = f"{i:02d}-day{p.lesson.day}-{p.run.name}.log"
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(f"$ {p.line}\n{result.output}")
        results.append((p, result))
    return results


def _skip_reason(p: Planned, left: float, n_gpus: int) -> registry.Result | None:
    if p.run.min_gpus > n_gpus:
        return registry.skipped(
            p.lesson, p.run, f"needs {p.run.min_gpus} GPU(s), this machine has {n_gpus}"
        )
    if missing := _missing(p.check.needs):
        return registry.skipped(p.lesson, p.run, f"{', '.join(missing)} not installed")
    if p.check.estimate_s > left:
        return registry.skipped(
            p.lesson, p.run, f"budget: ~{p.check.estimate_s} s estimated, {left:.0f} s left"
        )
    return None


def summary(results: list[tuple[Planned, registry.Result]], budget_s: float, seconds: float) -> str:
    rows = [
        f"# GPU check: {sum(r.status == 'PASS' for _, r in results)} passed, "
        f"{sum(r.status == 'FAIL' for _, r in results)} failed, "
        f"{sum(r.status == 'SKIP' for _, r in results)} skipped in {seconds:.0f} s "
        f"(budget {budget_s:.0f} s)",
        "",
        "| # | day | run | result | est. s | wall s | summary lines |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (p, r) in enumerate(results, 1):
        lines = r.summary_lines()
        if r.status == "FAIL":
            lines = lines + [f"exit {r.returncode}, missing {r.missing}"]
        shown = "<br>".join(s.removeprefix("summary:").strip().replace("|", "/") for s in lines)
        rows.append(
            f"| {i} | {p.lesson.day} | {p.run.name} | {r.status} | {p.check.estimate_s} | "
            f"{r.seconds:.0f} | {shown} |"
        )
    return "\n".join(rows)


def main(budget_s: float, dry_run: bool, out_dir: str, n_gpus: int) -> int:
    plan = load_plan()
    print(plan_table(plan, budget_s))
    if dry_run:
        return 0
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    print(env)
    with open(os.path.join(out_dir, "env.txt"), "w") as f:
        f.write(env + "\n")
    with open(os.path.join(out_dir, "plan.txt"), "w") as f:
        f.write(plan_table(plan, budget_s) + "\n")
    start = time.monotonic()
    results = run_plan(plan, budget_s, out_dir, n_gpus)
    text = summary(results, budget_s, time.monotonic() - start)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"gpu check: every output is in {out_dir}/")
    return 1 if any(r.status == "FAIL" for _, r in results) else 0
