"""Run a function on N gloo ranks from pytest: spawn, a FileStore, no ports, fast failure.

    def _body(scale):                      # module level, so spawn can pickle it
        t = torch.ones(3) * dist.get_rank()
        dist.all_reduce(t)
        return t

    results = run_distributed(_body, 2.0, world_size=4)   # [rank0's return, rank1's, ...]

If any rank raises, the test fails at once with that rank's traceback, and the other ranks (which
may be blocked in a collective waiting for the dead one) are killed, not left to time out.

The other half of every check is the one-process reference: `reference_train` (the plain loop
that a parallel run must reproduce), `one_process_gpt` (that loop for the shared GPT on the global
batch, the training scripts' reference), `params_gap` (max |difference| between two models) and
`replica_gap` (are all ranks' copies identical?), used by every day's tests and scripts.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import get_all_start_methods

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtl.dist import cleanup
from dtl.script_server import run_script


def script_error(module: str, *args: str, env: dict | None = None, timeout_s: float = 120) -> str:
    """Run `python -m module args` (no torchrun, no process group) expecting bad input to stop
    it: asserts exit code 2 and exactly one line on stderr, and returns that line. The run is a
    fork of dtl.script_server's interpreter (torch imported once, not per check)."""
    run = run_script(module, *args, env={**os.environ, **(env or {})}, timeout_s=timeout_s)
    assert run.code == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert not run.group, f"{module} stopped after creating a process group"
    return lines[0]


class RankFailed(AssertionError):
    """A rank raised: the message carries its traceback."""


def _worker(rank, world_size, store_path, fn, args, kwargs, results, timeout_s, environ):
    os.environ.clear()  # the caller's environment now, not the fork server's from its start
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # plain pickle, not torch's shared-memory handles: the rank may exit before we read it
        payload = pickle.dumps(fn(*args, **kwargs))
        cleanup()  # before reporting "ok": a failing cleanup is reported as this rank's error
        results.put((rank, "ok", payload))
    except BaseException:  # noqa: BLE001 - the whole point is to report anything
        results.put((rank, "error", traceback.format_exc()))


# What every rank imports anyway (~2.7 s of CPU each here): the fork server imports it once and
# forks each rank from there, instead of a fresh interpreter importing torch per rank (spawn).
# megatron-core (~6 s more, torch._inductor included) and DeepSpeed too where installed: DeepSpeed
# only when DS_ACCELERATOR is set, since it picks its accelerator once, at import.
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "dtl.dist", "dtl.model"]
OPTIONAL_PRELOAD = {"megatron.core": None, "deepspeed": "DS_ACCELERATOR"}


def _preload() -> list[str]:
    names = list(PRELOAD)
    for name, needs_env in OPTIONAL_PRELOAD.items():
        installed = importlib.util.find_spec(name.split(".")[0]) is not None
        if installed and (not needs_env or needs_env in os.environ):
            names.append(name)
    return names


def _context():
    """The multiprocessing context of the ranks: "forkserver" preloaded with PRELOAD (a fork of
    a clean server process that has started no thread, unlike forking pytest itself), or
    "spawn" where there is no fork server or DTL_SPAWN=1 asks for it."""
    if os.environ.get("DTL_SPAWN") == "1" or "forkserver" not in get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preload())
    return ctx


def run_distributed(fn, *args, world_size: int = 2, timeout_s: float = 120, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results."""
    ctx = _context()
    results = ctx.Queue()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(  # not a daemon: a rank may start processes of its own (async checkpoints)
                target=_worker,
                args=(r, world_size, store_path, fn, args, kwargs, results, timeout_s, environ),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            outputs = _collect(procs, results, world_size, timeout_s)
        except BaseException:
            _reap(procs, grace_s=0)  # the others may be blocked on the failed rank: kill them now
            raise
        _reap(procs, grace_s=10)
    # a rank that returned its result but then died at exit (gloo's abort without cleanup())
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RankFailed(f"rank {bad[0][0]} finished but exited with code {bad[0][1]}")
    return [outputs[r] for r in range(world_size)]


def _collect(procs, results, world_size, timeout_s) -> dict:
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s + 30
    while len(outputs) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [
                i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in outputs
            ]
            if dead:
                raise RankFailed(
                    f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                ) from None
            if time.monotonic() > deadline:
                raise RankFailed(
                    f"ranks {sorted(set(range(world_size)) - set(outputs))} "
                    f"did not finish in {timeout_s + 30:.0f} s"
                ) from None
            continue
        if status == "error":
            raise RankFailed(f"rank {rank} failed:\n{payload}")
        outputs[rank] = pickle.loads(payload)
    return outputs


def _reap(procs, grace_s: float) -> None:
    for p in procs:
        p.join(timeout=grace_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


# --- the one-process reference and the checks every day compares against -----------------------


def default_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of model(x) against y (the GPT's loss_fn; works for (B, classes) too)."""
    from dtl.model import loss_fn

    return loss_fn(model(x), y)


def reference_train(
    model: torch.nn.Module,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    steps: int,
    loss: Callable = default_loss,
    *,
    clip_grad: float | None = None,
    grad_norms: list[float] | None = None,
    lr_at: Callable[[int], float] | None = None,
) -> list[float]:
    """`steps` plain training steps: the loop every parallel run is compared with.

    `batch(step)` returns that step's (x, y). In one process it is the *global* batch (what all
    ranks see together); a data-parallel rank may run this same loop on its own slice, with a
    wrapped model, and must end where the one-process run ends. Returns the losses.
    `clip_grad`: clip the global gradient norm to it before each step (Megatron's and nanoGPT's
    clip_grad); `grad_norms`, if given, receives each step's norm before clipping. `lr_at(step)`,
    if given, sets every parameter group's learning rate before that step (a schedule).
    """
    losses = []
    for step in range(steps):
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        value = loss(model, x, y)
        value.backward()
        if clip_grad is not None or grad_norms is not None:
            limit = clip_grad if clip_grad else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
            if grad_norms is not None:
                grad_norms.append(norm.item())
        optimizer.step()
        losses.append(value.item())
    return losses


def one_process_gpt(
    model_cfg,
    tokens: torch.Tensor,
    *,
    seq_len: int,
    rows: int,
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    make_optimizer: Callable | None = None,
    weight_decay: float | None = None,
    eps: float = 1e-8,
    betas: tuple[float, float] = (0.9, 0.999),
    clip_grad: float | None = None,
    grad_norms: list[float] | None = None,
    lr_at: Callable[[int], float] | None = None,
):
    """The training scripts' one-process reference: GPT(model_cfg, seed) trained `steps` steps on
    the global batch, `rows` sequences of `seq_len` from `tokens` per step (dtl.data.get_batch,
    the same rows the ranks split among themselves). The optimizer: `make_optimizer(params)` if
    given; else AdamW(lr, eps), with torch's default decay (0.01 on every parameter, what the
    days' scripts use) or, given `weight_decay`, decay on the matrices only
    (dtl.model.optimizer_groups, Megatron's rule); `betas` Adam's. `clip_grad`, `grad_norms` and
    `lr_at` as in reference_train. Returns (losses, the trained model)."""
    from dtl.data import get_batch
    from dtl.model import GPT, optimizer_groups

    gpt = GPT(model_cfg, seed=seed)
    if make_optimizer:
        opt = make_optimizer(gpt.parameters())
    elif weight_decay is None:
        opt = torch.optim.AdamW(gpt.parameters(), lr=lr, eps=eps, betas=betas)
    else:
        opt = torch.optim.AdamW(optimizer_groups(gpt, weight_decay), lr=lr, eps=eps, betas=betas)

    def batch(step):
        return get_batch(tokens, seq_len, rows, seed=seed, step=step)

    losses = reference_train(
        gpt, batch, opt, steps, clip_grad=clip_grad, grad_norms=grad_norms, lr_at=lr_at
    )
    return losses, gpt


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flattened and concatenated (a tied weight once), detached."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def params_gap(a, b) -> float:
    """max |a - b| over all parameters of two modules (or state dicts) with the same names."""
    sa = a if isinstance(a, dict) else dict(a.named_parameters())
    sb = b if isinstance(b, dict) else dict(b.named_parameters())
    if sa.keys() != sb.keys():
        raise ValueError(f"parameter names differ: {sorted(sa.keys() ^ sb.keys())[:5]}")
    return max((sa[k].detach().double() - sb[k].detach().double()).abs().max().item() for k in sa)


def reference_verdict(
    losses,
    params,
    reference,
    *,
    steps: int,
    device,
    what: str = "one process",
    rtol: float = 1e-5,
    optimizer: str = "AdamW",
) -> str:
    """The check a training script ends with, as one printable phrase on every rank.

    `reference()` runs on rank 0 only and returns (losses, {name: parameter}) of the one-process
    run; `losses` and `params` (name -> full tensor, on rank 0) are the parallel run's. The
    losses must agree within `rtol`; the parameters' largest difference is reported. The verdict
    is broadcast (on `device`: NCCL needs CUDA tensors) so every rank prints and exits alike.
    """
    verdict = torch.zeros(3, dtype=torch.float64, device=device)
    if dist.get_rank() == 0:
        ref_losses, ref_params = reference()
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        gap = params_gap({k: v.cpu() for k, v in params.items()}, ref_params)
        verdict = torch.tensor([rel, gap, float(rel <= rtol)], dtype=torch.float64, device=device)
    dist.broadcast(verdict, src=0)
    rel, gap, ok = verdict.tolist()
    tol = f"{rtol:.0e}".replace("e-0", "e-")  # 1e-5, as the notes print it
    return (
        f"losses match {what} {'yes' if ok else 'NO'} (max rel diff {rel:.1e}, rtol {tol}; "
        f"params max |diff| {gap:.1e} after {steps} {optimizer} steps)"
    )


def replica_gap(model: torch.nn.Module, group=None) -> float:
    """max |p - p on the group's first rank| over all parameters and ranks: 0.0 when identical.

    Every rank of `group` must call it (a broadcast and an all_reduce).
    """
    flat = flat_params(model)
    ref = flat.clone()
    dist.broadcast(ref, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    gap = (flat - ref).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=group)
    return gap.item()
