"""Day 24: train the shared GPT with checkpoints that survive kills, resharding and restarts.

CPU (gloo), ~5 s:
    torchrun --standalone --nproc_per_node=2 -m day24_checkpoint.train --parallel=ddp
    torchrun --standalone --nproc_per_node=2 -m day24_checkpoint.train --parallel=fsdp2 --async_save
    # resume on 4 ranks from the 2-rank FSDP2 checkpoint (DCP reshards), 4 more steps:
    torchrun --standalone --nproc_per_node=4 -m day24_checkpoint.train --parallel=fsdp2 --steps=16
    # tensor parallelism (day 22's stack, tp 2 x dp world/2; sharded.py: its shards as DTensors)
    torchrun --standalone --nproc_per_node=2 -m day24_checkpoint.train --parallel=tp
    # a rank killed at step 7, torchrun restarts the workers, they resume from step 4:
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m day24_checkpoint.train \
        --fail_at_step=7 --out_dir=outputs/day24_checkpoint/drill
GPUs (NCCL): the same lines with --nproc_per_node=gpu --config day24_checkpoint/gpu.toml

Each step's batch is a pure function of (seed, step): the global batch is cut over the ranks, so a
run resumed at another world size sees the same rows. Losses go to <out_dir>/losses.jsonl (every
attempt, exact float.hex values), and the run ends with the sha256 of the full parameters: two
runs are bit-identical when both agree. Drills (first attempt only, i.e. TORCHELASTIC_RESTART_COUNT
0): --fail_at_step kills rank --fail_rank with SIGKILL before that step; --fail_during_save kills it
while it writes that step's checkpoint (its shard on disk, the commit not done).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from day24_checkpoint.ckpt import AppState, Checkpointer, CheckpointError, latest, verify
from day24_checkpoint.faults import Faults, LossRecord, restart_count
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.data import get_batch, load_corpus
from dtl.metrics import StepLogger
from dtl.model import GPT, PresetName, loss_fn, preset
from dtl.optim import warmup_cosine

PARALLEL = ("ddp", "fsdp2", "tp")
TP = 2  # --parallel=tp: the tensor-parallel size; dp = world / TP
RESUME = ("auto", "none", "latest")
FAIL_RANK = 1  # the rank a drill kills unless --fail_rank names another


@dataclass
class Config:
    # ddp | fsdp2 (FSDP2's fully_shard: every rank saves its shards) | tp (day 22's stack at
    # tp 2 x dp world/2, saved by sharded.py: each TP shard a DTensor, loadable at any layout)
    parallel: Literal[PARALLEL] = "ddp"
    model: PresetName = "tiny"  # GPT preset
    dropout: float = 0.1  # > 0, so that a resumed run needs each rank's RNG state back
    global_batch: int = 8  # sequences per step, cut over the ranks (the same rows at any world)
    seq_len: int = 32  # tokens per sequence
    steps: int = 12  # the step the run ends at (a resumed run trains the rest)
    lr: float = 3e-3  # AdamW peak learning rate (linear warm-up, cosine decay to lr / 10)
    warmup: int = 2  # warm-up steps
    save_every: int = 4  # steps between checkpoints
    keep: int = 3  # committed checkpoints kept (older ones deleted)
    async_save: bool = False  # stage a copy, write it from a thread on its own process group
    resume: str = "auto"  # auto (latest if any) | none | latest (must exist) | a checkpoint path
    restore_rng: bool = True  # restore each rank's generator (false: show what goes wrong)
    ckpt_dir: str = ""  # empty: <out_dir>/ckpt
    seed: int = 0  # model init, batches, dropout streams (seed + rank)
    step_sleep_s: float = 0.0  # sleep per step (slows a run down for a manual elastic test)
    hold_at_step: int = -1  # drill (elastic): alone after saving this step, wait for a node
    hold_s: float = 60.0  # ... at most this long (the agent restarts us when one joins)
    fail_at_step: int = -1  # drill: SIGKILL rank fail_rank before this step (first attempt)
    fail_during_save: int = -1  # drill: SIGKILL rank fail_rank while writing this step's save
    fail_rank: int = FAIL_RANK  # drill: the rank that dies
    out_dir: str = ""  # empty: outputs/day24_checkpoint/<parallel>

    def validate(self) -> None:
        err = dtl_config.ConfigError
        world = dtl_dist.launch_world_size()
        if self.global_batch % world:
            raise err(f"global_batch {self.global_batch} does not split over {world} ranks")
        if self.parallel == "tp" and world % TP:
            raise err(f"parallel=tp runs tp {TP} x dp world/{TP}: {world} ranks do not split")
        if self.keep < 1:
            raise err(f"keep must be >= 1 (checkpoints kept), got {self.keep}")
        self._check_drill(world)
        self.out_dir = self.out_dir or f"outputs/day24_checkpoint/{self.parallel}"
        self.ckpt_dir = self.ckpt_dir or os.path.join(self.out_dir, "ckpt")
        dtl_config.ensure_writable_dir(self.ckpt_dir, "ckpt_dir")
        if self.resume not in RESUME and not os.path.isdir(self.resume):
            raise err(f"resume '{self.resume}' is neither {', '.join(RESUME)} nor a folder")
        try:  # the checkpoint a resume will read: present, intact, this model's
            path = self.resume_path()
            if path is not None:
                verify(path, asdict(self.model_config()))
        except CheckpointError as e:
            raise err(str(e)) from None

    def _check_drill(self, world: int) -> None:
        """A drill's rank, or a --fail_rank given, must be one of this run's ranks."""
        drill = self.fail_at_step >= 0 or self.fail_during_save >= 0
        if (drill or self.fail_rank != FAIL_RANK) and not 0 <= self.fail_rank < world:
            raise dtl_config.ConfigError(
                f"fail_rank {self.fail_rank} is not a rank of this run (ranks 0-{world - 1})"
            )

    def model_config(self):
        return preset(self.model, dropout=self.dropout)

    def resume_path(self) -> str | None:
        if self.resume == "none":
            return None
        if self.resume in ("auto", "latest"):
            path = latest(self.ckpt_dir)
            if path is None and self.resume == "latest":
                raise CheckpointError(f"resume=latest but {self.ckpt_dir} holds no checkpoint")
            return path
        return self.resume


def build_tp(cfg: Config, info):
    """Day 22's stack at tp 2 x dp world/2 (no pipeline), the same AdamW and schedule."""
    from day22_megatron.stack import build_stack
    from dtl.grid import ParallelGrid

    grid = ParallelGrid(tp=TP, dp=info.world_size // TP)
    stack = build_stack(
        cfg.model_config(),
        grid,
        micro_batch_size=cfg.global_batch // grid.dp_size,
        microbatches=1,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        device=info.device,
    )
    stack.optimizer = torch.optim.AdamW(stack.params, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(stack.optimizer, _schedule(cfg))
    return stack, sched


def build(cfg: Config, info):
    gpt = GPT(cfg.model_config(), seed=cfg.seed).to(info.device)
    if info.world_size == 1:
        model = gpt
    elif cfg.parallel == "ddp":
        model = DDP(gpt)
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        # the run's device type, not FSDP2's default (torch's accelerator: CUDA on any GPU
        # machine, which under gloo would put the shards on cuda:0 beside the CPU batches)
        mesh = DeviceMesh.from_group(dist.group.WORLD, info.device.type)
        for block in gpt.blocks.values():  # each block its own all-gather unit, then the rest
            fully_shard(block, mesh=mesh)
        model = fully_shard(gpt, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg))
    return gpt, model, opt, sched


def _schedule(cfg: Config):
    return lambda step: warmup_cosine(step, warmup=cfg.warmup, steps=cfg.steps, min_ratio=0.1)


def params_sha256(model) -> str:
    """sha256 over every full parameter's bytes, in name order (collective under FSDP2)."""
    full = {}
    for name, p in model.named_parameters():
        full[name] = p.full_tensor() if hasattr(p, "full_tensor") else p
    return tensors_sha256(full)


def tensors_sha256(tensors: dict) -> str:
    digest = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run(cfg: Config, info) -> dict:
    corpus = load_corpus(tokenizer="byte" if cfg.model.startswith("tiny") else "auto")
    tp = cfg.parallel == "tp"
    # ParallelGrid puts tp innermost: rank = dp_rank x TP + tp_rank
    per_replica = TP if tp else 1
    dp_rank, dp_size = info.rank // per_replica, info.world_size // per_replica
    # each DP rank's dropout stream; the TP ranks of one replica draw the same masks, since
    # dropout acts on activations they hold whole
    torch.manual_seed(cfg.seed + dp_rank)
    if tp:
        from day24_checkpoint.sharded import StackState

        stack, sched = build_tp(cfg, info)
        opt = stack.optimizer
        app = StackState(stack, restore_rng=cfg.restore_rng, scheduler=sched)
    else:
        gpt, model, opt, sched = build(cfg, info)
        app = AppState(model, opt, sched, restore_rng=cfg.restore_rng)
    faults = Faults(cfg, info.rank)  # the drills' kills and holds (faults.py)
    ckpt = Checkpointer(
        cfg.ckpt_dir,
        keep=cfg.keep,
        async_save=cfg.async_save,
        config=asdict(cfg.model_config()),
        on_write=faults.on_write,
    )
    start, resumed = 0, "none"
    path = cfg.resume_path()
    if path is not None:
        t0 = time.perf_counter()
        start = ckpt.load(app, path)
        resumed = f"step {start}"
        dtl_dist.print0(
            f"resumed from {path} (step {start}) at world size {info.world_size} in "
            f"{time.perf_counter() - t0:.2f} s; attempt {restart_count()}"
        )
    per_rank = cfg.global_batch // dp_size
    log = StepLogger(cfg.out_dir, cfg.steps, tokens_per_step=cfg.global_batch * cfg.seq_len)
    record = LossRecord(cfg.out_dir, info.is_main, fresh=start == 0 and restart_count() == 0)
    for step in range(start, cfg.steps):
        faults.before_step(step)
        x, y = get_batch(
            corpus.train,
            cfg.seq_len,
            per_rank,
            seed=cfg.seed,
            step=step,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
        t0 = time.perf_counter()
        x, y = x.to(info.device), y.to(info.device)
        if tp:
            loss = stack_step(stack, x, y)
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
            loss = loss.item()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        app.progress.step, app.progress.samples = step + 1, (step + 1) * cfg.global_batch
        mean = dtl_dist.all_reduce_scalar(loss, average=True)
        blocked = 0.0
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            blocked = ckpt.save(app, step + 1).blocked_s
        ckpt.poll()
        record.add(step, mean, info.world_size)  # exact values, every attempt: the drills read it
        time.sleep(cfg.step_sleep_s)
        faults.after_step(step, info.world_size)
        log.log(
            step, loss=mean, dt_s=time.perf_counter() - t0, save_blocked_ms=f"{blocked * 1e3:.1f}"
        )
    ckpt.wait()
    log.close()
    if tp:
        from day22_megatron.stack import full_state

        sha = tensors_sha256(full_state(stack))
    else:
        sha = params_sha256(gpt if cfg.parallel == "ddp" else model)
    return dict(sha=sha, ckpt=ckpt, resumed=resumed)


def stack_step(stack, x, y) -> float:
    """Forward and backward through day 22's stack (vocab-parallel loss), DP gradients
    averaged; returns the loss (every TP rank holds it whole)."""
    from day22_megatron.stack import forward_backward, sync_gradients

    loss = forward_backward(stack, [(x, y)])
    sync_gradients(stack)
    return loss


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    # bit-identical resumes on a GPU need kernels that give the same bits every time: cuBLAS
    # picks a split-K reduction order per workspace unless this is set before its first call
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    info = dtl_dist.init()
    if info.device.type == "cuda":  # an op with no deterministic kernel warns (not on a CPU)
        torch.use_deterministic_algorithms(True, warn_only=True)
    dtl_config.save(cfg, cfg.out_dir, argv)
    result = run(cfg, info)
    records = result["ckpt"].records
    blocked = sum(r.blocked_s for r in records) / max(1, len(records))
    dtl_dist.print0(
        f"summary: day24 parallel={cfg.parallel} world={info.world_size} steps={cfg.steps} "
        f"resumed={result['resumed']} attempt={restart_count()}: final params sha256 "
        f"{result['sha'][:16]}; {len(records)} {'async' if cfg.async_save else 'sync'} saves, "
        f"training blocked {blocked * 1e3:.1f} ms per save (mean); latest {latest(cfg.ckpt_dir)}"
    )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
