"""The one-process reference every parallel run is checked against, and the verdict it gives.

    losses = reference_train(model, batch, optimizer, steps)   # the plain loop, one process
    losses, gpt = one_process_gpt(cfg, tokens, seq_len=.., rows=.., steps=..)  # the scripts' one
    v = reference_verdict(losses, params, reference, steps=5, device=device)
    v.ok, v.loss_rel, v.params_gap       # the record a script decides with
    print(f"summary: ... {v}")          # its one printable line, the same on every rank

`params_gap` (max |difference| between two models), `replica_gap` (are all ranks' copies
identical?) and `flat_params` are the smaller checks the days' tests and scripts use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    (dtl.optim.optimizer_groups, Megatron's rule); `betas` Adam's. `clip_grad`, `grad_norms` and
    `lr_at` as in reference_train. Returns (losses, the trained model)."""
    from dtl.data import get_batch
    from dtl.model import GPT
    from dtl.optim import OptimConfig

    gpt = GPT(model_cfg, seed=seed)
    if make_optimizer:
        opt = make_optimizer(gpt.parameters())
    else:  # torch's AdamW default (0.01 on everything), or the given decay on the matrices
        wd, decay = (0.01, "all") if weight_decay is None else (weight_decay, "matrices")
        opt = OptimConfig(lr=lr, eps=eps, weight_decay=wd, betas=betas, decay=decay).make(gpt)

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


# The tolerances every check states. Losses and gradient norms agree to a relative 1e-5 in fp32:
# the runs add the same numbers in another order. Parameters after AdamW are judged absolutely:
# Adam divides by sqrt(v), so an element whose gradient is rounding noise moves by up to lr in
# either run; PARAMS_ATOL is 10% of one step at lr 1e-3, and a run that states another says why.
LOSS_RTOL = 1e-5
PARAMS_ATOL = 1e-4
# gradient norms of AdamW runs against one process, after the first step: the two runs' weights
# differ where Adam divides rounding noise by sqrt(v) ~ eps, and the next norms, taken at those
# weights, move more than the losses (4.0e-4 on `small` over 4 steps, day 23; up to 4.6e-4 on
# day 28's `small` runs; 2e-5 on `tiny`). A gradient off by a constant factor is off by that
# factor, which 1e-3 still sees. Used by days 23 and 28.
ADAM_NORM_RTOL = 1e-3


@dataclass(frozen=True)
class Verdict:
    """A parallel run against its one-process reference: the numbers, and the line notes quote.

    ok          every judged figure within its tolerance, and as many steps on both sides
    loss_rel    max relative difference of the per-step losses (judged against rtol)
    params_gap  max |difference| of the parameters after the last step (judged against atol)
    norm_rel    max relative difference of the per-step gradient norms, judged against rtol
                where both runs gave them (None: not compared)
    counts      "" when both runs gave `steps` losses (and norms); else what was missing
    skipped     why no comparison ran ("" when one did); such a verdict is ok, and its line says why
    """

    ok: bool
    loss_rel: float
    params_gap: float
    rtol: float
    steps: int
    what: str = "one process"
    optimizer: str = "AdamW"
    norm_rel: float | None = None
    atol: float = PARAMS_ATOL
    norm_rtol: float | None = None  # the norms' own tolerance where it differs from rtol
    counts: str = ""
    skipped: str = ""

    @classmethod
    def skip(cls, why: str) -> Verdict:
        """No comparison (a run too large, a precision the reference does not share, ...)."""
        nan = float("nan")
        return cls(ok=True, loss_rel=nan, params_gap=nan, rtol=nan, steps=0, skipped=why)

    @property
    def line(self) -> str:
        if self.skipped:
            return self.skipped
        short = lambda x: f"{x:.0e}".replace("e-0", "e-")  # noqa: E731  1e-5, as notes print it
        norm_tol = self.rtol if self.norm_rtol is None else self.norm_rtol
        norms = (
            "" if self.norm_rel is None
            else f"grad norms max rel diff {self.norm_rel:.1e}, rtol {short(norm_tol)}; "
        )  # fmt: skip
        counts = f"; {self.counts}" if self.counts else ""
        return (
            f"losses match {self.what} {'yes' if self.ok else 'NO'} (max rel diff "
            f"{self.loss_rel:.1e}, rtol {short(self.rtol)}; {norms}params max |diff| "
            f"{self.params_gap:.1e}, atol {short(self.atol)}; after {self.steps} "
            f"{self.optimizer} steps{counts})"
        )

    def __str__(self) -> str:
        return self.line


def _max_rel(a, b) -> float:
    return max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=0.0)


def _count_gaps(steps: int, lengths: dict[str, int]) -> str:
    """'' when every series has `steps` values; else which do not (zip would hide it).
    A length of -1: a series not given, not judged."""
    short = [f"{name} {n}" for name, n in lengths.items() if n >= 0 and n != steps]
    return f"values per run, {steps} expected: {', '.join(short)}" if short else ""


SERIES = ("losses", "reference losses", "grad norms", "reference norms")


def reference_verdict(
    losses,
    params,
    reference,
    *,
    steps: int,
    device,
    what: str = "one process",
    rtol: float = LOSS_RTOL,
    atol: float = PARAMS_ATOL,
    optimizer: str = "AdamW",
    grad_norms: list[float] | None = None,
    norm_rtol: float | None = None,
) -> Verdict:
    """The check a training script ends with, the same Verdict on every rank.

    `reference()` runs on rank 0 only and returns (losses, {name: parameter}) of the one-process
    run, or (losses, params, grad_norms) to compare the norms too; `losses`, `params` (name ->
    full tensor, on rank 0) and `grad_norms` are the parallel run's. Judged: the losses (and the
    norms, where both runs gave them) within `rtol`, the parameters after the last step within
    `atol` (the loss of step k sees only the updates before it: the last update shows in the
    parameters alone), and `steps` values on each side. `norm_rtol`: the norms' tolerance, where a
    script states another than `rtol` (and why). The numbers are broadcast (on `device`:
    NCCL needs CUDA tensors) so every rank prints and exits alike.
    """
    # loss_rel, params gap, norm_rel, then the four series' lengths (-1: not judged)
    numbers = torch.zeros(3 + len(SERIES), dtype=torch.float64, device=device)
    if dist.get_rank() == 0:
        ref = reference()
        ref_norms = ref[2] if len(ref) > 2 else None
        judged = bool(grad_norms) and ref_norms is not None
        series = (losses, ref[0], grad_norms if judged else None, ref_norms if judged else None)
        loss_rel = _max_rel(losses, ref[0])
        gap = params_gap({k: v.cpu() for k, v in params.items()}, ref[1])
        norm_rel = _max_rel(grad_norms, ref_norms) if judged else -1.0
        row = [loss_rel, gap, norm_rel, *(len(v) if v is not None else -1 for v in series)]
        numbers = torch.tensor(row, dtype=torch.float64, device=device)
    dist.broadcast(numbers, src=0)  # (7,) float64 from rank 0 -> every rank
    loss_rel, gap, norm_rel, *lengths = numbers.tolist()
    counts = _count_gaps(steps, {k: int(n) for k, n in zip(SERIES, lengths)})
    norm_tol = rtol if norm_rtol is None else norm_rtol
    ok = loss_rel <= rtol and gap <= atol and norm_rel <= norm_tol and not counts
    return Verdict(
        ok=ok, loss_rel=loss_rel, params_gap=gap, rtol=rtol, steps=steps, what=what,
        optimizer=optimizer, norm_rel=None if norm_rel < 0 else norm_rel, atol=atol,
        norm_rtol=norm_rtol, counts=counts,
    )  # fmt: skip


def dense_verdict(losses, params, model_cfg, tokens, *, seq_len: int, rows: int, steps: int,
                  device, check: bool = True, **gpt_kwargs) -> Verdict:  # fmt: skip
    """A model-parallel run (TP, SP, CP) against the dense model: rank 0 trains
    one_process_gpt(model_cfg, tokens, ...) on the global batch and compares its losses and
    parameters (named_parameters(), a tied weight once) with the run's; every rank gets the
    Verdict. check=False: skipped, said so."""
    if not check:
        return Verdict.skip("dense check skipped (check=false)")

    def dense_run():  # rank 0 only: the dense model in one process on the global batch
        kw = dict(seq_len=seq_len, rows=rows, steps=steps, **gpt_kwargs)
        ref_losses, dense = one_process_gpt(model_cfg, tokens, **kw)
        return ref_losses, dict(dense.named_parameters())

    return reference_verdict(
        losses, params, dense_run, steps=steps, device=device, what="the dense model"
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
