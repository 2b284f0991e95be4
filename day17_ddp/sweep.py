"""Day 17 benchmark: 4 sync modes, bucket caps, find_unused_parameters, gradient_as_bucket_view.

Not a test: timings on a shared 2-core box are noisy, so every row is a median and the
hand-written/DDP ratio a median over repeated, interleaved runs. Each part takes ~2 minutes:
    torchrun --standalone --nproc_per_node=2 -m day17_ddp.sweep --part=sweep
    torchrun --standalone --nproc_per_node=2 -m day17_ddp.sweep --part=ratio --repeats=6
GPUs: torchrun --standalone --nproc_per_node=gpu -m day17_ddp.sweep --part=sweep --batch_size=16
Writes outputs/day17_ddp/sweep/{sweep.csv, sweep.png, ratio.csv} and prints one table.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass
from typing import Literal

from day17_ddp import observe, train
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.data import load_corpus, tokenizer_for
from dtl.metrics import write_csv
from dtl.model import preset
from dtl.profile import StepTimes
from dtl.reference import replica_gap

# (row name, overrides of train.Config): every sync mode at the defaults (1 MiB first bucket,
# 25 MiB cap), then DDP-style caps (bucket_cap_mb=X sets the first bucket to X too), then DDP's
# two switches, then the untied lm_head whose 25 MiB gradient is ready first instead of last.
ROWS = [
    ("naive", dict(sync="naive")),
    ("overlap", dict(sync="overlap")),
    ("bucket", dict(sync="bucket")),
    ("ddp", dict(sync="ddp")),
    ("bucket cap=1", dict(sync="bucket", bucket_cap_mb=1.0, first_bucket_mb=1.0)),
    ("ddp cap=1", dict(sync="ddp", bucket_cap_mb=1.0, first_bucket_mb=1.0)),
    ("bucket cap=5", dict(sync="bucket", bucket_cap_mb=5.0, first_bucket_mb=5.0)),
    ("ddp cap=5", dict(sync="ddp", bucket_cap_mb=5.0, first_bucket_mb=5.0)),
    ("bucket cap=100", dict(sync="bucket", bucket_cap_mb=100.0, first_bucket_mb=100.0)),
    ("ddp cap=100", dict(sync="ddp", bucket_cap_mb=100.0, first_bucket_mb=100.0)),
    ("ddp find_unused", dict(sync="ddp", find_unused_parameters=True)),
    ("ddp grad_as_view", dict(sync="ddp", gradient_as_bucket_view=True)),
    ("bucket untied", dict(sync="bucket", tie_weights=False)),
    ("ddp untied", dict(sync="ddp", tie_weights=False)),
]
COLUMNS = [
    "row",
    "buckets",
    "step_ms",
    "forward_ms",
    "backward_ms",
    "blocked_ms",
    "comm_ms",
    "overlap",
]


@dataclass
class SweepConfig:
    part: Literal["sweep", "ratio"] = "sweep"  # sweep | ratio
    model: str = "small"  # GPT preset
    batch_size: int = 4  # sequences per rank per step
    seq_len: int = 64  # tokens per sequence
    steps: int = 8  # per row; the first `warmup` are left out of the medians
    warmup: int = 2  # steps left out of the medians
    repeats: int = 2  # rounds: every row (sweep) or the bucket/ddp pair (ratio) this many times
    out_dir: str = "outputs/day17_ddp/sweep"  # CSV, PNG and logs

    def validate(self) -> None:
        if self.steps <= self.warmup or self.repeats < 1:
            raise dtl_config.ConfigError("need steps > warmup and repeats >= 1")


def measure(scfg: SweepConfig, tokens, info, **overrides) -> dict:
    """Median timings of one configuration over the steps after warmup (no profiler)."""
    cfg = train.Config(
        model=scfg.model,
        batch_size=scfg.batch_size,
        seq_len=scfg.seq_len,
        steps=scfg.steps,
        warmup=scfg.warmup,
        profile_step=-1,
        **overrides,
    )
    gpt, model, opt = train.build(cfg, info)
    times = [train.train_step(model, opt, tokens, cfg, s, info)[0] for s in range(cfg.steps)]
    med = asdict(StepTimes.median(times[cfg.warmup :]))
    sizes, _ = observe.bucket_layout(model, train._param_names(gpt))
    return dict(med, buckets=len(sizes), gap=replica_gap(gpt))


def run_sweep(scfg: SweepConfig, tokens, info) -> list[dict]:
    """Every row `repeats` times, in rounds (row order repeats), then per-row medians."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in ROWS}
    for r in range(scfg.repeats):
        for name, overrides in ROWS:
            runs[name].append(dict(measure(scfg, tokens, info, **overrides), row=name))
            dtl_dist.print0(f"{format_row(runs[name][-1])}   (round {r})")
    table = []
    for name, results in runs.items():
        row = {k: statistics.median(x[k] for x in results) for k in results[0] if k != "row"}
        table.append(dict(row, row=name, gap=max(x["gap"] for x in results)))
    dtl_dist.print0(f"medians over {scfg.repeats} rounds:\n{HEADER}")
    for row in table:
        dtl_dist.print0(format_row(row))
    return table


def run_ratio(scfg: SweepConfig, tokens, info) -> list[dict]:
    """bucket and ddp, interleaved so that background load hits both alike."""
    runs = []
    for r in range(scfg.repeats):
        for sync in ("bucket", "ddp"):
            runs.append(dict(measure(scfg, tokens, info, sync=sync), row=f"{sync} #{r}"))
            dtl_dist.print0(format_row(runs[-1]))
    return runs


def format_row(row: dict) -> str:
    return (
        f"{row['row']:<18}{int(row['buckets']):>8}{row['step_ms']:>9.0f}{row['forward_ms']:>8.0f}"
        f"{row['backward_ms']:>13.0f}{row['blocked_ms']:>10.0f}{row['comm_ms']:>9.0f}"
        f"{row['overlap']:>9.0%}"
    )


HEADER = (
    f"{'row':<18}{'buckets':>8}{'step ms':>9}{'fwd':>8}{'bwd compute':>13}{'blocked':>10}"
    f"{'comm':>9}{'win ovl':>9}"
)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.38 * len(rows) + 1.2))
    names = [r["row"] for r in rows][::-1]
    left = [0.0] * len(rows)
    parts = [
        ("forward_ms", "forward", "tab:blue"),
        ("backward_ms", "backward compute", "tab:orange"),
        ("blocked_ms", "blocked on comm", "tab:red"),
    ]
    for key, label, color in parts:
        widths = [r[key] for r in rows][::-1]
        ax.barh(names, widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths)]
    other = [r["step_ms"] for r in rows][::-1]
    ax.barh(
        names,
        [max(0.0, s - a) for s, a in zip(other, left)],
        left=left,
        color="tab:gray",
        label="optimizer + rest",
    )
    ax.set_xlabel("ms per step (median)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_summary(runs: list[dict]) -> str:
    bucket = [r["step_ms"] for r in runs if r["row"].startswith("bucket")]
    ddp = [r["step_ms"] for r in runs if r["row"].startswith("ddp")]
    pairs = sorted(b / d for b, d in zip(bucket, ddp))
    ratio = statistics.median(bucket) / statistics.median(ddp)
    return (
        f"summary: day17 bucket/DDP step time {ratio:.2f} (target <= 1.15): median "
        f"{statistics.median(bucket):.0f} vs {statistics.median(ddp):.0f} ms over {len(ddp)} "
        f"interleaved runs each; per-pair ratios {', '.join(f'{p:.2f}' for p in pairs)}"
    )


def main(argv: list[str] | None = None) -> None:
    scfg = dtl_config.parse(SweepConfig, argv)
    info = dtl_dist.init()
    dtl_config.save(scfg, scfg.out_dir, argv)
    corpus = load_corpus(tokenizer=tokenizer_for(preset(scfg.model).vocab_size))
    dtl_dist.print0(
        f"{scfg.part} on {info.world_size} ranks, {scfg.model} GPT, "
        f"{scfg.batch_size}x{scfg.seq_len} tokens per rank\n{HEADER}"
    )
    part = run_sweep if scfg.part == "sweep" else run_ratio
    rows = part(scfg, corpus.train, info)
    bad = [r["row"] for r in rows if r["gap"] != 0]
    if info.is_main:
        write_csv(rows, os.path.join(scfg.out_dir, f"{scfg.part}.csv"), COLUMNS)
        if scfg.part == "sweep":
            plot(
                rows,
                os.path.join(scfg.out_dir, "sweep.png"),
                f"day 17 sweep: {scfg.model} GPT, {info.world_size} ranks ({info.backend})",
            )
    dtl_dist.print0(
        ratio_summary(rows)
        if scfg.part == "ratio"
        else f"summary: day17 sweep {len(rows)} rows, replicas identical in "
        f"{len(rows) - len(bad)}/{len(rows)}"
    )
    dtl_dist.cleanup()
    if bad:
        raise SystemExit(f"replicas differ in {bad}")


if __name__ == "__main__":
    main()
