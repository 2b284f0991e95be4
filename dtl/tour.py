"""`make tour`: run every lesson's launch line in order and print one table.

    python -m dtl.tour              # CPU lines (gloo), or GPU lines when >= 2 GPUs are visible
    python -m dtl.tour --day 15     # one day
    python -m dtl.tour --cpu        # force the CPU lines

Each run's full output is kept in outputs/tour/<day>-<run>.log.
"""

from __future__ import annotations

import argparse
import os
import textwrap
import time

import torch

from dtl import registry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--day", type=int, action="append", help="only these days")
    parser.add_argument("--cpu", action="store_true", help="CPU launch lines even with GPUs")
    parser.add_argument("--benchmarks", action="store_true", help="also the long benchmark runs")
    args = parser.parse_args(argv)
    gpu = not args.cpu and torch.cuda.device_count() >= 2
    lessons = [x for x in registry.load() if not args.day or x.day in args.day]
    if not lessons:
        raise SystemExit(f"error: no lesson for day(s) {args.day} in lessons.toml")
    log_dir = os.path.join(registry.REPO_ROOT, "outputs", "tour")
    os.makedirs(log_dir, exist_ok=True)
    runs = [(x, r) for x in lessons for r in x.runs if args.benchmarks or r.kind == "lesson"]
    skipped = sum(len(x.runs) for x in lessons) - len(runs)
    print(
        f"tour: {len(runs)} runs, {'GPU' if gpu else 'CPU'} launch lines"
        + (f" ({skipped} benchmarks skipped: --benchmarks runs them)" if skipped else "")
    )
    results, start = [], time.monotonic()
    for lesson, run in runs:
        print(f"  day {lesson.day} {run.name}: {run.gpu if gpu else run.cpu}", flush=True)
        result = registry.execute(lesson, run, gpu=gpu)
        with open(os.path.join(log_dir, f"day{lesson.day}-{run.name}.log"), "w") as f:
            f.write(result.output)
        if not result.ok:
            tail = "\n".join(result.output.splitlines()[-15:])
            print(
                textwrap.indent(
                    f"FAILED (exit {result.returncode}, missing {result.missing})\n{tail}",
                    "    ",
                )
            )
        results.append(result)
    print(table(results))
    failed = sum(not r.ok for r in results)
    print(
        f"tour: {len(results) - failed} passed, {failed} failed in {time.monotonic() - start:.0f} s"
        f" (logs in outputs/tour/)"
    )
    return 1 if failed else 0


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
            tail = f"{r.seconds:>5.0f}s  {'PASS' if r.ok else 'FAIL'}" if i == 0 else ""
            rows.append(f"{head} {text:<{WIDTH}} {tail}".rstrip())
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
