"""Day 22: ZeRO-1 under the stack at 8, 64 and 1,024 ranks, simulated beside its formulas.

    torchrun --standalone --nproc_per_node=1 -m day22_megatron.zero1_scale

Each row builds our stack at tp 2 x pp 2 x dp N/4 for a real model (GPT-2 124M, the 6.6 B model
of the planner), as rank 0 of N under dtl.simulate.fake_world (at_scale.measure: shapes, no
data), in bf16, and runs two micro-batches, the DP sync and an optimizer step, once with the
replicated AdamW and once with the distributed optimizer (distopt.py). Per rank, bytes:

    state, replicated   (2 + 2 + 4) P                 bf16 weights, gradients, Adam m and v
    state, ZeRO-1       (2 + 2) P' + 4 P' / d         m and v sliced over d = dp ranks
    dp, both            2 (d-1)/d x 2 P'   reduce-scatter + all-gather: the all-reduce's bytes

P = formulas.params_per_rank of the fullest stage; P' = P + the elements ZeRO-1's flat buffers
add to reach multiples of d (the simulated optimizer reports them; 20 ranks, d = 5, need some).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from day18_zero.formulas import comm_bytes_per_rank
from day22_megatron import formulas, planner
from day22_megatron.at_scale import fullest_stage, simulate
from day22_megatron.layouts import VOCAB_MULTIPLE, Layout
from day22_megatron.planner import BF16
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.model import pad_vocab_size

ADAM_BF16 = 2 * BF16  # m and v in the parameters' dtype (torch's AdamW on bf16 weights)
MB = 1e6


@dataclass
class Config:
    models: str = "gpt2-124m,gpt-6.6b"  # planner.MODELS names, comma-separated
    ranks: str = "8,20,64,1024"  # world sizes N: tp 2 x pp 2 x dp N/4 (20: d = 5, padded)
    micro_batches: int = 2  # per step, micro-batch 1

    def validate(self) -> None:
        err = dtl_config.ConfigError
        planner.check_models(self.models)
        bad = [n for n in dtl_config.int_list("ranks", self.ranks) if n % 4 or n < 8]
        if bad:
            raise err(f"ranks {bad[0]}: a multiple of 4, at least 8 (tp 2 x pp 2 x dp)")
        if dtl_dist.launch_world_size() > 1:
            raise err("zero1_scale.py runs as one process (--nproc_per_node=1): it simulates")


def formula(cfg, lay: Layout, stage: int, padding: int) -> dict[str, float]:
    """The module docstring's bytes for one rank of stage `stage`."""
    P, d = formulas.params_per_rank(cfg, lay, stage), lay.dp
    return dict(
        replicated=(BF16 + BF16 + ADAM_BF16) * P,
        zero1=(BF16 + BF16 + ADAM_BF16 / d) * (P + padding),
        dp=comm_bytes_per_rank(P + padding, d, 0, BF16),
    )


def row(name: str, world: int, micro_batches: int) -> dict:
    """One model at one world size: both optimizers simulated, and their formulas."""
    lay = Layout(tp=2, pp=2, dp=world // 4)
    cfg = planner.MODELS[name]
    if cfg.vocab_size % lay.tp:  # padded as Megatron pads (at_scale.row_at does the same)
        cfg = replace(cfg, vocab_size=pad_vocab_size(cfg.vocab_size, VOCAB_MULTIPLE, lay.tp))
    stage = fullest_stage(cfg, lay)
    plain = simulate(cfg, lay, 1, micro_batches, stage)
    zero1 = simulate(cfg, lay, 1, micro_batches, stage, distributed_optimizer=True)
    want = formula(cfg, lay, stage, zero1["padding"])
    got = dict(replicated=plain["state"], zero1=zero1["state"], dp=zero1["dp"])
    return dict(
        model=name,
        world=world,
        layout=lay.name(),
        got=got,
        want=want,
        plain_dp=plain["dp"],
        # the replicated all-reduce's bytes, and the padding's: what ZeRO-1 should send
        same_dp=zero1["dp"] == plain["dp"] + comm_bytes_per_rank(zero1["padding"], lay.dp, 0, BF16),
        padding=zero1["padding"],
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    rows = [
        row(m, int(n), cfg.micro_batches)
        for m in cfg.models.split(",")
        for n in cfg.ranks.split(",")
    ]
    head = ("replicated MB", "ZeRO-1 MB", "formula MB", "dp MB/step", "padding", "= all-reduce")
    print(f"{'model':<10}{'N':>6} {'layout':<14}" + "".join(f"{h:>15}" for h in head))
    gaps = []
    for r in rows:
        got, want = r["got"], r["want"]
        gaps += [abs(got[k] - want[k]) / want[k] for k in want]
        values = (got["replicated"], got["zero1"], want["zero1"], got["dp"])
        print(
            f"{r['model']:<10}{r['world']:>6} {r['layout']:<14}"
            + "".join(f"{v / MB:>15.1f}" for v in values)
            + f"{r['padding']:>15}{'yes' if r['same_dp'] else 'no':>15}"
        )
    same_dp = all(r["same_dp"] for r in rows)
    ok = max(gaps) == 0 and same_dp
    print(
        f"summary: day22 zero1 at scale, {len(rows)} rows simulated: state and dp bytes = formula "
        f"{'yes' if max(gaps) == 0 else 'NO'} (worst gap {max(gaps):.3%}); ZeRO-1's dp bytes = "
        f"the all-reduce's (and its padding's) {'yes' if same_dp else 'NO'}"
    )
    dtl_dist.finish(ok)


if __name__ == "__main__":
    main()
