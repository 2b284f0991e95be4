"""Day 24: the faults the drills inject into train.py, and the record they read back, kept out of
the training loop so that it reads as a plain loop.

    faults = Faults(cfg, rank)          # --fail_at_step, --fail_during_save, --hold_at_step
    faults.before_step(step)            # SIGKILL before this step (first attempt only)
    Checkpointer(..., on_write=faults.on_write)   # SIGKILL while this step's shard is written
    faults.after_step(step, world)      # the elastic drill: idle until a node joins
    record = LossRecord(out_dir, is_main, fresh)  # losses.jsonl: exact values, every attempt

A fault fires on the first attempt only (TORCHELASTIC_RESTART_COUNT 0): the restarted workers
must resume from the checkpoint and finish, which is what the drills check.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch.distributed as dist


def restart_count() -> int:
    """Which attempt this is: torchrun's restarts of the workers so far."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def die(reason: str) -> None:
    print(f"[rank {dist.get_rank()}] drill: {reason}; SIGKILL at t={time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def hold_for_a_node(seconds: float) -> None:
    """The elastic drill's handshake: the checkpoint is committed; idle until the agent, seeing
    a node waiting to join, stops this worker and restarts all of them at the larger world."""
    print(
        f"holding at world size 1 for up to {seconds:.0f} s: waiting for a node to join", flush=True
    )
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)


class Faults:
    """The config's drills for this rank (train.Config: fail_at_step, fail_during_save,
    fail_rank, hold_at_step, hold_s; -1 / 0 where unset)."""

    def __init__(self, cfg, rank: int):
        self.cfg, self.rank = cfg, rank

    def _armed(self) -> bool:
        return self.rank == self.cfg.fail_rank and restart_count() == 0

    def before_step(self, step: int) -> None:
        if step == self.cfg.fail_at_step and self._armed():
            die(f"killed before step {step}")

    def on_write(self, step: int) -> None:
        """Checkpointer's hook, called after this rank's shard is written, before the commit."""
        if step == self.cfg.fail_during_save and self._armed():
            die(f"killed while writing the step-{step} checkpoint")

    def after_step(self, step: int, world: int) -> None:
        if step + 1 == self.cfg.hold_at_step and world == 1:
            hold_for_a_node(self.cfg.hold_s)


class LossRecord:
    """<out_dir>/losses.jsonl: each step's mean loss as exact float.hex, with the attempt and
    world size, appended by rank 0 on every attempt (the drills compare runs with it)."""

    def __init__(self, out_dir: str, is_main: bool, fresh: bool):
        self.path, self.is_main = os.path.join(out_dir, "losses.jsonl"), is_main
        if is_main and fresh:
            open(self.path, "w").close()  # a fresh run starts a fresh record

    def add(self, step: int, loss: float, world: int) -> None:
        if not self.is_main:
            return
        line = dict(step=step, loss=loss.hex(), attempt=restart_count(), world=world)
        with open(self.path, "a") as f:
            f.write(json.dumps({**line, "time": time.time()}) + "\n")
