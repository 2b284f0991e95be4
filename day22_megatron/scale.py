"""Day 22 at scale: the planner's pick for a model and a cluster, run as one rank of it, simulated.

    torchrun --standalone --nproc_per_node=1 -m day22_megatron.scale
    ... --models=gpt-6.6b --gpus=64

Each layout's simulated rank beside its formulas (at_scale.py says what is compared and how);
writes scale.csv in out_dir.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

from day22_megatron import planner
from day22_megatron.at_scale import KEYS, gap, picks, row
from day22_megatron.step_model import GB
from dtl import config as dtl_config
from dtl.metrics import write_csv
from dtl.simulate import CANNOT_SEE


@dataclass
class Config:
    models: str = "gpt2-124m,gpt-6.6b"  # comma-separated: planner.MODELS
    gpus: str = "8,64"  # cluster sizes, comma-separated
    # bytes per micro-batch are compared with the formulas' (a step's are m times those)
    micro_batches: Annotated[int, dtl_config.NON_NEGATIVE] = 0  # simulated (0: the pp depth)
    out_dir: str = "outputs/day22_megatron/scale"  # scale.csv

    def validate(self) -> None:
        err = dtl_config.ConfigError
        unknown = [m for m in self.models.split(",") if m not in planner.MODELS]
        if unknown:
            raise err(f"unknown model(s) {unknown}; {', '.join(planner.MODELS)}")
        sizes = dtl_config.int_list("gpus", self.gpus)
        for name in self.models.split(","):  # plan.py's formulas: milliseconds
            for gpus in sizes:
                if planner.plan_for(planner.PlanConfig(), name, gpus)[2] is None:
                    raise err(f"plan.py finds no layout of {name} that fits {gpus} GPUs")


def show(r: dict) -> str:
    head = (
        f"{r['model']} on {r['gpus']} GPUs, plan.py's {r['which']}: {r['layout']} "
        f"(b {r['b']}, m {r['m']}); "
        f"simulated rank: stage {r['stage']}, tp 0, dp 0 ({r['seconds']:.1f} s)"
    )
    lines = [head, f"  {'':<22}{'simulated':>16}{'formula':>16}{'gap':>9}"]
    labels = {
        "params": "params (elements)",
        "tp": "TP bytes / micro",
        "pp": "PP bytes / micro",
        "dp": "DP bytes / step",
        "state": "state bytes",
    }
    for key in KEYS:
        lines.append(
            f"  {labels[key]:<22}{r[key + '_sim']:>16,.0f}{r[key + '_formula']:>16,.0f}"
            f"{gap(r, key):>9.2%}"
        )
    lines.append(
        f"  plan's row (Megatron's distributed optimizer): DP {r['megatron_dp'] / GB:.2f} GB/step,"
        f" state {r['megatron_state'] / GB:.2f} GB; this stack: DP {r['dp_sim'] / GB:.2f} GB, "
        f"state {r['state_sim'] / GB:.2f} GB"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before anything runs
    rows = []
    for name in cfg.models.split(","):
        for gpus in map(int, cfg.gpus.split(",")):
            for which, lay, best in picks(name, gpus):
                rows.append(row(name, gpus, which, lay, best, cfg.micro_batches))
                print(show(rows[-1]), flush=True)
    write_csv(rows, os.path.join(cfg.out_dir, "scale.csv"))
    print(f"the simulation cannot see: {CANNOT_SEE}")
    worst = {key: max(gap(r, key) for r in rows) for key in KEYS}
    print(
        f"summary: day22 scale, {len(rows)} of plan.py's layouts simulated for {cfg.models} on "
        f"{cfg.gpus} GPUs: "
        + ", ".join(f"{key} {worst[key]:.2%}" for key in KEYS)
        + " worst |simulated - formula| / formula",
        flush=True,
    )


if __name__ == "__main__":
    main()
