"""Day 19: Megatron's tensor-parallel layers by hand, and apply_tp for the shared GPT.

Y = X A, with A (in x out) split over t ranks (torch stores A transposed: weight is out x in):

    column parallel   A = [A_1 | ... | A_t]   rank r computes Y_r = X A_r: its out/t columns of Y.
                      No communication in forward; X's gradient is the sum over ranks (f).
    row parallel      A = [A_1; ...; A_t]     rank r holds in/t rows and the matching slice X_r
                      of the input; Y = sum_r X_r A_r: one all-reduce in forward (g).

Column then row needs no communication between them: the column layer's output slice is exactly
the row layer's input slice. So the MLP (c_fc column, gelu, c_proj row) and attention (c_attn
column by heads, attention per head, c_proj row) each cost one all-reduce forward (g, after
c_proj) and one backward (f, before c_fc / c_attn), of B·T·C elements.

The vocabulary is split too: the embedding by rows (a token's row lives on one rank; the others
contribute zeros; an all-reduce sums them), the output layer by columns (each rank computes the
logits of its V/t words), and the loss is computed from the logit shards with three all-reduces
of B·T numbers (max, sum of exp, target logit): the (B, T, V) logits never exist on one rank.

    model = apply_tp(GPT(cfg, seed), grid)     # dense weights in, this rank's shards kept
    loss = tp_loss(model, model(x), y)         # vocab-parallel cross-entropy
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from day19_tp.tp_comms import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from dtl.amax_groups import AmaxGroups
from dtl.exercise_seam import exercise
from dtl.grid import ParallelGrid
from dtl.model import GPT, GPTConfig, pad_vocab_size
from dtl.precision import at_least_fp32
from dtl.tp_plan import shard_tensor, tp_shard_of


class TPError(ValueError):
    """A model that does not split over the TP size; one line, before any collective."""


def check_tp(cfg: GPTConfig, tp: int, pad_vocab: bool = False) -> None:
    """Every size tensor parallelism cuts must divide by tp."""
    if not isinstance(tp, int) or tp < 1:
        raise TPError(f"tp must be a positive integer, got {tp!r}")
    for what, n in (("n_head", cfg.n_head), ("n_embd", cfg.n_embd), ("MLP width", 4 * cfg.n_embd)):
        if n % tp:
            raise TPError(f"{what} {n} is not divisible by tp {tp}")
    if cfg.vocab_size % tp and not pad_vocab:
        raise TPError(
            f"vocab_size {cfg.vocab_size} is not divisible by tp {tp}; pad it to "
            f"{pad_vocab_size(cfg.vocab_size, 1, tp)} (pad_vocab=true)"
        )


def _tp(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


class ColumnParallelLinear(nn.Module):
    """Output features split: this rank holds weight rows [r·out/t, (r+1)·out/t) and that bias.

    (…, in) replicated -> f -> (…, out/t) this rank's columns, or (…, out) if gather_output.
    `out_features` is the local width (what the code after it sees), as in nn.Linear.
    `device`, `dtype`: where and how the shard is allocated (nn.Linear's factory arguments).
    """

    def __init__(
        self,
        in_features,
        out_features,
        group,
        bias=True,
        gather_output=False,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        like = dict(device=device, dtype=dtype)
        t, _ = _tp(group)
        if out_features % t:
            raise TPError(f"output features {out_features} do not split over tp {t}")
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = in_features, out_features // t
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features, **like))
        self.bias = nn.Parameter(torch.zeros(out_features // t, **like)) if bias else None
        self.linear = F.linear  # the matmul: F.linear, or a conversion's (dtl.float8)
        # the input is whole on every rank; the weight's rows and dL/d(output)'s columns are split
        self.amax_groups = AmaxGroups(input=None, weight=group, grad=group)

    @exercise("day19.column_row_forward")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # exercise day19.column_row_forward: begin
        x = copy_to_tp(x, self.group)  # f: identity here, all-reduce of dL/dx in backward
        y = self.linear(x, self.weight, self.bias)  # (…, in) @ (in, out/t) -> (…, out/t)
        return gather_from_tp(y, self.group) if self.gather_output else y
        # exercise day19.column_row_forward: end


class RowParallelLinear(nn.Module):
    """Input features split: this rank holds weight columns [r·in/t, (r+1)·in/t); the bias is
    whole and added once, after the sum.

    (…, in/t) this rank's slice (or (…, in), scattered first) -> (…, out) partial -> g -> (…, out)
    """

    def __init__(
        self,
        in_features,
        out_features,
        group,
        bias=True,
        input_is_parallel=True,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        like = dict(device=device, dtype=dtype)
        t, _ = _tp(group)
        if in_features % t:
            raise TPError(f"input features {in_features} do not split over tp {t}")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = in_features // t, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t, **like))
        self.bias = nn.Parameter(torch.zeros(out_features, **like)) if bias else None
        self.linear = F.linear  # the matmul: F.linear, or a conversion's (dtl.float8)
        # the input's and the weight's columns are split; dL/d(output) is whole after g
        self.amax_groups = AmaxGroups(input=group, weight=group, grad=None)

    @exercise("day19.column_row_forward")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # exercise day19.column_row_forward: begin
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)  # (…, in) -> (…, in/t)
        y = self.linear(x, self.weight)  # (…, in/t) @ (in/t, out) -> (…, out): X_r A_r, partial
        y = reduce_from_tp(y, self.group)  # g: sum over ranks -> X A on every rank
        return y + self.bias if self.bias is not None else y
        # exercise day19.column_row_forward: end


class VocabParallelEmbedding(nn.Module):
    """Rows [r·V/t, (r+1)·V/t) of the embedding on rank r.

    (B, T) ids -> (B, T, C): rows this rank holds, zeros elsewhere -> g (all-reduce) -> each
    token's row, which exactly one rank contributed.
    """

    def __init__(self, num_embeddings, embedding_dim, group, *, device=None, dtype=None):
        super().__init__()
        t, r = _tp(group)
        if num_embeddings % t:
            raise TPError(f"vocabulary {num_embeddings} does not split over tp {t}")
        self.group = group
        self.per_rank = num_embeddings // t
        self.lo, self.hi = r * self.per_rank, (r + 1) * self.per_rank
        self.weight = nn.Parameter(
            torch.empty(self.per_rank, embedding_dim, device=device, dtype=dtype)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        local = (ids - self.lo).masked_fill(outside, 0)  # any valid row; masked just below
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(rows, self.group)  # (B, T, C): the one non-zero row per token


class VocabParallelHead(nn.Module):
    """The output layer, column parallel over the vocabulary: (B, T, C) -> (B, T, V/t) logits of
    this rank's words. With tied weights its weight *is* the VocabParallelEmbedding's."""

    def __init__(self, weight: nn.Parameter, group):
        super().__init__()
        self.group, self.weight = group, weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight)  # f, then (…, C) -> (…, V/t)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logit shards: three all-reduces of (N,) numbers, never the
    (N, V) logits. Columns at or beyond `vocab_size` (padding) are masked out of the softmax."""

    @staticmethod
    @exercise("day19.vocab_parallel_ce")
    def forward(ctx, logits, target, group, lo, vocab_size, ignore_index):
        # (N, V/t); the columns [lo, lo + V/t) of the vocabulary, in fp32 or wider (fp64 stays)
        z = logits.to(at_least_fp32(logits.dtype)).clone()
        n_local = z.size(-1)
        padded = torch.arange(lo, lo + n_local, device=z.device) >= vocab_size
        z[:, padded] = float("-inf")
        # which tokens' targets are among my columns, and where: (N,) each
        ignored = target == ignore_index
        local_target = target - lo
        mine = (local_target >= 0) & (local_target < n_local) & ~ignored
        idx = local_target.clamp(0, n_local - 1)  # a valid column everywhere; use it where mine
        # loss = log(sum over V of exp(z - max)) - (z_target - max), from three (N,) numbers,
        # each all-reduced over the TP group: the max (MAX), the target's logit (SUM: one rank
        # holds it, the others give 0) and the sum of exp over my columns (SUM). Leaves z
        # shifted by the max, target_logit (N,), exp (N, V/t) and sum_exp (N,).
        # exercise day19.vocab_parallel_ce: begin
        # 1. the max over the whole vocabulary, for a stable exp: (N,) -> all-reduce MAX
        zmax = z.max(dim=-1).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        z -= zmax.unsqueeze(-1)
        # 2. the target's logit: held by one rank, 0 from the others -> all-reduce SUM, (N,)
        # where(), not * mine: a clamped index may land on a padded column (-inf), and -inf * 0
        target_logit = torch.where(mine, z.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(target_logit, group=group)
        # 3. the softmax denominator: sum of exp over my columns -> all-reduce SUM, (N,)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        # exercise day19.vocab_parallel_ce: end
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), idx, mine, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, ignored = ctx.saved_tensors
        # dL/dz = softmax - one_hot(target): the -1 only in the rank that holds the target
        grad = softmax.scatter_add(-1, idx.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        grad *= grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, group, vocab_size=None, ignore_index=-100):
    """Mean cross-entropy over the tokens whose target is not `ignore_index`, from this rank's
    (…, V/t) logit shard; equals F.cross_entropy on the gathered (…, V) logits."""
    t, r = _tp(group)
    n_local = logits.size(-1)
    vocab_size = vocab_size if vocab_size is not None else n_local * t
    per_token = _VocabParallelCrossEntropy.apply(
        logits.flatten(0, -2), target.flatten(), group, r * n_local, vocab_size, ignore_index
    )
    counted = (target.flatten() != ignore_index).sum()
    return per_token.sum() / counted


@dataclass
class TPInfo:
    """What apply_tp leaves on the model: its TP group and the true (unpadded) vocabulary."""

    group: object
    size: int
    rank: int
    vocab_size: int
    padded_vocab_size: int


def tp_loss(model: GPT, logits: torch.Tensor, targets: torch.Tensor, ignore_index=-100):
    info: TPInfo = model.tp
    return vocab_parallel_cross_entropy(logits, targets, info.group, info.vocab_size, ignore_index)


@torch.no_grad()
def apply_tp(model: GPT, grid: ParallelGrid, *, pad_vocab: bool = False) -> GPT:
    """Turn the dense GPT into its tensor-parallel version over grid.tp_group, in place.

    Expects the one-process model (the same weights on every rank, e.g. GPT(cfg, seed)); each
    module named in dtl.tp_plan.TP_PLAN is replaced by its parallel version holding this rank's
    shard of the dense weight (`shard_tensor`), so the TP model starts equal to the dense one.
    Leaves LayerNorms and wpe replicated, `model.tp` (TPInfo), and a forward that returns this
    rank's (B, T, V/t) logits: use `tp_loss`. With pad_vocab, a vocabulary that does not divide
    by tp gets zero rows that the loss masks out, so training still equals the dense model.
    """
    group, t, r = grid.tp_group, grid.tp_size, grid.tp_rank
    cfg = model.cfg
    check_tp(cfg, t, pad_vocab)
    padded = pad_vocab_size(cfg.vocab_size, 1, t)
    for name, module in list(model.named_modules()):
        shard = tp_shard_of(name)
        if shard is None or name in ("wte", "lm_head"):
            continue
        # the shard where the dense weight is (the run's device if the model was moved first)
        like = dict(device=module.weight.device, dtype=module.weight.dtype)
        layer = ColumnParallelLinear if shard.style == "column" else RowParallelLinear
        new = layer(
            module.in_features, module.out_features, group, bias=module.bias is not None, **like
        )
        new.weight.copy_(shard_tensor(module.weight, shard, False, r, t))
        if module.bias is not None:
            new.bias.copy_(shard_tensor(module.bias, shard, True, r, t))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    _apply_vocab_parallel(model, group, r, t, padded)
    model.tp = TPInfo(group, t, r, cfg.vocab_size, padded)
    return model


def _apply_vocab_parallel(model: GPT, group, r: int, t: int, padded: int) -> None:
    cfg = model.cfg
    like = dict(device=model.wte.weight.device, dtype=model.wte.weight.dtype)
    full = torch.zeros(padded, cfg.n_embd, **like)  # padding rows are zeros and stay zeros
    full[: cfg.vocab_size] = model.wte.weight
    wte = VocabParallelEmbedding(padded, cfg.n_embd, group, **like)
    wte.weight.copy_(full[wte.lo : wte.hi])
    if cfg.tie_weights:
        head_weight = wte.weight  # one Parameter: the tie survives, rank by rank
    else:
        head_full = torch.zeros(padded, cfg.n_embd, **like)
        head_full[: cfg.vocab_size] = model.lm_head.weight
        head_weight = nn.Parameter(head_full[wte.lo : wte.hi].clone())
    model.wte = wte
    model.lm_head = VocabParallelHead(head_weight, group)


# --- re-assembling the full tensors: for checks, checkpoints and the notes' tables ---------------


def _unshard(pieces: list[torch.Tensor], style: str, blocks: int, is_bias: bool) -> torch.Tensor:
    """The inverse of dtl.tp_plan.shard_tensor: t rank pieces -> the full tensor."""
    if style == "row":
        return pieces[0] if is_bias else torch.cat(pieces, dim=1)
    per_block = [p.chunk(blocks, dim=0) for p in pieces]  # [rank][block]
    return torch.cat([torch.cat([pr[b] for pr in per_block]) for b in range(blocks)])


def full_tensors(model: GPT, grads: bool = False) -> dict[str, torch.Tensor]:
    """name -> the full (dense-shaped) parameter or gradient, gathered over the TP group:
    collective, every TP rank calls it. Names are the dense model's; a padded vocabulary is
    cut back to the real one. A parameter FSDP2 shards over dp (a DTensor) is gathered over dp
    first (collective over dp too)."""
    info: TPInfo = model.tp
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        t = t.detach()
        if isinstance(t, DTensor):  # FSDP2 over dp on top of TP: this TP rank's shard, gathered
            t = t.full_tensor()
        module_name, _, kind = name.rpartition(".")
        shard = tp_shard_of(module_name)
        if shard is None:
            out[name] = t.clone()
            continue
        pieces = [torch.empty_like(t) for _ in range(info.size)]
        dist.all_gather(pieces, t.contiguous(), group=info.group)
        full = _unshard(pieces, shard.style, shard.blocks, kind == "bias")
        out[name] = full[: info.vocab_size] if shard.style == "vocab" else full
    return out
