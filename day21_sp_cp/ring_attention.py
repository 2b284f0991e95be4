"""Day 21: ring attention, forward and backward written out (Liu et al. 2023, arXiv 2310.01889).

Context parallelism splits the sequence over cp ranks for the whole layer. Everything in a
transformer layer is per token except attention: the queries of my T/cp tokens need the keys and
values of every token before them. Ring attention never gathers them. Each rank keeps its Q and
passes its K/V block to the next rank, cp times around the ring; every step it attends to the
block it holds and folds the partial result into a running one:

    step 0        step 1        step 2        step 3            (cp = 4, rank 2)
    Q2 . K2V2     Q2 . K1V1     Q2 . K0V0     Q2 . K3V3         K/V arrive from rank 1 while
                                                                the step before computes

Folding partial results: a block of keys gives out_b = softmax(S_b) V_b and lse_b =
log sum_j exp(S_bj). Two blocks merge exactly (the online softmax of flash attention):

    lse = log(exp(lse_a) + exp(lse_b))                        (logaddexp: no overflow)
    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

Backward needs no stored scores: with lse of the whole row, P = exp(S - lse) is recomputed per
block, and with D = rowsum(dO * O):

    dV_b += P^T dO     dP = dO V_b^T     dS = P * (dP - D)     dQ += dS K_b s     dK_b += dS^T Q s

(s = 1/sqrt(head dim)). dQ stays home; dK_b and dV_b are sums over every rank's queries, so they
travel the ring with K_b/V_b and arrive back at their owner after the last step.

Causal masks and chunks. The sequence is cut into chunks (dtl.data.cp_chunks): contiguous, one
chunk per rank, or zig-zag, chunks r and 2cp-1-r on rank r. A query chunk i and a key chunk j are
a full block (i > j), a diagonal block (i == j, causal mask inside) or nothing at all (i < j, all
masked: skipped). With contiguous chunks rank r computes r + 1 blocks and the last rank does cp
times the first rank's work; zig-zag gives every rank the same work (`attention_work`).

    attn = RingAttention(grid.cp_group, split="zigzag")
    gpt.set_attention(attn)          # (B, nh, T/cp, hs) q, k, v of my tokens -> my outputs
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from dtl import profile as dtl_profile
from dtl.data import cp_chunks
from dtl.exercise_seam import exercise
from dtl.precision import at_least_fp32

KV_TAG, DKV_TAG = 21, 22  # gloo matches p2p messages by tag; NCCL ignores tags (the order holds)


# --- which blocks a rank computes -------------------------------------------------------------


def block_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """'full', 'diagonal' (causal mask inside) or 'skip' for query chunk i against key chunk j."""
    if not causal or q_chunk > k_chunk:
        return "full"
    return "diagonal" if q_chunk == k_chunk else "skip"


def ring_pairs(rank: int, cp: int, split: str, causal: bool):
    """Per ring step: (source rank of the K/V block, [(local q part, local k part, kind)])."""
    mine = cp_chunks(rank, cp, split)
    steps = []
    for step in range(cp):
        src = (rank - step) % cp
        theirs = cp_chunks(src, cp, split)
        pairs = [
            (a, b, block_kind(i, j, causal))
            for a, i in enumerate(mine)
            for b, j in enumerate(theirs)
            if block_kind(i, j, causal) != "skip"
        ]
        steps.append((src, pairs))
    return steps


def attention_work(cp: int, split: str, causal: bool = True) -> list[dict]:
    """Per rank: sub-blocks computed (a chunk x chunk product each, whole: what this code runs)
    and query-key pairs a causal mask keeps (what a kernel that skips masked tiles runs), in
    units of (T / n_chunks)^2, n_chunks = cp (contiguous) or 2cp (zig-zag)."""
    out = []
    for rank in range(cp):
        kinds = [kind for _, pairs in ring_pairs(rank, cp, split, causal) for *_, kind in pairs]
        out.append(
            dict(
                blocks=len(kinds),
                needed=sum(1.0 if k == "full" else 0.5 for k in kinds),
            )
        )
    return out


def imbalance(values) -> float:
    """Slowest rank over the average: the step waits for the slowest."""
    values = list(values)
    return max(values) / (sum(values) / len(values))


# --- the two operations on one block ---------------------------------------------------------


def _scores(q, k, scale, diagonal: bool):
    s = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    if diagonal:  # the same chunk on both sides: keep j <= i
        n = s.size(-1)
        keep = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _block_forward(q, k, v, scale, diagonal):
    """One block's softmax(q k^T s) v and its row log-sum-exp: (B, nh, Tq, hs), (B, nh, Tq)."""
    s = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


@exercise("day21.merge")
def _merge(out, lse, out_b, lse_b):
    """Fold a block's (out_b, lse_b) into the running (out, lse); None means nothing yet.

    out, out_b: (B, nh, Tq, hs), each softmax(S) V over its own keys only; lse, lse_b: (B, nh,
    Tq), the log-sum-exp of those keys' scores per query row. Returns the same pair over the
    union of both sets of keys, exactly: each output weighted by the share of the whole row's
    exp-sum its keys hold (the module docstring's two lines), with no exp of an lse on its own
    (scores in the hundreds overflow it)."""
    if out is None:
        return out_b, lse_b
    # exercise day21.merge: begin
    new = torch.logaddexp(lse, lse_b)
    out = out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1)
    return out, new
    # exercise day21.merge: end


# --- the ring ---------------------------------------------------------------------------------


def _ring_send_recv(tensor: torch.Tensor, group, tag: int):
    """Post: send `tensor` to the next rank, receive the previous rank's into a new buffer.
    Returns (buffer, requests): wait on the requests before reading the buffer."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    buf = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (r + 1) % cp), group, tag),
        dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, (r - 1) % cp), group, tag),
    ]
    with dtl_profile.range(dtl_profile.comm_name("send/recv", "ring")):  # a named range
        return buf, dist.batch_isend_irecv(ops)


@dataclass
class RingStats:
    """Where one rank's ring attention time went (accumulated over calls)."""

    compute_s: float = 0.0  # wall seconds in block math
    compute_cpu_s: float = 0.0  # this thread's CPU seconds in block math (fair on a busy CPU)
    wait_s: float = 0.0  # wall seconds blocked on a K/V or dK/dV transfer
    blocks: int = 0  # the (q chunk, k chunk) products the forward ran
    flops: int = 0  # what those products cost, counted by torch's FlopCounterMode as they ran
    count_flops: bool = False  # count them (the counter's dispatch would skew compute_s)
    calls: list = field(default_factory=list)

    def add(self, key: str, seconds: float) -> None:
        setattr(self, key, getattr(self, key) + seconds)


class _Clock:
    """Times a region into a RingStats (or does nothing without one). On a GPU the host runs
    ahead of the kernels, so a timed region (stats given) synchronizes at both ends: the time is
    the device's work (or wait), not its launch. Without stats nothing is synchronized."""

    def __init__(self, stats: RingStats | None, key: str, device: torch.device):
        self.stats, self.key = stats, key
        self.sync = stats is not None and device.type == "cuda"
        self.device = device

    def __enter__(self):
        # a named range in torch.profiler traces ("ring.compute_s", "ring.wait_s"): bench.py
        # reads them back to see which transfers were hidden behind compute (and NVTX on a GPU)
        self.range = dtl_profile.range(f"ring.{self.key}")
        self.range.__enter__()
        if self.sync:
            torch.cuda.current_stream(self.device).synchronize()
        self.t0, self.c0 = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc):
        if self.sync:  # NCCL's wait() only orders the stream: this is where the data is there
            torch.cuda.current_stream(self.device).synchronize()
        self.range.__exit__(*exc)
        if self.stats is not None:
            self.stats.add(self.key, time.perf_counter() - self.t0)
            if self.key == "compute_s":
                self.stats.add("compute_cpu_s", time.thread_time() - self.c0)


class _Flops:
    """Counts the block products a forward step runs and their matmul FLOPs (FlopCounterMode,
    from the ops as they execute) into a RingStats; nothing without one."""

    def __init__(self, stats: RingStats | None):
        self.stats, self.blocks = stats, 0
        counting = stats is not None and stats.count_flops
        self.mode = FlopCounterMode(display=False) if counting else None

    def __enter__(self):
        if self.mode is not None:
            self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)
            self.stats.flops += self.mode.get_total_flops()
        if self.stats is not None:
            self.stats.blocks += self.blocks


def _wait(requests, stats, device):
    with _Clock(stats, "wait_s", device):
        for req in requests:
            req.wait()


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    @exercise("day21.ring_forward")
    def forward(ctx, q, k, v, group, split, causal, stats):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        steps = ring_pairs(rank, cp, split, causal)
        n = len(cp_chunks(rank, cp, split))  # chunks per rank: 1 or 2
        scale = 1.0 / math.sqrt(q.size(-1))
        acc = at_least_fp32(q.dtype)  # merge and accumulate in fp32 or wider (fp64 stays)
        qs = q.to(acc).chunk(n, dim=2)
        outs, lses = [None] * n, [None] * n
        kv = torch.stack([k, v])  # (2, B, nh, T/cp, hs): K and V travel as one message
        # Each step, in this order: (1) unless it is the last, post the transfer: kv to the next
        # rank, the previous rank's into a new buffer (_ring_send_recv, KV_TAG); (2) under
        # _Clock(stats, "compute_s", q.device) and _Flops(stats), fold each of the step's pairs
        # (query part a, key part b, kind) into outs[a], lses[a]: kv cast to acc and cut in n
        # parts along the sequence, _block_forward (its mask on a "diagonal" pair) and _merge,
        # one counted.blocks per product run; (3) _wait for the transfer, and take its buffer.
        for step, (_, pairs) in enumerate(steps):
            # exercise day21.ring_forward: begin
            if step < cp - 1:  # the next block is on its way while this one computes
                next_kv, requests = _ring_send_recv(kv, group, KV_TAG)
            with _Clock(stats, "compute_s", q.device), _Flops(stats) as counted:
                ks, vs = kv[0].to(acc).chunk(n, dim=2), kv[1].to(acc).chunk(n, dim=2)
                for a, b, kind in pairs:
                    o, lse = _block_forward(qs[a], ks[b], vs[b], scale, kind == "diagonal")
                    outs[a], lses[a] = _merge(outs[a], lses[a], o, lse)
                    counted.blocks += 1  # a product that ran, here, not one ring_pairs listed
            if step < cp - 1:
                _wait(requests, stats, q.device)
                kv = next_kv
            # exercise day21.ring_forward: end
        out, lse = (
            torch.cat(outs, dim=2),
            torch.cat(lses, dim=2),
        )  # (B, nh, T/cp, hs), (B, nh, T/cp)
        # returned in (B, T/cp, nh, hs) memory order, as the fused kernel does: the attention
        # module's transpose(1, 2).contiguous() is then free, and c_proj saves this very tensor
        B, nh, t, hs = out.shape
        result = torch.empty(B, t, nh, hs, dtype=q.dtype, device=q.device).transpose(1, 2)
        result.copy_(out)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.split, ctx.causal, ctx.stats = group, split, causal, stats
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, stats = ctx.group, ctx.stats
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        steps = ring_pairs(rank, cp, ctx.split, ctx.causal)
        n = len(cp_chunks(rank, cp, ctx.split))
        scale = 1.0 / math.sqrt(q.size(-1))
        acc = at_least_fp32(q.dtype)  # merge and accumulate in fp32 or wider (fp64 stays)
        qs = q.to(acc).chunk(n, dim=2)
        dos = grad_out.to(acc).chunk(n, dim=2)
        # D_i = sum_d dO_id O_id: the softmax backward's row term, once per query
        ds_row = (grad_out.to(acc) * out.to(acc)).sum(-1).chunk(n, dim=2)
        lses = lse.chunk(n, dim=2)
        dq = [torch.zeros_like(x) for x in qs]
        kv = torch.stack([k, v])
        dkv, dkv_requests = None, []
        for step, (_, pairs) in enumerate(steps):
            if step < cp - 1:
                next_kv, kv_requests = _ring_send_recv(kv, group, KV_TAG)
            with _Clock(stats, "compute_s", q.device):
                ks, vs = kv[0].to(acc).chunk(n, dim=2), kv[1].to(acc).chunk(n, dim=2)
                step_dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
                dks, dvs = step_dkv[0].chunk(n, dim=2), step_dkv[1].chunk(n, dim=2)
                for a, b, kind in pairs:
                    s = _scores(qs[a], ks[b], scale, kind == "diagonal")
                    p = torch.exp(s - lses[a].unsqueeze(-1))  # (B, nh, Tq, Tk), recomputed
                    dvs[b].add_(p.transpose(-2, -1) @ dos[a])
                    dp = dos[a] @ vs[b].transpose(-2, -1)
                    dsc = p * (dp - ds_row[a].unsqueeze(-1)) * scale
                    dq[a].add_(dsc @ ks[b])
                    dks[b].add_(dsc.transpose(-2, -1) @ qs[a])
            if step > 0:  # the running dK/dV of this block arrived during the compute above
                _wait(dkv_requests, stats, q.device)
                step_dkv += dkv
            # pass this block's dK/dV on with it; after the last step it reaches its owner
            if cp > 1:
                dkv, dkv_requests = _ring_send_recv(step_dkv, group, DKV_TAG)
            else:  # a ring of one: the block is mine, nothing travels
                dkv, dkv_requests = step_dkv, []
            if step < cp - 1:
                _wait(kv_requests, stats, q.device)
                kv = next_kv
        _wait(dkv_requests, stats, q.device)  # dkv now holds my own K/V block's full gradient
        cast = q.dtype
        return (
            torch.cat(dq, dim=2).to(cast),
            dkv[0].to(cast),
            dkv[1].to(cast),
            None,
            None,
            None,
            None,
        )


class RingAttention:
    """An attention function for GPT.set_attention: ring attention over `group`."""

    def __init__(self, group, split: str = "contiguous", causal: bool = True, stats=None):
        self.group, self.split, self.causal, self.stats = group, split, causal, stats

    def __call__(self, q, k, v):
        return RingAttentionFunction.apply(q, k, v, self.group, self.split, self.causal, self.stats)


def ring_attention(q, k, v, group, split="contiguous", causal=True, stats=None):
    """(B, nh, T/cp, hs) q, k, v of this rank's tokens (in `split` order) -> its outputs."""
    return RingAttentionFunction.apply(q, k, v, group, split, causal, stats)
