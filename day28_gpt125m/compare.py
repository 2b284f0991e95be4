"""Day 28: ZeRO-3, TP + PP or FSDP2 over TP? Predicted memory, communication and bubble for a
model on a cluster, beside what this machine measured.

    torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.compare
    python -m day28_gpt125m.compare --models=gpt-6.6b --gpus=16 --gpu_memory_gb=40
    python -m day28_gpt125m.compare --measured=false --ib_gbs=25 --overlap_fraction=0.5

For each model (GPT-3 Small 125M, GPT-3 XL 1.3B, day 22's 6.6B GPT) and cluster (one node of 8
GPUs, two nodes of 8), per GPU, bf16 with fp32 optimizer state:
  ZeRO-3, DP over every GPU (DeepSpeed)   state 16Ψ/N + every parameter gathered, 2Ψ (day 23's
                                          measurement of the reuse rule); activations of b
                                          sequences; traffic: zero3_traffic_bytes, every
                                          micro-step's two all-gathers and one reduce-scatter,
                                          over InfiniBand once N spans nodes
  TP + PP (+ DP), Megatron's settings     day 22's plan.py: every (tp, pp, dp), TP inside a node,
                                          SP, the distributed optimizer, 1F1B; its best layout
  FSDP2 over TP (torchtitan's 2-D mesh)   TP t inside a node, FSDP over the N/t others: fit.py's
                                          fsdp2_tp state (16P/dp + a block's TP shard), plan's
                                          TP traffic, ZeRO-3's traffic on the TP shard; the
                                          fastest t that fits
A strategy fits when its memory is at most gpu_memory_gb x usable_memory_fraction (day 22's
step_model.py sources the default). The step times are one model, day 22's StepModel, its
assumptions on the command line (--mfu, --nvlink_gbs, --ib_gbs, --overlap_fraction): compute at
an assumed MFU, stretched by the bubble, plus the traffic the schedule cannot hide (TP and PP on
the critical path; ZeRO-3's and DP's collectives overlapped with compute, their excess exposed).
The per-rank state of every strategy is the formula fit.py uses, which
tests/test_day28_gpt125m.py checks against this machine's runs; `--measured` reads the
summary.json of the runs under outputs/day28_gpt125m and prints them beside it. Writes compare.md
and compare.png (memory and step time against the GPU count, --plot_gpus) in out_dir.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

from day22_megatron import formulas, planner
from day22_megatron.step_model import GB, ClusterConfig
from day28_gpt125m import fit
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.exercise_seam import exercise
from dtl.model import PRESETS, GPTConfig, flops_per_token, num_params, preset

BF16 = 2  # bytes of a parameter or gradient element ZeRO-3 sends
MODELS = {
    "gpt3-125m": PRESETS["gpt3-125m"],
    # GPT-3 XL (Brown et al. 2020, Table 2.1): 24 layers, 2048 wide, 16 heads of 128, s 2048
    "gpt3-1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=50257),
    "gpt-6.6b": planner.MODELS["gpt-6.6b"],
}
# tokens per step and micro-batch, as the papers trained them: GPT-3 0.5M and 1M, Llama 2 4M
BATCH = {"gpt3-125m": (524_288, 8), "gpt3-1.3b": (1_048_576, 4), "gpt-6.6b": (4_194_304, 1)}


def _sizes(text: str) -> list[int]:
    return [int(g) for g in text.split(",")]


@dataclass
class Config(ClusterConfig):  # + the cluster and step-model fields (day 22's ClusterConfig)
    models: str = "gpt3-125m,gpt3-1.3b,gpt-6.6b"  # comma-separated (MODELS)
    gpus: str = "8,16"  # cluster sizes of the table, comma-separated
    plot_gpus: str = "8,16,32,64,128"  # cluster sizes of compare.png, comma-separated
    measured: bool = True  # print this machine's runs (outputs/day28_gpt125m/*/summary.json)
    out_dir: str = "outputs/day28_gpt125m/compare"  # compare.md, compare.png

    def validate(self) -> None:
        unknown = [m for m in self.models.split(",") if m not in MODELS]
        if unknown:
            raise dtl_config.ConfigError(f"unknown model(s) {unknown}; {', '.join(MODELS)}")
        for key in ("gpus", "plot_gpus"):
            sizes = dtl_config.int_list(key, getattr(self, key))
            for name in self.models.split(","):  # ZeRO-3's DP spans every GPU
                sequences = BATCH[name][0] // MODELS[name].block_size
                bad = [n for n in sizes if sequences % n]
                if bad:
                    raise dtl_config.ConfigError(
                        f"{key}: {bad} GPUs do not share {name}'s {sequences:,} sequences per "
                        "step evenly (ZeRO-3 gives every GPU whole sequences)"
                    )


@exercise("day28.zero3_traffic")
def zero3_traffic_bytes(psi: int, gpus: int, micro_steps: int) -> float:
    """Bytes one rank sends per optimizer step under DeepSpeed's ZeRO-3: on every micro-step
    the bf16 parameters are all-gathered in forward and again in backward (each layer frees
    them after use) and the bf16 gradients reduce-scattered into this rank's partition (no rank
    holds whole gradients to accumulate in): day 18's 3Ψ(N-1)/N elements, three passes of
    Ψ(N-1)/N each (measured there), micro_steps times. (Megatron's distributed optimizer
    accumulates whole gradients and reduces them once per step: plan.py's DP row.)"""
    # one ring collective over Ψ elements on N = gpus ranks: each rank sends (N-1)/N of them,
    # BF16 bytes each (day18_zero/formulas.py:comm_bytes_per_rank counts the same per step)
    # exercise day28.zero3_traffic: begin
    per_pass = BF16 * psi * (gpus - 1) / gpus  # one all-gather or one reduce-scatter
    passes = 3  # gather for forward, gather again for backward, reduce-scatter the gradients
    return micro_steps * passes * per_pass
    # exercise day28.zero3_traffic: end


def zero3_row(name: str, gpus: int, cfg: Config) -> dict:
    model, (tokens, b) = MODELS[name], BATCH[name]
    s, step = model.block_size, cfg.step_model()
    b, m = formulas.micro_batches(tokens, s, b, gpus)  # m micro-steps of b sequences per GPU
    mem = fit.predicted_bytes(model, "zero3", world=gpus, micro=b, seq_len=s, precision="bf16")
    traffic = zero3_traffic_bytes(num_params(model), gpus, m)
    comm = step.link_s(traffic, inside_node=gpus <= cfg.gpus_per_node)
    compute = step.compute_s(flops_per_token(model, s) * tokens / gpus)
    return dict(
        strategy="zero3",
        layout=f"dp{gpus}",
        m=m,
        memory_gb=mem["total"] / GB,
        comm_gb=traffic / GB,
        comm_s=comm,
        bubble=0.0,
        compute_s=compute,
        step_s=step.step_s(compute, overlappable_s=comm),
    )


def tp_pp_row(name: str, gpus: int, cfg: Config) -> dict:
    tokens, b = BATCH[name]
    rows, _ = planner.plan(
        MODELS[name],
        gpus,
        tokens=tokens,
        b=b,
        per_node=cfg.gpus_per_node,
        memory_gb=cfg.usable_gb,
        step=cfg.step_model(),
    )
    mp = [r for r in rows if not r["layout"].startswith("tp1-pp1")]  # model parallel layouts
    fits = [r for r in mp if r["memory_gb"] <= cfg.usable_gb]
    pick = min(fits, key=lambda r: r["step_s"]) if fits else min(mp, key=lambda r: r["memory_gb"])
    layout = {x.name(): x for x in planner.layouts_of(MODELS[name], gpus, cfg.gpus_per_node)}
    return dict(
        strategy="tp_pp",
        layout=pick["layout"],
        m=pick["m"],
        memory_gb=pick["memory_gb"],
        comm_gb=pick["tp_gb"] + pick["pp_gb"] + pick["dp_gb"],
        comm_s=pick["tp_s"] + pick["pp_s"] + pick["dp_s"],
        bubble=pick["bubble"],
        compute_s=pick["compute_s"],
        step_s=pick["step_s"],
        plan=pick,
        lay=layout[pick["layout"]],  # the Layout, for code that builds it (day 28's scale.py)
    )


def fsdp2_tp_row(name: str, gpus: int, cfg: Config) -> dict:
    """FSDP2 over TP (torchtitan's 2-D layout, day 28's fsdp2_tp): TP t inside a node, FSDP over
    the other N/t ranks, no pipeline; of every t that divides the heads, the fastest that fits
    (else the smallest). TP's all-reduces are plan.py's, on NVLink, on the critical path; FSDP's
    traffic is ZeRO-3's on the TP shard (zero3_traffic_bytes: every micro-step gathers it twice
    and reduce-scatters its gradients, as torchtitan's accumulation does), overlappable, over
    InfiniBand once the dp group spans nodes. Memory: fit.py's fsdp2_tp row."""
    model, (tokens, b) = MODELS[name], BATCH[name]
    s, step = model.block_size, cfg.step_model()
    rows = []
    for lay in planner.layouts_of(model, gpus, cfg.gpus_per_node):
        if lay.pp > 1 or lay.tp == 1:
            continue  # a (dp, tp) mesh, TP on
        plan_row = planner.evaluate(
            model, lay, tokens=tokens, b=b, per_node=cfg.gpus_per_node, step=step
        )  # its TP traffic, micro-batches and compute are fsdp2_tp's too
        mb, m = plan_row["b"], plan_row["m"]
        mem = fit.predicted_bytes(
            model, "fsdp2_tp", world=gpus, tp=lay.tp, micro=mb, seq_len=s, precision="bf16"
        )
        shard = formulas.params_per_rank(model, lay, 0)  # one TP rank's parameters
        dp_bytes = zero3_traffic_bytes(shard, lay.dp, m)
        dp_s = step.link_s(dp_bytes, inside_node=gpus <= cfg.gpus_per_node)
        compute = plan_row["compute_s"]
        rows.append(
            dict(
                strategy="fsdp2_tp",
                layout=f"tp{lay.tp}-dp{lay.dp}",
                m=m,
                memory_gb=mem["total"] / GB,
                comm_gb=plan_row["tp_gb"] + dp_bytes / GB,
                comm_s=plan_row["tp_s"] + dp_s,
                bubble=0.0,
                compute_s=compute,
                step_s=step.step_s(compute, critical_s=plan_row["tp_s"], overlappable_s=dp_s),
            )
        )
    fits = [r for r in rows if r["memory_gb"] <= cfg.usable_gb]
    return min(fits, key=lambda r: r["step_s"]) if fits else min(rows, key=lambda r: r["memory_gb"])


ROWS = (zero3_row, tp_pp_row, fsdp2_tp_row)  # each strategy's row, in the table's order
# the figure's line per strategy: its colour, and where its points name their layout (an
# offset in points; None: unnamed)
STYLES = (
    ("zero3", "tab:blue", None),
    ("tp_pp", "tab:orange", (2, 4)),
    ("fsdp2_tp", "tab:green", (2, -9)),
)


def compare(cfg: Config, sizes: list[int] | None = None) -> list[dict]:
    """Every strategy's row for every model of cfg on each cluster size (cfg.gpus by default)."""
    rows = []
    for name in cfg.models.split(","):
        for gpus in sizes or _sizes(cfg.gpus):
            for row in (make(name, gpus, cfg) for make in ROWS):
                rows.append(
                    {"model": name, "gpus": gpus, **row, "fits": row["memory_gb"] <= cfg.usable_gb}
                )
    return rows


def assumptions(cfg: Config) -> str:
    return (
        f"Per GPU: {cfg.gpu_memory_gb:.0f} GB, {cfg.usable_gb:.1f} GB usable "
        f"(x {cfg.usable_memory_fraction:g}); {cfg.gpus_per_node} per node; step model: "
        f"{cfg.mfu:.0%} MFU, NVLink {cfg.nvlink_gbs:g} GB/s, InfiniBand {cfg.ib_gbs:g} GB/s, "
        f"{cfg.overlap_fraction:.0%} of ZeRO-3's / DP's traffic may overlap compute"
    )


def table(rows: list[dict], usable_gb: float) -> str:
    head = (
        f"| model | GPUs | strategy | layout | m | memory GB/GPU | fits {usable_gb:.1f} GB | "
        "traffic GB/GPU/step | traffic s | bubble | compute s | step s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['strategy']} | {r['layout']} | {r['m']} | "
            f"{r['memory_gb']:.1f} | {'yes' if r['fits'] else 'no'} | {r['comm_gb']:.1f} | "
            f"{r['comm_s']:.3g} | {r['bubble']:.2f} | {r['compute_s']:.3g} | {r['step_s']:.3g} |"
        )
    return "\n".join(lines)


def measured_runs(root: str = "outputs/day28_gpt125m") -> list[dict]:
    """This machine's runs (train.py's summary.json) beside fit.py's per-rank state."""
    out = []
    for path in sorted(glob.glob(os.path.join(root, "*", "summary.json"))):
        with open(path) as f:
            s = json.load(f)
        if not s.get("state_bytes"):
            continue
        want = fit.predicted_bytes(
            preset(s["model"]), s["strategy"], world=s["world"], tp=s["tp"], pp=s["pp"]
        )["resident"]
        out.append({**s, "predicted_state_bytes": want})
    return out


def figure(cfg: Config):
    """Per model (a column): memory per GPU and the estimated step against the GPU count, both
    strategies, the usable memory as a line; a hollow marker does not fit. A matplotlib Figure,
    no file and no run: `plot` saves it, tools/figures.py draws day 28's notes from it."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator

    sizes, names = _sizes(cfg.plot_gpus), cfg.models.split(",")
    rows = compare(cfg, sizes)
    fig = Figure(figsize=(4.6 * len(names), 7.5))
    axes = fig.subplots(2, len(names), squeeze=False)
    for col, name in enumerate(names):
        mem_ax, step_ax = axes[0][col], axes[1][col]
        # each row kind, its colour, and whether its points name their layout (TP + PP's and
        # FSDP2 over TP's, picked per N, change with N; ZeRO-3's is dp N)
        for strategy, color, offset in STYLES:
            mine = [r for r in rows if r["model"] == name and r["strategy"] == strategy]
            gpus = [r["gpus"] for r in mine]
            for ax, key in ((mem_ax, "memory_gb"), (step_ax, "step_s")):
                ax.plot(gpus, [r[key] for r in mine], color=color, label=strategy)
                for r in mine:
                    ax.plot(
                        r["gpus"],
                        r[key],
                        "o",
                        color=color,
                        markerfacecolor=color if r["fits"] else "white",
                    )
            for r in mine if offset else ():
                mem_ax.annotate(
                    r["layout"],
                    (r["gpus"], r["memory_gb"]),
                    fontsize=6,
                    xytext=offset,
                    textcoords="offset points",
                )
        compute = [r["compute_s"] for r in rows if r["model"] == name and r["strategy"] == "zero3"]
        step_ax.plot(sizes, compute, ":", color="gray", label="compute alone")
        mem_ax.axhline(cfg.usable_gb, color="red", ls="--", label=f"usable {cfg.usable_gb:.1f} GB")
        mem_ax.axhline(cfg.gpu_memory_gb, color="gray", ls=":", label=f"{cfg.gpu_memory_gb:g} GB")
        mem_ax.set_ylim(0, cfg.gpu_memory_gb * 1.08)
        mem_ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.6)  # room for the last layout's name
        mem_ax.set_title(f"{name}: memory per GPU (GB)")
        step_ax.set_title(f"{name}: estimated step (s)")
        step_ax.set_yscale("log")
        step_ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        step_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        step_ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        for ax in (mem_ax, step_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.set_xlabel("GPUs")
            ax.legend(fontsize=8)
    fig.suptitle(assumptions(cfg), fontsize=8)
    fig.tight_layout()
    return fig


def plot(cfg: Config, path: str) -> None:
    figure(cfg).savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    rows = compare(cfg)
    lines = [assumptions(cfg), table(rows, cfg.usable_gb)]
    if cfg.measured:
        runs = measured_runs()
        lines.append("\nThis machine (CPU, tiny/small): state per rank, measured vs fit.py")
        lines.append(
            "| run | strategy | world | tp x pp | state MB/rank | fit.py MB | tokens/s |\n"
            "|---|---|---|---|---|---|---|"
        )
        for r in runs:
            lines.append(
                f"| {r['run']} | {r['strategy']} | {r['world']} | {r['tp']} x {r['pp']} | "
                f"{r['state_bytes'] / 1e6:.3f} | {r['predicted_state_bytes'] / 1e6:.3f} | "
                f"{r['tokens_per_s']:,.0f} |"
            )
    report = "\n".join(lines)
    dtl_dist.print0(report)
    if dtl_dist.get_rank() == 0:
        with open(os.path.join(cfg.out_dir, "compare.md"), "w") as f:
            f.write(report + "\n")
        plot(cfg, os.path.join(cfg.out_dir, "compare.png"))
    for name in cfg.models.split(","):
        for gpus in _sizes(cfg.gpus):
            mine = [r for r in rows if r["model"] == name and r["gpus"] == gpus]
            fitting = [r for r in mine if r["fits"]]
            faster = min(fitting, key=lambda r: r["step_s"])["strategy"] if fitting else "none fits"
            each = ", ".join(
                f"{r['strategy']} {r['layout']} {r['memory_gb']:.1f} GB/GPU {r['step_s']:.3g} s"
                for r in mine
            )
            dtl_dist.print0(
                f"summary: day28 compare {name} on {gpus} GPUs: {each}; faster by the model: "
                f"{faster} ({cfg.usable_gb:.1f} GB usable)"
            )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
