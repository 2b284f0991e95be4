"""Day 22: HSDP trained, beside one process and hsdp.py's formulas.

    torchrun --standalone --nproc_per_node=4 -m day22_megatron.train_hsdp --replicas=2

The GPT under FSDP2 on a (replicate r, shard N/r) mesh (hsdp.py), a few AdamW steps with global
norm clipping on the global batch split over the N ranks; rank 0 trains the same GPT in one
process and compares losses, gradient norms and parameters. Each rank counts its state after
the last step and the ring bytes its last step sent on each mesh axis, against the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from day22_megatron import hsdp
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.comm import CommCounter
from dtl.data import get_batch, load_corpus
from dtl.model import GPT, PresetName, loss_fn, preset
from dtl.optim import OptimConfig
from dtl.reference import Verdict, one_process_gpt, reference_verdict
from dtl.state import live_state_bytes

MB = 1e6


@dataclass
class Config:
    replicas: int = 2  # r: shard groups (nodes); each shards over world / r ranks
    model: PresetName = "tiny"  # GPT preset
    steps: int = 3  # AdamW steps
    global_batch_size: int = 8  # sequences per step over all ranks
    seq_len: int = 16  # tokens per sequence
    lr: float = 1e-3  # AdamW, decay 0.1 on matrices, clipping at 1.0
    check: bool = True  # rank 0 trains the GPT in one process and compares

    @property
    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, weight_decay=0.1, decay="matrices")

    def validate(self) -> None:
        world = dtl_dist.launch_world_size()
        try:
            hsdp.check_replicas(self.replicas, world)
        except ValueError as e:
            raise dtl_config.ConfigError(str(e)) from None
        if self.global_batch_size % world:
            raise dtl_config.ConfigError(
                f"global batch {self.global_batch_size} does not split over {world} ranks"
            )


def run(cfg: Config, device: torch.device) -> dict:
    """Train on `device`; this rank's losses, norms, full parameters, state and last step's
    bytes per axis, and the padded parameter counts the formulas take."""
    mesh = hsdp.hsdp_mesh(cfg.replicas, device.type)
    gpt = GPT(preset(cfg.model), seed=0).to(device)
    padded, root = hsdp.padded_counts(gpt, dist.get_world_size() // cfg.replicas)
    model = hsdp.apply_hsdp(gpt, mesh)  # each parameter: Replicate over r, Shard(0) over s
    optimizer = cfg.optim.make(model.parameters())
    corpus = load_corpus(tokenizer="byte").train
    rows = cfg.global_batch_size // dist.get_world_size()
    mine = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    losses, norms = [], []
    for step in range(cfg.steps):
        x, y = get_batch(corpus, cfg.seq_len, cfg.global_batch_size, seed=0, step=step)
        x, y = x.to(device), y.to(device)
        with CommCounter() as comm:  # the all-gathers, the reduce-scatter, the all-reduce
            loss = loss_fn(model(x[mine]), y[mine])
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        optimizer.step()
        state = live_state_bytes(model.parameters(), optimizer, counters=False)
        optimizer.zero_grad(set_to_none=True)
        losses.append(dtl_dist.all_reduce_scalar(loss.item(), average=True))
        norms.append(norm.item())
    return dict(
        losses=losses,
        norms=norms,
        full={n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        state=sum(state.values()),
        sent={axis: comm.ring_bytes_on(mesh.get_group(axis)) for axis in hsdp.HSDP_AXES},
        padded=padded,
        root=root,
        device=device,
    )


def formulas_of(cfg: Config, result: dict) -> dict[str, float]:
    """state, and the bytes of each axis, by hsdp.py's formulas."""
    shard = dist.get_world_size() // cfg.replicas
    bytes_ = hsdp.comm_bytes(result["padded"], result["root"], cfg.replicas, shard)
    return dict(state=hsdp.state_bytes(result["padded"], shard), **bytes_)


def one_process(cfg: Config) -> tuple[list[float], dict, list[float]]:
    norms: list[float] = []
    losses, gpt = one_process_gpt(
        preset(cfg.model), load_corpus(tokenizer="byte").train, seq_len=cfg.seq_len,
        rows=cfg.global_batch_size, steps=cfg.steps, lr=cfg.lr, weight_decay=0.1,
        clip_grad=1.0, grad_norms=norms,
    )  # fmt: skip
    return losses, dict(gpt.named_parameters()), norms


def report(cfg: Config, result: dict) -> bool:
    got = dict(state=result["state"], **result["sent"])
    want = formulas_of(cfg, result)
    exact = torch.tensor([float(got == want)], device=result["device"])
    dist.all_reduce(exact, op=dist.ReduceOp.MIN)  # every rank's counts, not rank 0's alone
    dtl_dist.print0("rank 0 (MB: state held; ring bytes sent in the last step, per mesh axis):")
    dtl_dist.print0(f"  {'what':<10}{'measured':>10}{'formula':>10}")
    for key in want:
        dtl_dist.print0(f"  {key:<10}{got[key] / MB:>10.4f}{want[key] / MB:>10.4f}")
    verdict = Verdict.skip("one-process check skipped (check=false)")
    if cfg.check:
        verdict = reference_verdict(
            result["losses"], result["full"], lambda: one_process(cfg), steps=cfg.steps,
            device=result["device"], what="one process", optimizer="AdamW",
            grad_norms=result["norms"],
        )  # fmt: skip
    r, s = cfg.replicas, dist.get_world_size() // cfg.replicas
    dtl_dist.print0(
        f"summary: day22 hsdp replicate {r} x shard {s}, {cfg.model}: {verdict}; state and bytes "
        f"per axis = formula {'yes' if exact.item() else 'NO'} (all ranks)"
    )
    return verdict.ok and bool(exact.item())


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    info = dtl_dist.init()
    dtl_dist.finish(report(cfg, run(cfg, info.device)))


if __name__ == "__main__":
    main()
