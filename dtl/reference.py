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

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    import numpy as np

    from dtl.model import GPT, GPTConfig


def default_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of model(x) against y (the GPT's loss_fn; works for (B, classes) too)."""
    from dtl.model import loss_fn

    return loss_fn(model(x), y)


def sliced_loss(
    slices: int,
) -> Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mean over `slices` equal runs of consecutive rows, one forward each: what ranks that
    each run their own rows compute together when a layer's output depends on its whole input
    (an MoE's load-balancing loss counts the tokens of one forward)."""
    from dtl.model import loss_fn
    from dtl.moe import set_aux_loss_scale

    def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        set_aux_loss_scale(model, 1 / slices)  # each forward's share of the loss
        parts = zip(x.chunk(slices), y.chunk(slices), strict=True)
        return cast(torch.Tensor, sum(loss_fn(model(a), b) for a, b in parts)) / slices

    return loss


def reference_train(
    model: torch.nn.Module,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    steps: int,
    loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = default_loss,
    *,
    clip_grad: float | None = None,
    grad_norms: list[float] | None = None,
    lr_at: Callable[[int], float] | None = None,
    noise_steps: dict[str, torch.Tensor] | None = None,
    noise_floor: float = 0.0,
) -> list[float]:
    """`steps` plain training steps: the loop every parallel run is compared with.

    `batch(step)` returns that step's (x, y). In one process it is the *global* batch (what all
    ranks see together); a data-parallel rank may run this same loop on its own slice, with a
    wrapped model, and must end where the one-process run ends. Returns the losses.
    `clip_grad`: clip the global gradient norm to it before each step (Megatron's and nanoGPT's
    clip_grad); `grad_norms`, if given, receives each step's norm before clipping. `lr_at(step)`,
    if given, sets every parameter group's learning rate before that step (a schedule).
    `noise_steps`, if given, receives per parameter name the count, element by element, of the
    steps at which its gradient was within `noise_floor` of zero (see adam_allowance).
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
        if noise_steps is not None:
            _count_noise(model, noise_steps, noise_floor)
        if clip_grad is not None or grad_norms is not None:
            limit = clip_grad if clip_grad else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
            if grad_norms is not None:
                grad_norms.append(norm.item())
        optimizer.step()
        losses.append(value.item())
    return losses


def _count_noise(model: torch.nn.Module, counts: dict[str, torch.Tensor], floor: float) -> None:
    for name, p in model.named_parameters():
        near_zero = (p.grad.abs() <= floor) if p.grad is not None else torch.ones_like(p)
        counts[name] = counts.get(name, 0) + near_zero.to(torch.int32).cpu()


def one_process_gpt(
    model_cfg: GPTConfig,
    tokens: np.ndarray | torch.Tensor,
    *,
    seq_len: int,
    rows: int,
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    make_optimizer: Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    weight_decay: float | None = None,
    eps: float = 1e-8,
    betas: tuple[float, float] = (0.9, 0.999),
    clip_grad: float | None = None,
    grad_norms: list[float] | None = None,
    lr_at: Callable[[int], float] | None = None,
    noise_steps: dict[str, torch.Tensor] | None = None,
    slices: int = 1,
) -> tuple[list[float], GPT]:
    """The training scripts' one-process reference: GPT(model_cfg, seed) trained `steps` steps on
    the global batch, `rows` sequences of `seq_len` from `tokens` per step (dtl.data.get_batch,
    the same rows the ranks split among themselves). The optimizer: `make_optimizer(params)` if
    given; else AdamW(lr, eps), with torch's default decay (0.01 on every parameter, what the
    days' scripts use) or, given `weight_decay`, decay on the matrices only
    (dtl.optim.optimizer_groups, Megatron's rule); `betas` Adam's. `clip_grad`, `grad_norms` and
    `lr_at` as in reference_train; `noise_steps` as there, with the floor ADAM_NOISE_EPS x eps;
    `slices` > 1: the loss of sliced_loss (an MoE's ranks and micro-batches, one forward each).
    Returns (losses, the trained model)."""
    from dtl.data import get_batch
    from dtl.model import GPT
    from dtl.optim import OptimConfig

    gpt = GPT(model_cfg, seed=seed)
    if make_optimizer:
        opt = make_optimizer(gpt.parameters())
    else:  # torch's AdamW default (0.01 on everything), or the given decay on the matrices
        decay: Literal["all", "matrices"]
        wd, decay = (0.01, "all") if weight_decay is None else (weight_decay, "matrices")
        opt = OptimConfig(lr=lr, eps=eps, weight_decay=wd, betas=betas, decay=decay).make(gpt)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(tokens, seq_len, rows, seed=seed, step=step)

    losses = reference_train(
        gpt,
        batch,
        opt,
        steps,
        sliced_loss(slices) if slices > 1 else default_loss,
        clip_grad=clip_grad,
        grad_norms=grad_norms,
        lr_at=lr_at,
        noise_steps=noise_steps,
        noise_floor=ADAM_NOISE_EPS * eps,
    )
    return losses, gpt


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flattened and concatenated (a tied weight once), detached."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def params_gap(
    a: torch.nn.Module | dict[str, torch.Tensor], b: torch.nn.Module | dict[str, torch.Tensor]
) -> float:
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
# Where Adam turns rounding into a visible difference: an element whose gradient is within a few
# eps of zero (u = m / (sqrt(v) + eps) is then steep in g), as a gradient that is zero in exact
# arithmetic is (a GELU unit that is off for every token, the attention key bias). Two runs that
# add the same numbers in another order may move such an element apart by up to Adam's largest
# step, in either direction, at each step it was that small: adam_allowance says by how much.
ADAM_NOISE_EPS = 10


def adam_step_bound(betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """Adam's largest step in units of lr (Kingma & Ba 2015, section 2.1):
    (1 - beta1) / sqrt(1 - beta2) when that exceeds 1, else 1. 3.16 for (0.9, 0.999)."""
    beta1, beta2 = betas
    return max(1.0, (1 - beta1) / math.sqrt(1 - beta2))


def adam_allowance(
    noise_steps: dict[str, torch.Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999)
) -> dict[str, torch.Tensor]:
    """Per element, how far two AdamW runs that differ only in rounding may end apart: both
    runs' largest step, 2 x lr x adam_step_bound(betas), for each step at which the element's
    gradient was rounding-sized (noise_steps, from reference_train); 0 elsewhere."""
    per_step = 2 * lr * adam_step_bound(betas)
    return {name: per_step * n.double() for name, n in noise_steps.items()}


@dataclass
class Reference:
    """What a one-process reference returns to reference_verdict (a plain tuple (losses, params)
    or (losses, params, grad_norms) is read the same way)."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    grad_norms: list[float] | None = None
    allowance: dict[str, torch.Tensor] | None = None  # adam_allowance; None: every element at atol


@dataclass(frozen=True)
class Verdict:
    """A parallel run against its one-process reference: the numbers, and the line notes quote.

    ok          every judged figure within its tolerance, and as many steps on both sides
    loss_rel    max relative difference of the per-step losses (judged against rtol)
    params_gap  max |difference| of the parameters after the last step (judged against atol),
                beyond each element's Adam allowance where the reference gave one
    noisy       elements whose gradient was rounding-sized (see adam_allowance) that differ by
                more than atol but within their allowance; noisy_gap the largest such
                difference, noisy_allowance the largest allowance among them
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
    noisy: int = 0
    noisy_gap: float = 0.0
    noisy_allowance: float = 0.0

    @classmethod
    def skip(cls, why: str) -> Verdict:
        """No comparison (a run too large, a precision the reference does not share, ...)."""
        nan = float("nan")
        return cls(ok=True, loss_rel=nan, params_gap=nan, rtol=nan, steps=0, skipped=why)

    @property
    def line(self) -> str:
        if self.skipped:
            return self.skipped
        # 1e-5, as notes print it
        short: Callable[[float], str] = lambda x: f"{x:.0e}".replace("e-0", "e-")  # noqa: E731
        norm_tol = self.rtol if self.norm_rtol is None else self.norm_rtol
        norms = (
            ""
            if self.norm_rel is None
            else f"grad norms max rel diff {self.norm_rel:.1e}, rtol {short(norm_tol)}; "
        )
        counts = f"; {self.counts}" if self.counts else ""
        noisy = (
            f" (and {self.noisy} element{'s' if self.noisy > 1 else ''} whose gradient was "
            f"rounding noise: up to {self.noisy_gap:.1e} apart, within AdamW's bound "
            f"{self.noisy_allowance:.1e})"
            if self.noisy
            else ""
        )
        return (
            f"losses match {self.what} {'yes' if self.ok else 'NO'} (max rel diff "
            f"{self.loss_rel:.1e}, rtol {short(self.rtol)}; {norms}params max |diff| "
            f"{self.params_gap:.1e}, atol {short(self.atol)}{noisy}; after {self.steps} "
            f"{self.optimizer} steps{counts})"
        )

    def __str__(self) -> str:
        return self.line


def _max_rel(a: Sequence[float], b: Sequence[float]) -> float:
    return max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=0.0)


def _count_gaps(steps: int, lengths: dict[str, int]) -> str:
    """'' when every series has `steps` values; else which do not (zip would hide it).
    A length of -1: a series not given, not judged."""
    short = [f"{name} {n}" for name, n in lengths.items() if n >= 0 and n != steps]
    return f"values per run, {steps} expected: {', '.join(short)}" if short else ""


SERIES = ("losses", "reference losses", "grad norms", "reference norms")


def reference_verdict(
    losses: Sequence[float],
    params: dict[str, torch.Tensor],
    reference: Callable[[], Reference | tuple[Any, ...]],
    *,
    steps: int,
    device: torch.device | str,
    what: str = "one process",
    rtol: float = LOSS_RTOL,
    atol: float = PARAMS_ATOL,
    optimizer: str = "AdamW",
    grad_norms: list[float] | None = None,
    norm_rtol: float | None = None,
) -> Verdict:
    """The check a training script ends with, the same Verdict on every rank.

    `reference()` runs on rank 0 only and returns a Reference, or (losses, {name: parameter})
    of the one-process run, or (losses, params, grad_norms) to compare the norms too; `losses`,
    `params` (name -> full tensor, on rank 0) and `grad_norms` are the parallel run's. Judged:
    the losses (and the norms, where both runs gave them) within `rtol`, the parameters after
    the last step within `atol` (the loss of step k sees only the updates before it: the last
    update shows in the parameters alone) plus each element's Adam allowance where the
    Reference gives one, and `steps` values on each side. `norm_rtol`: the norms' tolerance,
    where a script states another than `rtol` (and why). The numbers are broadcast (on
    `device`: NCCL needs CUDA tensors) so every rank prints and exits alike.
    """
    # loss_rel, params gap, norm_rel, the noisy elements' count, gap and allowance, then the
    # four series' lengths (-1: not judged)
    numbers = torch.zeros(6 + len(SERIES), dtype=torch.float64, device=device)
    if dist.get_rank() == 0:
        ref = reference()
        ref = ref if isinstance(ref, Reference) else Reference(*ref)
        judged = bool(grad_norms) and ref.grad_norms is not None
        series = (losses, ref.losses, *((grad_norms, ref.grad_norms) if judged else (None, None)))
        loss_rel = _max_rel(losses, ref.losses)
        gaps = _params_gaps({k: v.cpu() for k, v in params.items()}, ref, atol)
        norm_rel = (  # `judged`, spelled out for mypy: both lists are there
            _max_rel(grad_norms, ref.grad_norms)
            if grad_norms and ref.grad_norms is not None
            else -1.0
        )
        row = [loss_rel, *gaps, norm_rel, *(len(v) if v is not None else -1 for v in series)]
        numbers = torch.tensor(row, dtype=torch.float64, device=device)
    dist.broadcast(numbers, src=0)  # (10,) float64 from rank 0 -> every rank
    loss_rel, gap, noisy, noisy_gap, noisy_allowance, norm_rel, *lengths = numbers.tolist()
    counts = _count_gaps(steps, {k: int(n) for k, n in zip(SERIES, lengths)})
    norm_tol = rtol if norm_rtol is None else norm_rtol
    ok = loss_rel <= rtol and gap <= atol and norm_rel <= norm_tol and not counts
    return Verdict(
        ok=ok,
        loss_rel=loss_rel,
        params_gap=gap,
        rtol=rtol,
        steps=steps,
        what=what,
        optimizer=optimizer,
        norm_rel=None if norm_rel < 0 else norm_rel,
        atol=atol,
        norm_rtol=norm_rtol,
        counts=counts,
        noisy=int(noisy),
        noisy_gap=noisy_gap,
        noisy_allowance=noisy_allowance,
    )


def _params_gaps(
    params: dict[str, torch.Tensor], ref: Reference, atol: float
) -> tuple[float, float, float, float]:
    """(the largest |difference| beyond each element's allowance, then, for the elements with an
    allowance that differ by more than atol: their count, largest difference, largest
    allowance). Without an allowance this is params_gap and three zeros."""
    if ref.allowance is None:
        return params_gap(params, ref.params), 0.0, 0.0, 0.0
    if params.keys() != ref.params.keys():
        raise ValueError(f"parameter names differ: {sorted(params.keys() ^ ref.params.keys())[:5]}")
    beyond, noisy, noisy_gap, noisy_allowance = 0.0, 0, 0.0, 0.0
    for name, p in params.items():
        diff = (p.detach().double() - ref.params[name].detach().double()).abs()
        allowed = ref.allowance[name].to(diff.dtype)
        beyond = max(beyond, (diff - allowed).max().item())
        used = (allowed > 0) & (diff > atol)
        if used.any():
            noisy += int(used.sum())
            noisy_gap = max(noisy_gap, diff[used].max().item())
            noisy_allowance = max(noisy_allowance, allowed[used].max().item())
    return max(beyond, 0.0), float(noisy), noisy_gap, noisy_allowance


def dense_verdict(
    losses: Sequence[float],
    params: dict[str, torch.Tensor],
    model_cfg: GPTConfig,
    tokens: np.ndarray | torch.Tensor,
    *,
    seq_len: int,
    rows: int,
    steps: int,
    device: torch.device | str,
    check: bool = True,
    **gpt_kwargs: Any,
) -> Verdict:
    """A model-parallel run (TP, SP, CP) against the dense model: rank 0 trains
    one_process_gpt(model_cfg, tokens, ...) (AdamW at its default betas) on the global batch and
    compares its losses and parameters (named_parameters(), a tied weight once) with the run's,
    each element within atol plus its Adam allowance (adam_allowance: the elements whose
    gradient was rounding-sized at some step); every rank gets the Verdict. check=False:
    skipped, said so."""
    if not check:
        return Verdict.skip("dense check skipped (check=false)")

    def dense_run() -> Reference:  # rank 0 only: the dense model on the global batch
        kw = dict(seq_len=seq_len, rows=rows, steps=steps, **gpt_kwargs)
        noise_steps: dict[str, torch.Tensor] = {}
        ref_losses, dense = one_process_gpt(model_cfg, tokens, noise_steps=noise_steps, **kw)
        lr, betas = gpt_kwargs.get("lr", 1e-3), gpt_kwargs.get("betas", (0.9, 0.999))
        allowance = adam_allowance(noise_steps, lr, betas)
        return Reference(ref_losses, dict(dense.named_parameters()), allowance=allowance)

    return reference_verdict(
        losses, params, dense_run, steps=steps, device=device, what="the dense model"
    )


def replica_gap(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> float:
    """max |p - p on the group's first rank| over all parameters and ranks: 0.0 when identical.

    Every rank of `group` must call it (a broadcast and an all_reduce).
    """
    flat = flat_params(model)
    ref = flat.clone()
    # the world: a ProcessGroup once the default group exists
    first = dist.get_global_rank(group or cast(dist.ProcessGroup, dist.group.WORLD), 0)
    dist.broadcast(ref, src=first, group=group)
    gap = (flat - ref).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=group)
    return gap.item()
