"""Day 22: HSDP against FSDP over every rank at 64 and 1,024 ranks, simulated beside the formulas.

    torchrun --standalone --nproc_per_node=1 -m day22_megatron.hsdp_scale

Each row builds the GPT under FSDP2 as rank 0 of N (dtl.simulate.fake_world: shapes, no data),
fp32, on a (replicate, shard) mesh: FSDP over all N ranks (replicate 1, shard N) or HSDP with
one shard group per node (replicate N/8, shard 8). One micro-batch of 1 sequence, its backward
and an AdamW step; the state held and the ring bytes sent on each mesh axis, against hsdp.py's
formulas. The axis whose groups span the nodes: FSDP's shard axis, HSDP's replicate axis (its
shard groups stay inside a node). The rule of thumb follows from those columns: HSDP sends about
2/s of the parameters' bytes on the axis that crosses nodes, where FSDP sends three times all of
them, and holds N/s times FSDP's state; it pays while 16 Ψ'/s fits beside the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from day22_megatron import hsdp, planner
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.comm import CommCounter
from dtl.model import GPT, GPTConfig, loss_fn
from dtl.optim import OptimConfig
from dtl.simulate import fake_world
from dtl.state import live_state_bytes

GB = 1e9
NODE = 8  # GPUs per node: HSDP's shard group


@dataclass
class Config:
    models: str = "gpt2-124m,gpt-6.6b"  # planner.MODELS names, comma-separated
    ranks: str = "64,1024"  # world sizes N, multiples of 8
    seq_len: int = 16  # tokens of the one simulated sequence (activations are not compared)
    gpu_gb: float = 80.0  # the GPU the rule of thumb sizes state against (H100 80 GB)

    def validate(self) -> None:
        err = dtl_config.ConfigError
        planner.check_models(self.models)
        bad = [n for n in dtl_config.int_list("ranks", self.ranks) if n % NODE or n < 2 * NODE]
        if bad:
            raise err(f"ranks {bad[0]}: a multiple of {NODE}, two nodes or more")
        if dtl_dist.launch_world_size() > 1:
            raise err("hsdp_scale.py runs as one process (--nproc_per_node=1): it simulates")


def simulate(cfg: GPTConfig, world: int, replicas: int, seq_len: int) -> dict:
    """Rank 0 of `world` under FSDP2 on a (replicas, world / replicas) mesh: one step."""
    with fake_world(world):
        gpt = GPT(cfg, seed=0)
        padded, root = hsdp.padded_counts(gpt, world // replicas)
        mesh = hsdp.hsdp_mesh(replicas, "cpu")
        model = hsdp.apply_hsdp(gpt, mesh)
        optimizer = OptimConfig().make(model.parameters())
        x = torch.randint(0, cfg.vocab_size, (1, seq_len + 1))  # host: fake, no device runs
        with CommCounter() as comm:
            loss_fn(model(x[:, :-1]), x[:, 1:]).backward()
        optimizer.step()  # Adam's m and v exist from here
        return dict(
            state=sum(live_state_bytes(model.parameters(), optimizer, counters=False).values()),
            sent={a: comm.ring_bytes_on(mesh.get_group(a)) for a in hsdp.HSDP_AXES},
            padded=padded,
            root=root,
        )


def row(name: str, world: int, replicas: int, seq_len: int) -> dict:
    sim = simulate(planner.MODELS[name], world, replicas, seq_len)
    shard = world // replicas
    want = dict(
        state=hsdp.state_bytes(sim["padded"], shard),
        **hsdp.comm_bytes(sim["padded"], sim["root"], replicas, shard),
    )
    got = dict(state=sim["state"], **sim["sent"])
    # the axis whose groups span the nodes: FSDP's shard axis, HSDP's replicate axis
    across = got[hsdp.SHARD] if replicas == 1 else got[hsdp.REPLICATE]
    kind = "FSDP" if replicas == 1 else "HSDP"
    return dict(model=name, world=world, kind=kind, got=got, want=want, across=across)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before anything runs
    rows = [
        row(m, int(n), replicas, cfg.seq_len)
        for m in cfg.models.split(",")
        for n in cfg.ranks.split(",")
        for replicas in (1, int(n) // NODE)
    ]
    head = ("state GB", "formula", "shard GB", "formula", "replicate GB", "formula", "inter-node")
    print(f"{'model':<10}{'N':>6} {'kind':<5}" + "".join(f"{h:>13}" for h in head))
    gaps = []
    for r in rows:
        got, want = r["got"], r["want"]
        gaps += [abs(got[k] - want[k]) / max(want[k], 1) for k in want]
        pairs = [v for k in ("state", hsdp.SHARD, hsdp.REPLICATE) for v in (got[k], want[k])]
        print(
            f"{r['model']:<10}{r['world']:>6} {r['kind']:<5}"
            + "".join(f"{v / GB:>13.3f}" for v in (*pairs, r["across"]))
        )
    for fsdp, hybrid in zip(rows[::2], rows[1::2], strict=True):  # the rule of thumb
        name = fsdp["model"]
        fits = hybrid["got"]["state"] / GB <= cfg.gpu_gb
        print(
            f"rule of thumb, {name} at N = {fsdp['world']}: HSDP holds "
            f"{hybrid['got']['state'] / GB:.3f} GB of state per GPU (FSDP "
            f"{fsdp['got']['state'] / GB:.3f}) and sends {hybrid['across'] / GB:.3f} GB per step "
            f"on its inter-node axis (FSDP {fsdp['across'] / GB:.3f}): "
            + ("take HSDP" if fits else f"HSDP's state is over {cfg.gpu_gb:g} GB: FSDP")
        )
    ok = max(gaps) == 0
    print(
        f"summary: day22 hsdp at scale, {len(rows)} rows simulated: state and bytes per axis = "
        f"formula {'yes' if ok else 'NO'} (worst gap {max(gaps):.3%})"
    )
    dtl_dist.finish(ok)


if __name__ == "__main__":
    main()
