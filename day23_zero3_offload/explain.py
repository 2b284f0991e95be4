"""Day 23: read a ZeRO-3 offload ds_config, say in one line what is wrong with it, and say where
every byte of the model's training state will live: device, CPU memory, NVMe.

    python -m day23_zero3_offload.explain --ds_config=day23_zero3_offload/zero3_offload_nvme.json \\
        --model=gpt2-124m --world=8
    torchrun --standalone --nproc_per_node=1 -m day23_zero3_offload.explain --fit_budget_gb=80

The checks are checks.py (each a one-line ExplainError); the prediction, the largest GPT that
fits and the link table are predict.py. This file is the command line over both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from day23_zero3_offload.checks import TEMPLATES, check, read, template_path
from day23_zero3_offload.predict import (
    GB,
    MFU,
    NVME_READ_GBS,
    NVME_WRITE_GBS,
    PCIE_GBS,
    SEQ_LEN,
    bandwidth_table,
    deepspeed_estimate,
    groups_by_formula,
    largest_fit,
    param_groups,
    predict,
    table,
    totals,
)
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import extras
from dtl.deepspeed import DsConfigError
from dtl.model import PRESETS, GPTConfig, PresetName

# --- the command line --------------------------------------------------------------------------


@dataclass
class Config:
    ds_config: str = ""  # a ds_config to check and explain (empty: the four templates)
    model: PresetName = "gpt2-124m"  # dtl preset whose bytes are predicted
    world: int = 8  # ranks (GPUs) the config will run on
    fit_budget_gb: float = 80.0  # device memory per GPU for "the largest GPT that fits" (0: skip)
    cpu_budget_gb: float = 1000.0  # CPU memory of the node for the same question (DGX H100: 2 TB)
    out_dir: str = "outputs/day23_zero3_offload/explain"  # config.json

    def validate(self) -> None:
        if self.world < 1:
            raise dtl_config.ConfigError(f"world must be >= 1, got {self.world}")
        paths = [self.ds_config] if self.ds_config else [template_path(t) for t in TEMPLATES]
        try:
            configs = [read(path) for path in paths]  # a wrong path is named without DeepSpeed
            extras.require("day23_zero3_offload.explain", "deepspeed")  # check() asks DeepSpeed
            for ds in configs:
                check(ds, self.world, nvme=False)  # the NVMe folder is the user's
        except DsConfigError as e:
            raise dtl_config.ConfigError(str(e)) from None


def explain(path: str, cfg: GPTConfig, world: int, name: str) -> str:
    ds = read(path)
    groups = param_groups(cfg)
    pred = predict(ds, groups, world)
    sizes = [n for g in groups for n in g]
    cpu, gpu = deepspeed_estimate(ds, sizes, world)
    t = totals(pred)
    return (
        f"{os.path.basename(path)}: {name}, {sum(sizes):,} parameters, {world} ranks\n"
        f"{table(pred)}\n"
        f"  per rank: device {t['device'] / GB:.3f} GB, CPU {t['cpu'] / GB:.3f} GB, NVMe "
        f"{t['nvme'] / GB:.3f} GB; DeepSpeed's estimator: device {gpu / GB:.3f} GB per GPU, "
        f"CPU {cpu / GB:.3f} GB per node (mixed precision, 1.5x buffers)"
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    model = PRESETS[cfg.model]
    paths = [cfg.ds_config] if cfg.ds_config else [template_path(t) for t in TEMPLATES]
    for path in paths:
        dtl_dist.print0(explain(path, model, cfg.world, cfg.model))
    if cfg.fit_budget_gb:
        for path in paths:
            best = largest_fit(
                read(path), cfg.world, cfg.fit_budget_gb * GB, cfg.cpu_budget_gb * GB
            )
            what = (
                f"{best.n_layer} layers x {best.n_embd} wide, "
                f"{sum(map(sum, groups_by_formula(best))) / 1e9:.1f} B parameters"
                if best
                else "none of the grid"
            )
            dtl_dist.print0(
                f"summary: largest GPT whose model state fits {cfg.fit_budget_gb:.0f} GB per "
                f"device x {cfg.world} and {cfg.cpu_budget_gb:.0f} GB of CPU with "
                f"{os.path.basename(path)}: {what}"
            )
    from day22_megatron.planner import MODELS as PLAN_MODELS  # the 6.6B GPT of day 22's plan

    models = {"gpt2-124m": PRESETS["gpt2-124m"], "gpt-6.6b": PLAN_MODELS["gpt-6.6b"]}
    steps = {
        (ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1))
        for ds in (read(template_path(t)) for t in TEMPLATES)
    }
    batch = ", ".join(f"{b} x {a} x {SEQ_LEN:,} = {b * a * SEQ_LEN:,}" for b, a in sorted(steps))
    dtl_dist.print0(
        f"one H200, bf16, per step of the templates' micro-batch x accumulation x s tokens "
        f"({batch}): the links (PCIe {PCIE_GBS:.0f} GB/s each way, NVMe "
        f"{NVME_READ_GBS:.0f}/{NVME_WRITE_GBS:.0f} GB/s) vs compute at {MFU:.0%} MFU\n"
        f"{bandwidth_table(models)}"
    )
    dtl_dist.print0(
        f"summary: day23 explain {len(paths)} config(s) checked for {cfg.world} ranks: ok"
    )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
