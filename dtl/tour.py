"""`make tour`: run every lesson's launch line in order and print one table.

    python -m dtl.tour              # CPU lines (gloo), or GPU lines when >= 2 GPUs are visible
    python -m dtl.tour --day 15     # one day
    python -m dtl.tour --cpu        # force the CPU lines
    python -m dtl.tour --gpu-check --budget_s=480 [--dry-run]
                                    # `make gpu-check`: the GPU lines that matter most, first,
                                    # inside a time budget (dtl/gpu_check.py, lessons.toml)
    python -m dtl.tour --gpu-all    # every GPU line on the GPUs present, one included

--gpu-all runs every registered GPU launch line (benchmarks shrunk by their smoke_args) on
however many GPUs this machine has, one included; a line that needs more GPUs than present
(`min_gpus` in lessons.toml) is shown as SKIP with the reason, never as PASS.
Each run's full output is kept in outputs/tour/<day>-<run>.log.
"""

from __future__ import annotations

import argparse
import os
import textwrap
import time

import torch

from dtl import gpu_check, registry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--day", type=int, action="append", help="only these days")
    parser.add_argument("--cpu", action="store_true", help="CPU launch lines even with GPUs")
    parser.add_argument("--benchmarks", action="store_true", help="also the long benchmark runs")
    parser.add_argument(
        "--gpu-check", action="store_true", help="the time-boxed GPU check (lessons.toml plan)"
    )
    parser.add_argument("--budget_s", type=float, default=480, help="the GPU check's budget")
    parser.add_argument("--dry-run", action="store_true", help="print the GPU check's plan only")
    parser.add_argument("--out", default=None, help="the GPU check's folder")
    parser.add_argument(
        "--gpu-all", action="store_true", help="every GPU line on the GPUs present (1 or more)"
    )
    args = parser.parse_args(argv)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.gpu_check:
        out = args.out or os.path.join(registry.REPO_ROOT, "outputs", "gpu_check")
        return gpu_check.main(args.budget_s, args.dry_run, out, n_gpus)
    gpu = args.gpu_all or (not args.cpu and n_gpus >= 2)
    lessons = [x for x in registry.load() if not args.day or x.day in args.day]
    if not lessons:
        raise SystemExit(f"error: no lesson for day(s) {args.day} in lessons.toml")
    log_dir = os.path.join(registry.REPO_ROOT, "outputs", "tour")
    os.makedirs(log_dir, exist_ok=True)
    every = args.benchmarks or args.gpu_all
    runs = [(x, r) for x in lessons for r in x.runs if every or r.kind == "lesson"]
    left_out = sum(len(x.runs) for x in lessons) - len(runs)
    where = f"GPU launch lines on {n_gpus} GPU(s)" if gpu else "CPU launch lines"
    print(
        f"tour: {len(runs)} runs, {where}"
        + (f" ({left_out} benchmarks left out: --benchmarks runs them)" if left_out else "")
    )
    results, start = [], time.monotonic()
    for lesson, run in runs:
        results.append(_run_one(lesson, run, gpu, n_gpus, smoke=args.gpu_all, log_dir=log_dir))
    print(table(results))
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(
        f"tour: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
        f"{time.monotonic() - start:.0f} s (logs in outputs/tour/)"
    )
    return 1 if counts["FAIL"] else 0


def _run_one(
    lesson: registry.Lesson, run: registry.Run, gpu: bool, n_gpus: int, smoke: bool, log_dir: str
) -> registry.Result:
    """One launch line (its output kept in log_dir), or a SKIP when its GPU line needs more GPUs
    than this machine has (nothing runs, and the last real run's log stays)."""
    extra = run.smoke_args if smoke and run.kind == "benchmark" else ""
    line = f"{run.gpu if gpu else run.cpu} {extra}".strip()
    if gpu and run.min_gpus > n_gpus:
        print(f"  day {lesson.day} {run.name}: SKIP (needs {run.min_gpus} GPUs)", flush=True)
        return registry.skipped(
            lesson, run, f"needs {run.min_gpus} GPUs, this machine has {n_gpus}"
        )
    print(f"  day {lesson.day} {run.name}: {line}", flush=True)
    result = registry.execute(lesson, run, gpu=gpu, extra_args=extra)
    with open(os.path.join(log_dir, f"day{lesson.day}-{run.name}.log"), "w") as f:
        f.write(result.output)
    if result.status == "FAIL":
        tail = "\n".join(result.output.splitlines()[-15:])
        print(
            textwrap.indent(
                f"FAILED (exit {result.returncode}, missing {result.missing})\n{tail}", "    "
            )
        )
    return result


WIDTH = 96  # the "what the run showed" column; longer summary lines wrap


def table(results: list[registry.Result]) -> str:
    rows = [f"{'day':<4} {'run':<14} {'what the run showed':<{WIDTH}} {'wall':>6}  result"]
    for r in results:
        shown = r.summary_lines() or ["(no summary line)"]
        texts = [
            w
            for s in shown
            for w in textwrap.wrap(
                s.removeprefix("summary:").strip(), WIDTH, subsequent_indent="  "
            )
        ]
        for i, text in enumerate(texts):
            head = f"{r.lesson.day:<4} {r.run.name:<14}" if i == 0 else " " * 19
            tail = f"{r.seconds:>5.0f}s  {r.status}" if i == 0 else ""
            rows.append(f"{head} {text:<{WIDTH}} {tail}".rstrip())
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
