"""Day 22: where the model state lives: what one rank holds under six compositions, by formula.

    torchrun --standalone --nproc_per_node=1 -m day22_megatron.placement
    ... --models=gpt2-124m,gpt-6.6b --ranks=8,64,1024 --tp=2

fp32 training with Adam: 4 bytes of weight, 4 of gradient and 8 of Adam's m and v for every
element a rank holds. Each row is a formula the course checks against runs, to the byte:

    DDP over N                 Ψ of each                          (day 17)
    TP t x DP N/t              P = one TP shard (params_per_rank) of each   (train_4d.py)
    TP t x DP N/t + ZeRO-1     P weights, P gradients, P/d moments          (distopt.py)
    FSDP2 over TP t x DP N/t   P/d of each                                  (day 28's fsdp2_tp)
    HSDP N/s x s               Ψ/s of each, s the ranks of a node           (hsdp.py)
    FSDP over N                Ψ/N of each                                  (day 18)

The element counts leave out FSDP2's padding (dim 0 to a multiple of the shard group, a few
elements per tensor) and ZeRO-1's (fewer than d per buffer): hsdp_scale.py, zero1_scale.py and
sharded_tp_scale.py simulate them with it. tools/figures.py draws the table at N = 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from day22_megatron import formulas, planner
from day22_megatron.layouts import Layout
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.model import GPTConfig, num_params

# bytes per element held: fp32 weight, fp32 gradient, Adam's two fp32 moments
BYTES = {"weights": 4, "gradients": 4, "moments": 8}
NODE = 8  # GPUs per node: HSDP's shard group (fewer on a smaller world)


class Placement(NamedTuple):
    kind: str  # the composition, whatever the sizes
    label: str  # with its sizes, as the figure names it
    weights: float  # elements of each kind one rank holds
    gradients: float
    moments: float

    def state_bytes(self) -> float:
        return sum(BYTES[k] * getattr(self, k) for k in BYTES)


def placements(cfg: GPTConfig, world: int, tp: int = 2) -> list[Placement]:
    """The six compositions of `cfg` over `world` ranks, TP `tp` where there is TP."""
    dp, node = world // tp, min(NODE, world // 2)
    psi = num_params(cfg)
    shard = formulas.params_per_rank(cfg, Layout(tp=tp, dp=dp), 0)  # one TP rank's elements
    tp_dp, each = f"TP {tp} x DP {dp}", shard / dp  # FSDP2 over TP: a dp shard of the TP shard
    return [
        Placement("DDP", f"DDP over {world}", psi, psi, psi),
        Placement("TP x DP", tp_dp, shard, shard, shard),
        Placement("TP x DP + ZeRO-1", f"{tp_dp} + ZeRO-1 (distopt.py)", shard, shard, shard / dp),
        Placement("FSDP2 over TP x DP", f"FSDP2 over {tp_dp} (fsdp2_tp)", each, each, each),
        Placement(
            "HSDP, node-sharded",
            f"HSDP {world // node} x {node} (hsdp.py)",
            psi / node,
            psi / node,
            psi / node,
        ),  # fmt: skip
        Placement("FSDP", f"FSDP over {world}", psi / world, psi / world, psi / world),
    ]


@dataclass
class Config:
    models: str = "gpt2-124m,gpt-6.6b"  # planner.MODELS names, comma-separated
    ranks: str = "8,64,1024"  # world sizes N, multiples of 2 x tp
    tp: int = 2  # tensor-parallel ranks of the TP rows; divides every model's heads

    def validate(self) -> None:
        err = dtl_config.ConfigError
        planner.check_models(self.models, self.tp)
        bad = [n for n in dtl_config.int_list("ranks", self.ranks) if n % (2 * self.tp)]
        if bad:
            raise err(f"ranks {bad[0]}: a multiple of 2 x --tp = {2 * self.tp}")
        if dtl_dist.launch_world_size() > 1:
            raise err("placement.py runs as one process (--nproc_per_node=1): it computes")


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before anything runs
    sizes = dtl_config.int_list("ranks", cfg.ranks)
    for name in cfg.models.split(","):
        model = planner.MODELS[name]
        print(
            f"{name} ({num_params(model) / 1e9:.3f} B parameters): GB of model state per rank; "
            f"TP {cfg.tp}, DP N/{cfg.tp}, HSDP sharded over {NODE} (N/2 below {2 * NODE})"
        )
        rows = {n: placements(model, n, cfg.tp) for n in sizes}
        print(f"  {'composition':<22}" + "".join(f"{'N = ' + str(n):>12}" for n in sizes))
        for i, first in enumerate(rows[sizes[0]]):
            cells = "".join(f"{rows[n][i].state_bytes() / 1e9:>12.3f}" for n in sizes)
            print(f"  {first.kind:<22}{cells}")
    largest = placements(planner.MODELS[cfg.models.split(",")[-1]], sizes[-1], cfg.tp)
    print(
        f"summary: day22 placement {len(sizes)} sizes x {len(largest)} compositions: at N = "
        f"{sizes[-1]} a rank holds {largest[-1].state_bytes() / 1e9:.3f} GB under FSDP and "
        f"{largest[0].state_bytes() / 1e9:.3f} GB under DDP"
    )
    dtl_dist.finish(True)


if __name__ == "__main__":
    main()
