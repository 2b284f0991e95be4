"""Day 22: choosing TP, PP and DP for a model and a cluster, worked by formula (no GPU needed).

    torchrun --standalone --nproc_per_node=1 -m day22_megatron.plan
    python -m day22_megatron.plan --model=gpt-6.6b --gpus=64 --global_batch_tokens=4194304

Every (tp, pp, dp) of the cluster, its memory, traffic and step-time estimate per GPU, and the
fastest layout that fits: the formulas are planner.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from day22_megatron.planner import MODELS, PlanConfig, plan_for, show
from dtl import config as dtl_config
from dtl import dist as dtl_dist


@dataclass
class Config(PlanConfig):  # + the batch, the cluster and the step model (planner.PlanConfig)
    model: str = "all"  # gpt2-124m | gpt-6.6b | all (both, on 8 and 64 GPUs)
    gpus: int = 0  # cluster size (0: 8 and 64)
    out_dir: str = "outputs/day22_megatron/plan"  # config.json

    def validate(self) -> None:
        if self.model != "all" and self.model not in MODELS:
            raise dtl_config.ConfigError(f"unknown model '{self.model}'; {', '.join(MODELS)}, all")


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    models = list(MODELS) if cfg.model == "all" else [cfg.model]
    for name in models:
        for gpus in [cfg.gpus] if cfg.gpus else [8, 64]:
            tokens, rows, best = plan_for(cfg, name, gpus)
            dtl_dist.print0(show(name, gpus, rows, best, cfg))
            pick = best["layout"] if best else "none fits"
            dtl_dist.print0(
                f"summary: day22 plan {name} on {gpus} GPUs, {tokens:,} tokens per step: pick "
                f"{pick} (of {len(rows)} layouts; model at {cfg.mfu:.0%} MFU, "
                f"{cfg.usable_gb:.1f} of {cfg.gpu_memory_gb:.0f} GB usable)"
            )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
