"""Day 28: ZeRO-3 or TP + PP? Predicted memory, communication and bubble for a model on a cluster,
beside what this machine measured.

    torchrun --standalone --nproc_per_node=1 -m day28_gpt125m.compare
    python -m day28_gpt125m.compare --models=gpt-6.6b --gpus=16 --gpu_memory_gb=40

For each model (GPT-3 Small 125M, GPT-3 XL 1.3B, day 22's 6.6B GPT) and cluster (one node of 8
GPUs, two nodes of 8), per GPU, bf16 with fp32 optimizer state:
  ZeRO-3, DP over every GPU (DeepSpeed)   state 16Ψ/N + every parameter gathered, 2Ψ (day 23's
                                          measurement of the reuse rule); activations of b
                                          sequences; per step one all-gather of the bf16
                                          parameters and one reduce-scatter of the bf16 grads:
                                          2 x 2Ψ(N-1)/N bytes, over InfiniBand once N spans nodes
  TP + PP (+ DP), Megatron's settings     day 22's plan.py: every (tp, pp, dp), TP inside a node,
                                          SP, the distributed optimizer, 1F1B; its best layout
Both step times are one model (day 22's): compute at an assumed MFU, stretched by the bubble,
plus the traffic the schedule cannot hide (TP and PP on the critical path; ZeRO-3's and DP's
collectives overlapped with compute, their excess exposed). The per-rank state of every strategy
is the formula fit.py uses, which tests/test_day28_gpt125m.py checks against this machine's
runs; `--measured` reads the summary.json of the runs under outputs/day28_gpt125m and prints them
beside it. Writes compare.md and compare.png in out_dir.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

from day19_tp.formulas import IB_NDR_GBS, NVLINK_H100_GBS
from day22_megatron import plan
from day28_gpt125m import fit
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.model import PRESETS, GPTConfig, flops_per_token, num_params, preset
from dtl.precision import PRECISIONS

GB = 1e9
MODELS = {
    "gpt3-125m": PRESETS["gpt3-125m"],
    # GPT-3 XL (Brown et al. 2020, Table 2.1): 24 layers, 2048 wide, 16 heads of 128, s 2048
    "gpt3-1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=50257),
    "gpt-6.6b": plan.MODELS["gpt-6.6b"],
}
# tokens per step and micro-batch, as the papers trained them: GPT-3 0.5M and 1M, Llama 2 4M
BATCH = {"gpt3-125m": (524_288, 8), "gpt3-1.3b": (1_048_576, 4), "gpt-6.6b": (4_194_304, 1)}

H100_BF16_FLOPS = PRECISIONS["bf16"].peak_flops("H100")  # dense, dtl.precision


@dataclass
class Config:
    models: str = "gpt3-125m,gpt3-1.3b,gpt-6.6b"  # comma-separated (MODELS)
    gpus: str = "8,16"  # cluster sizes, comma-separated
    gpus_per_node: int = 8  # NVLink inside a node, InfiniBand across
    gpu_memory_gb: float = 80.0  # H100 SXM
    mfu: float = 0.4  # assumed fraction of the bf16 peak the matmuls reach
    measured: bool = True  # print this machine's runs (outputs/day28_gpt125m/*/summary.json)
    out_dir: str = "outputs/day28_gpt125m/compare"  # compare.md, compare.png

    def validate(self) -> None:
        unknown = [m for m in self.models.split(",") if m not in MODELS]
        if unknown:
            raise dtl_config.ConfigError(f"unknown model(s) {unknown}; {', '.join(MODELS)}")
        try:
            sizes = [int(g) for g in self.gpus.split(",")]
        except ValueError:
            raise dtl_config.ConfigError(f"gpus must be integers, got {self.gpus!r}") from None
        if min(sizes) < 1:
            raise dtl_config.ConfigError(f"gpus must be >= 1, got {self.gpus!r}")


def zero3_row(name: str, cfg: GPTConfig, gpus: int, per_node: int, mfu: float) -> dict:
    tokens, b = BATCH[name]
    psi, s = num_params(cfg), cfg.block_size
    mem = fit.predicted_bytes(cfg, "zero3", world=gpus, micro=b, seq_len=s, precision="bf16")
    comm = 2 * 2 * psi * (gpus - 1) / gpus
    link = (NVLINK_H100_GBS if gpus <= per_node else IB_NDR_GBS) * GB
    compute = flops_per_token(cfg, s) * tokens / gpus / (mfu * H100_BF16_FLOPS)
    step = compute + max(0.0, comm / link - compute)
    return dict(
        strategy="zero3", layout=f"dp{gpus}", memory_gb=mem["total"] / GB,
        comm_gb=comm / GB, bubble=0.0, compute_s=compute, step_s=step,
    )  # fmt: skip


def tp_pp_row(name: str, cfg: GPTConfig, gpus: int, per_node: int, mfu: float, memory_gb):
    tokens, b = BATCH[name]
    rows, _ = plan.plan(cfg, gpus, tokens=tokens, b=b, per_node=per_node, mfu=mfu,
                        memory_gb=memory_gb)  # fmt: skip
    mp = [r for r in rows if not r["layout"].startswith("tp1-pp1")]  # model parallel layouts
    fits = [r for r in mp if r["memory_gb"] <= memory_gb]
    pick = min(fits, key=lambda r: r["step_s"]) if fits else min(mp, key=lambda r: r["memory_gb"])
    return dict(
        strategy="tp_pp", layout=pick["layout"], memory_gb=pick["memory_gb"],
        comm_gb=pick["tp_gb"] + pick["pp_gb"] + pick["dp_gb"], bubble=pick["bubble"],
        compute_s=pick["compute_s"], step_s=pick["step_s"],
    )  # fmt: skip


def compare(cfg: Config) -> list[dict]:
    rows = []
    for name in cfg.models.split(","):
        model = MODELS[name]
        for gpus in (int(g) for g in cfg.gpus.split(",")):
            for row in (
                zero3_row(name, model, gpus, cfg.gpus_per_node, cfg.mfu),
                tp_pp_row(name, model, gpus, cfg.gpus_per_node, cfg.mfu, cfg.gpu_memory_gb),
            ):
                rows.append({"model": name, "gpus": gpus, **row,
                             "fits": row["memory_gb"] <= cfg.gpu_memory_gb})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| model | GPUs | strategy | layout | memory GB/GPU | fits | traffic GB/GPU/step | "
        "bubble | compute s | step s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['strategy']} | {r['layout']} | "
            f"{r['memory_gb']:.1f} | {'yes' if r['fits'] else 'no'} | {r['comm_gb']:.1f} | "
            f"{r['bubble']:.2f} | {r['compute_s']:.2f} | {r['step_s']:.2f} |"
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
        want = fit.predicted_bytes(preset(s["model"]), s["strategy"], world=s["world"],
                                   tp=s["tp"], pp=s["pp"])["resident"]  # fmt: skip
        out.append({**s, "predicted_state_bytes": want})
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['gpus']} GPUs" for r in rows if r["strategy"] == "zero3"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(
        axes,
        ("memory_gb", "comm_gb", "step_s"),
        ("memory per GPU (GB)", "traffic per GPU per step (GB)", "estimated step (s)"),
    ):
        for k, strategy in enumerate(("zero3", "tp_pp")):
            vals = [r[key] for r in rows if r["strategy"] == strategy]
            ax.bar([i + 0.4 * k for i in range(len(vals))], vals, width=0.4, label=strategy)
        ax.set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=7)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    rows = compare(cfg)
    md = table(rows)
    lines = [md]
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
        plot(rows, os.path.join(cfg.out_dir, "compare.png"))
    for name in cfg.models.split(","):
        for gpus in (int(g) for g in cfg.gpus.split(",")):
            pair = {r["strategy"]: r for r in rows if r["model"] == name and r["gpus"] == gpus}
            fitting = [s for s, r in pair.items() if r["fits"]]
            faster = min(fitting, key=lambda s: pair[s]["step_s"]) if fitting else "neither fits"
            dtl_dist.print0(
                f"summary: day28 compare {name} on {gpus} GPUs: zero3 "
                f"{pair['zero3']['memory_gb']:.1f} GB/GPU, {pair['tp_pp']['layout']} "
                f"{pair['tp_pp']['memory_gb']:.1f} GB/GPU; faster by the model: {faster}"
            )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
