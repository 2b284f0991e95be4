"""Day 22 sweep: every (tp, pp, dp) layout of the world on one model, measured beside formulas.py;
and (--part=ratio) megatron-core's step time over ours on one layout.

CPU (gloo): ~27 s at 4 ranks, ~53 s at 8 (a benchmark: the tests run it on `tiny`):
    torchrun --standalone --nproc_per_node=4 -m day22_megatron.sweep   # or --nproc_per_node=8
GPUs: torchrun --standalone --nproc_per_node=gpu -m day22_megatron.sweep --model=gpt2-124m \\
        --seq_len=512 --global_batch_size=32

Per layout, with our 4-D stack (stack.py) on the same global batch: parameters, gradients and
Adam state bytes per rank, bytes sent per step along each axis, the pipeline idle time, the
median step time. State and bytes are the largest over ranks (the rank that bounds the layout),
each checked against formulas.py exactly; the bubble is printed beside (p-1)/(m+p-1), not
thresholded (host clocks on shared cores). Then the layout to pick, and why: the fastest here,
and the rule a GPU cluster follows (TP inside a node, PP across nodes, DP outermost), which a
2-core CPU, where every rank shares the same cores and "links" are memory copies, cannot show.
Writes sweep.csv and sweep.png (state, traffic and step time per layout) in out_dir.

--part=ratio --tp=2 --pp=2: train_megatron.py's and train_4d.py's runs on the same layout, model
and batches, alternated `repeats` times; prints median(megatron step) / median(ours) (a ratio:
the CPU's absolute times mean little).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from day22_megatron import formulas, layouts, train_4d
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.grid import ParallelGrid
from dtl.metrics import write_csv
from dtl.model import PresetName

MB = 1e6
AXES = ("tp", "pp", "dp")


@dataclass
class Config:
    # layouts (every layout, ours) | ratio (megatron-core vs ours)
    part: Literal["layouts", "ratio"] = "layouts"
    tp: int = 2  # --part=ratio: the layout both stacks run
    pp: int = 2  # --part=ratio
    repeats: int = 2  # --part=ratio: runs of each, alternated
    model: PresetName = "small"  # GPT preset (`small`: 4 layers, 4 heads, n_embd 128)
    micro_batch_size: int = 1  # sequences per micro-batch
    global_batch_size: int = 8  # sequences per step (m = global / (micro x dp) per DP rank)
    seq_len: int = 128  # tokens per sequence
    steps: int = 3  # optimizer steps per layout (the first is not timed)
    memory_budget_mb: float = 0.0  # per-rank state budget for the pick (0: no limit)
    out_dir: str = ""  # sweep.csv, sweep.png (empty: outputs/day22_megatron/sweep-world<N>)

    def validate(self) -> None:
        if self.steps < 2:
            raise dtl_config.ConfigError("steps must be >= 2: the first step is not timed")
        world = dtl_dist.launch_world_size()
        if self.part == "ratio":
            try:
                lay = layouts.Layout.from_world(world, tp=self.tp, pp=self.pp)
            except layouts.LayoutError as e:
                raise dtl_config.ConfigError(str(e)) from None
            reason = why_not(self, lay)
            if reason:
                raise dtl_config.ConfigError(f"layout {lay.name()}: {reason}")
        self.out_dir = self.out_dir or f"outputs/day22_megatron/sweep-world{world}"


def candidate_layouts(world: int) -> list[layouts.Layout]:
    """Every (tp, pp, dp) whose product is the world, TP-heavy first."""
    out = []
    for tp in (d for d in range(world, 0, -1) if world % d == 0):
        for pp in (d for d in range(world // tp, 0, -1) if (world // tp) % d == 0):
            out.append(layouts.Layout(tp=tp, pp=pp, dp=world // (tp * pp)))
    return out


def why_not(cfg: Config, lay: layouts.Layout) -> str | None:
    try:
        layouts.check(
            lay,
            layouts.padded_preset(cfg.model, 0, layouts.VOCAB_MULTIPLE, lay.tp),
            micro_batch_size=cfg.micro_batch_size,
            global_batch_size=cfg.global_batch_size,
            seq_length=cfg.seq_len,
        )
    except layouts.LayoutError as e:
        return str(e)
    return None


def _max_over_ranks(values: dict[str, float], device) -> dict[str, float]:
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(values, t.tolist()))


def measure(cfg: Config, info, lay: layouts.Layout) -> dict:
    """One layout: a few steps of our stack, then its row of the table."""
    run_cfg = train_4d.Config(
        tp=lay.tp,
        pp=lay.pp,
        model=cfg.model,
        micro_batch_size=cfg.micro_batch_size,
        global_batch_size=cfg.global_batch_size,
        seq_len=cfg.seq_len,
        steps=cfg.steps,
        check=False,
        out_dir=os.path.join(cfg.out_dir, lay.name()),
    )
    grid = ParallelGrid(dp=lay.dp, pp=lay.pp, tp=lay.tp)
    result = train_4d.run(run_cfg, info, grid)
    got = _max_over_ranks({**result["state"], **result["sent"]}, info.device)
    mcfg, m = run_cfg.model_config(), run_cfg.microbatches
    per_stage = [
        {
            **formulas.state_bytes(mcfg, lay, r),
            **formulas.comm_bytes(
                mcfg,
                lay,
                r,
                micro_batch_size=cfg.micro_batch_size,
                microbatches=m,
                seq_len=cfg.seq_len,
            ),
        }
        for r in range(lay.pp)
    ]
    want = {k: max(s[k] for s in per_stage) for k in per_stage[0]}
    idle = statistics.mean(result["idle"][1:]) if result["idle"] else 0.0
    step_s = statistics.median(result["times"][1:])
    row = dict(
        layout=lay.name(),
        tp=lay.tp,
        pp=lay.pp,
        dp=lay.dp,
        microbatches=m,
        state_mb=(got["params"] + got["grads"] + got["optim"]) / MB,
        state_formula_mb=(want["params"] + want["grads"] + want["optim"]) / MB,
        **{f"{a}_mb": got[a] / MB for a in AXES},
        **{f"{a}_formula_mb": want[a] / MB for a in AXES},
        idle=dtl_dist.all_reduce_scalar(idle, average=True),
        bubble_formula=formulas.bubble(lay, m),
        step_ms=dtl_dist.all_reduce_scalar(step_s, average=True) * 1e3,
    )
    row["tokens_per_s"] = cfg.global_batch_size * cfg.seq_len / (row["step_ms"] / 1e3)
    # every rank's own figures against its own stage's formulas (the columns show the maxima)
    row["exact"] = train_4d.measured_vs_formula(run_cfg, grid, result)[1]
    return row


def table(rows: list[dict]) -> str:
    head = (
        f"{'layout':<14}{'m':>3}{'state MB':>10}{'(formula)':>10}{'tp MB':>9}{'pp MB':>9}"
        f"{'dp MB':>9}{'idle':>7}{'bubble':>8}{'step ms':>9}{'tok/s':>9}  = formula"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['layout']:<14}{r['microbatches']:>3}{r['state_mb']:>10.2f}"
            f"{r['state_formula_mb']:>10.2f}{r['tp_mb']:>9.2f}{r['pp_mb']:>9.2f}{r['dp_mb']:>9.2f}"
            f"{r['idle']:>7.2f}{r['bubble_formula']:>8.2f}{r['step_ms']:>9.0f}"
            f"{r['tokens_per_s']:>9,.0f}  {'yes' if r['exact'] else 'NO'}"
        )
    return "\n".join(lines)


def pick(rows: list[dict], budget_mb: float) -> tuple[dict, str]:
    """The fastest measured layout within the memory budget, and the reason in words."""
    fits = [r for r in rows if not budget_mb or r["state_mb"] <= budget_mb]
    if not fits:
        smallest = min(rows, key=lambda r: r["state_mb"])
        return smallest, (
            f"nothing fits {budget_mb:.0f} MB per rank; the smallest state is "
            f"{smallest['layout']} ({smallest['state_mb']:.1f} MB)"
        )
    best = min(fits, key=lambda r: r["step_ms"])
    least = min(fits, key=lambda r: r["tp_mb"] + r["pp_mb"] + r["dp_mb"])
    return best, (
        f"fastest here: {best['layout']} ({best['step_ms']:.0f} ms); least traffic: "
        f"{least['layout']} ({least['tp_mb'] + least['pp_mb'] + least['dp_mb']:.2f} MB/rank)"
    )


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["layout"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].bar(x, [r["state_mb"] for r in rows], color="tab:blue")
    axes[0].set_title("params + grads + Adam state per rank (MB)")
    bottom = [0.0] * len(rows)
    for axis, color in zip(AXES, ("tab:orange", "tab:green", "tab:red")):
        vals = [r[f"{axis}_mb"] for r in rows]
        axes[1].bar(x, vals, bottom=bottom, color=color, label=axis)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[1].set_title("bytes sent per rank per step, by axis (MB)")
    axes[1].legend()
    axes[2].bar(x, [r["step_ms"] for r in rows], color="tab:purple")
    axes[2].set_title("median step (ms)")
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=45, ha="right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_ratio(cfg: Config, info) -> None:
    """megatron-core and our stack, same layout and batches, alternated; the medians' ratio."""
    from day22_megatron import train_megatron

    lay = layouts.Layout.from_world(info.world_size, tp=cfg.tp, pp=cfg.pp)  # checked in validate
    common = dict(
        model=cfg.model,
        micro_batch_size=cfg.micro_batch_size,
        global_batch_size=cfg.global_batch_size,
        check=False,
    )
    theirs = train_megatron.Config(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        seq_length=cfg.seq_len,
        train_iters=cfg.steps,
        out_dir=os.path.join(cfg.out_dir, "megatron"),
        **common,
    )
    ours = train_4d.Config(
        tp=cfg.tp,
        pp=cfg.pp,
        seq_len=cfg.seq_len,
        steps=cfg.steps,
        out_dir=os.path.join(cfg.out_dir, "ours"),
        **common,
    )
    grid = ParallelGrid(dp=lay.dp, pp=lay.pp, tp=lay.tp)
    times = {"megatron": [], "ours": []}
    for _ in range(cfg.repeats):
        times["megatron"] += train_megatron.run(theirs, info, grid)["times"][1:]
        times["ours"] += train_4d.run(ours, info, grid)["times"][1:]
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mean = {k: dtl_dist.all_reduce_scalar(v, average=True) for k, v in med.items()}
    dtl_dist.print0(
        f"summary: day22 ratio {lay.name()} model {cfg.model}: megatron-core "
        f"{mean['megatron']:.0f} ms / ours {mean['ours']:.0f} ms per step = "
        f"{mean['megatron'] / mean['ours']:.2f} (medians over {len(times['ours'])} steps each, "
        f"{'GPU' if info.device.type == 'cuda' else 'CPU'})"
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    if cfg.part == "ratio":
        run_ratio(cfg, info)
        dtl_dist.cleanup()
        return
    rows = []
    for lay in candidate_layouts(info.world_size):
        reason = why_not(cfg, lay)
        if reason:
            dtl_dist.print0(f"{lay.name()}: not run ({reason})")
            continue
        rows.append(measure(cfg, info, lay))
        dtl_dist.print0(f"{lay.name()}: {rows[-1]['step_ms']:.0f} ms per step")
    dtl_dist.print0(table(rows))
    best, why = pick(rows, cfg.memory_budget_mb)
    if info.is_main:
        write_csv(rows, os.path.join(cfg.out_dir, "sweep.csv"))
        title = (
            f"{cfg.model}, {info.world_size} ranks, {cfg.global_batch_size}x{cfg.seq_len} tokens"
        )
        plot(rows, os.path.join(cfg.out_dir, "sweep.png"), title)
        print(f"table: {cfg.out_dir}/sweep.csv, plot: {cfg.out_dir}/sweep.png", flush=True)
    exact = all(r["exact"] for r in rows)
    dtl_dist.print0(
        f"summary: day22 sweep {len(rows)} layouts on {info.world_size} ranks, model "
        f"{cfg.model}: state and bytes per axis = formula {'yes' if exact else 'NO'}; {why}"
    )
    dtl_dist.print0(
        "summary: pick "
        f"{best['layout']}; on GPUs the rule is TP inside a node (NVLink), PP across nodes, "
        "DP outermost (notes)"
    )
    dtl_dist.finish(exact)


if __name__ == "__main__":
    main()
