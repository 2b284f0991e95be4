"""Day 21: ring attention and Ulysses vs full attention, the CP GPT and the TP + SP GPT vs the dense
model, communication and activation memory vs the formulas, and DeepSpeed's Ulysses and
megatron-core's sequence-parallel layers on the same weights.

Each part runs its own processes, once per world size (2 and 4 ranks), from inside the first
test that asks for it (`_on_ranks`): the ring, Ulysses, the SP layouts, the CP GPT and the 2-D
grids (one part with the ring, one with Ulysses), activation memory, each library. A part whose
code raises fails the tests that read it and no other: a stubbed ring leaves Ulysses and SP green.

Reference: full attention (F.scaled_dot_product_attention) and the dense GPT in one process,
same seeds and data. Tolerances: attention in fp64 rtol 1e-10, atol 1e-12 (measured ~1e-15: the
online softmax is exact, only the summation order differs); in fp32 rtol 1e-5, atol 1e-6. The
GPT: losses rtol 1e-5, gradients atol 1e-6, parameters atol 1e-6 under SGD, which shows a
gradient off by any factor (a cp-mean taken as a sum), and 1e-4 under AdamW (lr 1e-2, eps 1e-6:
day 19's bound lr·delta/(4 eps) for a rounding difference delta ~ 1e-8).
"""

import dataclasses
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from day19_tp.activations import saved_activation_bytes
from day19_tp.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPInfo,
    apply_tp,
    full_tensors,
    tp_loss,
)
from day21_sp_cp import formulas
from day21_sp_cp.cp import CPError, apply_cp, check_cp, cp_batch
from day21_sp_cp.ring_attention import (
    RingStats,
    _block_forward,
    _merge,
    attention_work,
    imbalance,
    ring_attention,
)
from day21_sp_cp.sp import (
    SPColumnParallelLinear,
    SPError,
    SPRowParallelLinear,
    apply_sp,
    replicated_parameters,
)
from day21_sp_cp.ulysses import UlyssesAttention, heads_to_seq, seq_to_heads
from dtl.comm import CommCounter
from dtl.data import cp_shard, cp_unshard
from dtl.grid import ParallelGrid
from dtl.model import GPT, GPTConfig, loss_fn
from dtl.reference import reference_train
from dtl.testing import needs_extras, run_distributed, script_error

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=256)
B, T, K = 2, 16, 3
ATT = dict(B=2, nh=4, T=16, hs=8)  # the attention checks' q, k, v: (B, nh, T, hs)
ACT = dict(b=2, h=64, a=4, seqs=(32, 64, 128))  # the blocks whose saved activations are measured
CASES = [  # (attention, split, causal)
    ("ring", "contiguous", True),
    ("ring", "contiguous", False),
    ("ring", "zigzag", True),
    ("ring", "zigzag", False),
    ("ulysses", "contiguous", True),
    ("ulysses", "contiguous", False),
]
FP = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}
TOL = dict(rtol=1e-5, atol=1e-6)


def _rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _qkv_do(dtype):
    shape = (ATT["B"], ATT["nh"], ATT["T"], ATT["hs"])
    return [_rand(*shape, seed=s, dtype=dtype) for s in (1, 2, 3, 4)]


# --- the parts, each run on its own ranks -------------------------------------------------------

WORLDS = pytest.mark.parametrize("n", [2, 4], ids=["world2", "world4"])


@functools.cache
def _on_ranks(part, n: int) -> list:
    """`part(n)`'s per-rank results on n ranks, run by the first test that asks and kept for the
    others. Not a fixture: a rank that raises fails each test that asks (and runs it again), where
    a fixture's error would only mark them errors."""
    return run_distributed(part, n, world_size=n, timeout_s=300)


def _attention_cases(attn, grid):
    """Every case of `attn`, both dtypes: this rank's output and dQ, dK, dV shards; the bytes it
    sent forward and backward; the blocks it computed."""
    g, cp, r = grid.cp_group, grid.cp_size, grid.cp_rank
    out = {}
    for name, split, causal in CASES:
        if name != attn:
            continue
        for dtype in FP:
            q, k, v, do = (cp_shard(t, r, cp, split, dim=2) for t in _qkv_do(dtype))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            stats = RingStats(count_flops=True)
            with CommCounter(group=g) as fwd:
                if attn == "ring":
                    o = ring_attention(q, k, v, g, split, causal, stats)
                else:
                    o = UlyssesAttention(g, causal)(q, k, v)
            with CommCounter(group=g) as bwd:
                o.backward(do)
            out[split, causal, dtype] = dict(
                grads=[t.detach() for t in (o, q.grad, k.grad, v.grad)],
                sent=[c.ring_bytes_per_rank() for c in (fwd, bwd)],
                blocks=stats.blocks,
                flops=stats.flops,
            )
    return out


RING_RANGES = ("send/recv ring", "ring.compute_s", "ring.wait_s")  # dtl.profile names


def _ring(n):
    """Ring attention at cp = n: every case, and the named ranges of one zig-zag forward in the
    order they opened (torch.profiler on this rank's CPU)."""
    grid = ParallelGrid(cp=n)
    out = dict(cases=_attention_cases("ring", grid))
    q, k, v, _ = (cp_shard(t, grid.cp_rank, n, "zigzag", dim=2) for t in _qkv_do(torch.float64))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ring_attention(q, k, v, grid.cp_group, "zigzag", True)
    opened = sorted((e.time_range.start, e.name) for e in prof.events() if e.name in RING_RANGES)
    out["schedule"] = [name for _, name in opened]
    return out


def _ulysses(n):
    """Ulysses at cp = n: every case, and one tensor through seq_to_heads and back."""
    grid = ParallelGrid(cp=n)
    out = dict(cases=_attention_cases("ulysses", grid))
    x = cp_shard(_qkv_do(torch.float64)[0], grid.cp_rank, n, "contiguous", dim=2)
    heads = seq_to_heads(x, grid.cp_group)
    out["layout"] = (heads, heads_to_seq(heads, grid.cp_group))
    return out


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def _global_batch(step, dp=1):
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(0, CFG.vocab_size, (B * dp, T + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def _train(grid, attn, opt_name, tp_sp=(False, False), save_gathered=False, recompute="none"):
    """K steps of the GPT with CP (and TP, SP) over `grid`, DDP over dp x cp: losses, the
    first step's gradients, the final parameters (all re-assembled), last step's bytes by kind."""
    use_tp, use_sp = tp_sp
    gpt = GPT(CFG, seed=0)
    if use_tp:
        apply_tp(gpt, grid)
    if use_sp:
        apply_sp(gpt, save_gathered)
    apply_cp(gpt, grid, attn)
    gpt.set_recompute(recompute)
    group = grid.group("dp", "cp")
    model = (
        nn.parallel.DistributedDataParallel(gpt, process_group=group) if group.size() > 1 else gpt
    )
    opt = _optimizer(opt_name, model.parameters())
    losses, grads = [], None
    for step in range(K):
        x, y = _global_batch(step, grid.dp_size)
        x, y = (
            x[grid.dp_rank * B : (grid.dp_rank + 1) * B],
            y[grid.dp_rank * B : (grid.dp_rank + 1) * B],
        )
        x, y, pos = cp_batch(gpt, x, y)
        with CommCounter() as comm:
            logits = model(x, pos)
            loss = tp_loss(gpt, logits, y) if use_tp else loss_fn(logits, y)
            loss.backward()
        if step == 0:
            grads = full_tensors(gpt, grads=True) if use_tp else _named(gpt, grads=True)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / group.size())
    params = full_tensors(gpt) if use_tp else _named(gpt)
    return dict(losses=losses, grads=grads, params=params, bytes=dict(comm.ring_bytes))


def _named(model, grads=False):
    return {n: (p.grad if grads else p).detach().clone() for n, p in model.named_parameters()}


def _sp_block(grid, save_gathered):
    """One block, TP-only and TP + SP, on the same input: outputs (gathered over the sequence),
    input and parameter gradients (re-assembled), bytes by kind forward and backward."""
    out = {}
    x = _rand(B, T, CFG.n_embd, seed=7)
    dy = _rand(B, T, CFG.n_embd, seed=8)
    t, r = grid.tp_size, grid.tp_rank
    for sp in (False, True):
        gpt = apply_tp(GPT(CFG, seed=0), grid)
        if sp:
            apply_sp(gpt, save_gathered)
        for p in gpt.parameters():  # full_tensors reads every gradient; only block 0's move
            p.grad = torch.zeros_like(p)
        xi = (x.chunk(t, dim=1)[r] if sp else x).clone().requires_grad_()
        with CommCounter(group=grid.tp_group) as fwd:
            y = gpt.blocks["0"](xi)
        with CommCounter(group=grid.tp_group) as bwd:
            y.backward(dy.chunk(t, dim=1)[r] if sp else dy)
        if sp:  # the output and dX are sequence shards: gather them to compare
            y, dx = (_gather_seq(a.detach(), grid.tp_group) for a in (y, xi.grad))
        else:
            y, dx = y.detach(), xi.grad
        grads = {k: v for k, v in full_tensors(gpt, grads=True).items() if k.startswith("blocks.0")}
        out[sp] = dict(y=y, dx=dx, grads=grads, fwd=dict(fwd.ring_bytes), bwd=dict(bwd.ring_bytes))
    return out


def _gather_seq(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _activations(n):
    """Saved bytes of one block per rank: TP, TP + SP, CP (ring) and CP (Ulysses), each s."""
    grid_tp, grid_cp = ParallelGrid(tp=n), ParallelGrid(cp=n)
    b, h, a = ACT["b"], ACT["h"], ACT["a"]
    out = {}
    for s in ACT["seqs"]:
        cfg = GPTConfig(n_layer=1, n_head=a, n_embd=h, block_size=s, vocab_size=256)
        for name, grid, tokens in (
            ("tp", grid_tp, s),
            ("tp_sp", grid_tp, s // grid_tp.tp_size),
            ("ring", grid_cp, s // grid_cp.cp_size),
            ("ulysses", grid_cp, s // grid_cp.cp_size),
        ):
            gpt = GPT(cfg, seed=0)
            if name.startswith("tp"):
                apply_tp(gpt, grid)
            if name == "tp_sp":
                apply_sp(gpt)
            if name in ("ring", "ulysses"):
                apply_cp(gpt, grid, "ring_zigzag" if name == "ring" else "ulysses")
            x = _rand(b, tokens, h, seed=12).requires_grad_()
            out[name, s], _ = saved_activation_bytes(gpt.blocks["0"], x)
    return out


def _deepspeed_ulysses(n):
    """DeepSpeed's DistributedAttention (batch-first: scatter heads, gather sequence) and ours on
    the same shards at cp = n: outputs and input gradients."""
    import deepspeed.comm
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.comm.init_distributed(dist_backend="gloo")  # adopts the process group already up

    def local(q, k, v):  # (B, T, nh/cp, hs) -> the same, causal, as DeepSpeed hands them over
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return y.transpose(1, 2)

    grid = ParallelGrid(cp=n)
    g, cp, r = grid.cp_group, grid.cp_size, grid.cp_rank
    q, k, v, do = (cp_shard(t, r, cp, "contiguous", dim=2) for t in _qkv_do(torch.float64))
    res = {}
    for who in ("deepspeed", "ours"):
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        if who == "deepspeed":
            ds = DistributedAttention(local, g, scatter_idx=2, gather_idx=1)
            o = ds(*(t.transpose(1, 2) for t in (qi, ki, vi)), batch_dim_idx=0).transpose(1, 2)
        else:
            o = UlyssesAttention(g)(qi, ki, vi)
        o.backward(do)
        res[who] = [t.detach() for t in (o, qi.grad, ki.grad, vi.grad)]
    return res


def _megatron_sp(n):
    """megatron-core's ColumnParallelLinear -> RowParallelLinear with sequence_parallel=True
    ([s/t, b, h] in and out) and ours, same shards at tp = n: output, dX, dW."""
    from megatron.core import tensor_parallel as mtp

    import dtl.megatron as dm

    grid = ParallelGrid(tp=n)
    g, t, r = grid.tp_group, grid.tp_size, grid.tp_rank
    w1, w2 = _rand(16, 8, seed=2), _rand(8, 16, seed=5)
    x = _rand(8, 3, 8, seed=1)  # [s, b, h], megatron's layout; my s/t rows below
    mine = x.chunk(t, dim=0)[r]
    out = {}
    dm.init_parallel_state(grid)
    try:
        with dm.cpu_shim():
            mtp.model_parallel_cuda_manual_seed(1234)
            cfg = dm.model_parallel_config(grid, sequence_parallel=True)
            init = nn.init.zeros_
            fc1 = mtp.ColumnParallelLinear(
                8, 16, config=cfg, init_method=init, bias=False, gather_output=False
            )
            fc2 = mtp.RowParallelLinear(
                16,
                8,
                config=cfg,
                init_method=init,
                bias=False,
                input_is_parallel=True,
                skip_bias_add=False,
            )
            with torch.no_grad():
                fc1.weight.copy_(w1.chunk(t)[r])
                fc2.weight.copy_(w2.chunk(t, dim=1)[r])
            xm = mine.clone().requires_grad_()
            y = fc2(F.gelu(fc1(xm)[0]))[0]  # [s/t, b, 8]
            y.sum().backward()
            out["megatron"] = [y.detach(), xm.grad, fc1.weight.grad, fc2.weight.grad]
    finally:
        dm.destroy_parallel_state()
    col, row = ColumnParallelLinear(8, 16, g, bias=False), RowParallelLinear(16, 8, g, bias=False)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(t)[r])
        row.weight.copy_(w2.chunk(t, dim=1)[r])
    col, row = SPColumnParallelLinear(col), SPRowParallelLinear(row)
    xo = mine.transpose(0, 1).clone().requires_grad_()  # ours is batch-first: [b, s/t, h]
    y = row(F.gelu(col(xo)))
    y.sum().backward()
    out["ours"] = [
        y.detach().transpose(0, 1),
        xo.grad.transpose(0, 1),
        col.weight.grad,
        row.weight.grad,
    ]
    return out


def _sp(n):
    """The SP layouts at tp = n, no CP: one block, TP against TP + SP, both save_gathered; the
    TP GPT and the TP + SP GPT (SGD, AdamW, SGD with full recomputation)."""
    grid = ParallelGrid(tp=n)
    out = {("sp_block", save): _sp_block(grid, save) for save in (False, True)}
    for opt_name in ("sgd", "adamw"):
        out["tp_sp", opt_name] = _train(grid, "ring", opt_name, (True, True))
    out["tp", "sgd"] = _train(grid, "ring", "sgd", (True, False))
    # recomputation: SP's collectives run again inside backward
    out["tp_sp", "full", "sgd"] = _train(grid, "ring", "sgd", (True, True), recompute="full")
    return out


def _cp_ring(n):
    """The CP GPT at cp = n with ring attention: zig-zag (SGD, AdamW, SGD with selective
    recomputation: its K/V ring runs again inside backward) and contiguous."""
    grid = ParallelGrid(cp=n)
    out = {("cp", "ring_zigzag", o): _train(grid, "ring_zigzag", o) for o in ("sgd", "adamw")}
    out["cp", "ring", "sgd"] = _train(grid, "ring", "sgd")
    out["cp", "ring_zigzag", "selective", "sgd"] = _train(
        grid, "ring_zigzag", "sgd", recompute="selective"
    )
    return out


def _cp_ulysses(n):
    """The CP GPT at cp = n with Ulysses."""
    return {("cp", "ulysses", "sgd"): _train(ParallelGrid(cp=n), "ulysses", "sgd")}


def _grids_2d_ring(n):
    """The 2-D grids at 4 ranks with the zig-zag ring: CP 2 x DP 2 and CP 2 x TP 2 + SP."""
    return {
        ("cp_dp", "sgd"): _train(ParallelGrid(cp=2, dp=2), "ring_zigzag", "sgd"),
        ("cp_tp_sp", "sgd"): _train(ParallelGrid(cp=2, tp=2), "ring_zigzag", "sgd", (True, True)),
    }


def _grids_2d_ulysses(n):
    """CP 2 x TP 2 + SP with Ulysses, at 4 ranks."""
    grid = ParallelGrid(cp=2, tp=2)
    return {("cp_tp_sp_ulysses", "sgd"): _train(grid, "ulysses", "sgd", (True, True))}


def _gpt(n, key):
    """The run `key` names on each of n ranks, from the part that holds it: SP alone, or CP with
    the ring or with Ulysses (a broken ring leaves Ulysses' runs green, and the reverse)."""
    ulysses = "ulysses" in key[0] or "ulysses" in key
    if key[0] in ("tp", "tp_sp"):
        part = _sp
    elif key[0] == "cp":
        part = _cp_ulysses if ulysses else _cp_ring
    else:
        part = _grids_2d_ulysses if ulysses else _grids_2d_ring
    return [res[key] for res in _on_ranks(part, n)]


# --- merging partial results (day21.merge) -----------------------------------------------------


def test_merging_key_blocks_by_their_log_sum_exp_equals_softmax_over_all_keys():
    """One process: the keys cut into blocks of 5, 3 and 8, each block's (out, lse) from
    _block_forward folded in by _merge, in both orders, equal softmax(q k^T s) v over all 16 keys
    and its row log-sum-exp. fp64. With the scores scaled by 300 some lse pass 709, where exp in
    fp64 overflows: only a merge through differences of lse holds there."""
    q, k, v, _ = _qkv_do(torch.float64)
    scale = 1.0 / math.sqrt(ATT["hs"])
    blocks = [slice(0, 5), slice(5, 8), slice(8, 16)]
    for sharp in (1.0, 300.0):
        s = (sharp * q @ k.transpose(-2, -1)) * scale
        want = torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)
        for order in (blocks, blocks[::-1]):
            out = lse = None
            for b in order:
                part = _block_forward(sharp * q, k[:, :, b], v[:, :, b], scale, False)
                out, lse = _merge(out, lse, *part)
            case = f"scores x{sharp:g}, blocks from keys {[b.start for b in order]}"
            for what, got, w in (("output", out, want[0]), ("lse", lse, want[1])):
                torch.testing.assert_close(
                    got, w, **FP[torch.float64], msg=lambda m, c=f"{case}, {what}": f"{c}: {m}"
                )


# --- ring attention (day21.ring_forward) --------------------------------------------------------


def _full_attention(dtype, causal):
    q, k, v, do = _qkv_do(dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(do)
    return [o.detach(), q.grad, k.grad, v.grad]


def _assert_equals_full_attention(attn, ranks):
    for _, split, causal in (c for c in CASES if c[0] == attn):
        for dtype, tol in FP.items():
            want = _full_attention(dtype, causal)
            for i, what in enumerate(("output", "dQ", "dK", "dV")):
                shards = [res["cases"][split, causal, dtype]["grads"][i] for res in ranks]
                got = cp_unshard(shards, split, dim=2)
                torch.testing.assert_close(
                    got,
                    want[i],
                    **tol,
                    msg=lambda m, c=(attn, split, causal, dtype, what): f"{c}: {m}",
                )


def _assert_bytes_equal_the_formula(attn, n, ranks):
    b, nh, s, hs = ATT["B"], ATT["nh"], ATT["T"], ATT["hs"]
    for _, split, causal in (c for c in CASES if c[0] == attn):
        for dtype in FP:
            e = torch.finfo(dtype).bits // 8
            fn = formulas.ring_layer_bytes if attn == "ring" else formulas.ulysses_layer_bytes
            kw = dict(acc_e=e) if attn == "ring" else {}
            want = fn(b, s, nh * hs, n, 1, e, **kw)
            for res in ranks:
                fwd, bwd = res["cases"][split, causal, dtype]["sent"]
                assert (fwd, bwd) == (want["forward"], want["backward"]), (attn, split, dtype)


@WORLDS
def test_ring_attention_equals_full_attention_output_dq_dk_dv_fp32_and_fp64(n):
    _assert_equals_full_attention("ring", _on_ranks(_ring, n))


@WORLDS
def test_ring_forward_posts_each_transfer_before_the_steps_compute_and_waits_after(n):
    """The overlap, as data: steps 0 .. cp-2 each post the K/V send/recv, compute, then wait;
    the last step only computes (a ring of cp steps moves cp - 1 blocks)."""
    want = [*RING_RANGES] * (n - 1) + ["ring.compute_s"]
    for r, res in enumerate(_on_ranks(_ring, n)):
        assert res["schedule"] == want, f"rank {r}: ranges opened {res['schedule']}"


@WORLDS
def test_ring_bytes_per_layer_equal_the_formula(n):
    _assert_bytes_equal_the_formula("ring", n, _on_ranks(_ring, n))


@WORLDS
def test_blocks_computed_per_rank_follow_the_split_and_zigzag_balances_them(n):
    ranks = _on_ranks(_ring, n)
    for split in ("contiguous", "zigzag"):
        work = attention_work(n, split)
        got = [res["cases"][split, True, torch.float64] for res in ranks]
        assert [g["blocks"] for g in got] == [w["blocks"] for w in work]
        # what ran, counted by torch: QK^T and PV of a (c x hs) chunk pair are 2 x 2 c^2 hs FLOPs
        # per (batch, head), c = T / cp (contiguous) or T / 2cp (zig-zag); no other matmul
        c = ATT["T"] // (n if split == "contiguous" else 2 * n)
        per_block = 2 * 2 * c * c * ATT["hs"] * ATT["B"] * ATT["nh"]
        assert [g["flops"] for g in got] == [w["blocks"] * per_block for w in work]
    contiguous = attention_work(n, "contiguous")
    assert [w["blocks"] for w in contiguous] == list(range(1, n + 1))  # rank r: r + 1 blocks
    assert imbalance(w["needed"] for w in contiguous) == pytest.approx((n - 0.5) / (n / 2))
    assert imbalance(w["needed"] for w in attention_work(n, "zigzag")) == 1.0
    assert imbalance(w["blocks"] for w in attention_work(n, "zigzag")) == 1.0


# --- Ulysses (day21.ulysses_all_to_all) ---------------------------------------------------------


@WORLDS
def test_ulysses_all_to_all_gives_rank_r_every_token_of_its_heads_and_back(n):
    """seq_to_heads of rank r's contiguous shard is heads r·nh/cp .. (r+1)·nh/cp - 1 of the whole
    sequence, exactly; heads_to_seq of that is the shard again."""
    x, h = _qkv_do(torch.float64)[0], ATT["nh"] // n
    for r, res in enumerate(_on_ranks(_ulysses, n)):
        heads, back = res["layout"]
        say = lambda m, r=r: f"rank {r}, seq_to_heads: {m}"  # noqa: E731
        torch.testing.assert_close(heads, x[:, r * h : (r + 1) * h], rtol=0, atol=0, msg=say)
        say = lambda m, r=r: f"rank {r}, heads_to_seq(seq_to_heads(shard)): {m}"  # noqa: E731
        mine = cp_shard(x, r, n, "contiguous", dim=2)
        torch.testing.assert_close(back, mine, rtol=0, atol=0, msg=say)


@WORLDS
def test_ulysses_equals_full_attention_output_dq_dk_dv_fp32_and_fp64(n):
    _assert_equals_full_attention("ulysses", _on_ranks(_ulysses, n))


@WORLDS
def test_ulysses_bytes_per_layer_equal_the_formula(n):
    _assert_bytes_equal_the_formula("ulysses", n, _on_ranks(_ulysses, n))


@needs_extras("deepspeed")
def test_deepspeed_ulysses_equals_ours():
    for res in _on_ranks(_deepspeed_ulysses, 2):
        for got, want in zip(res["ours"], res["deepspeed"]):
            torch.testing.assert_close(got, want, **FP[torch.float64])


# --- the CP GPT and the SP GPT against the dense model -------------------------------------------


def _dense(opt_name, dp=1):
    gpt = GPT(CFG, seed=0)
    loss_fn(gpt(_global_batch(0, dp)[0]), _global_batch(0, dp)[1]).backward()
    grads = _named(gpt, grads=True)
    gpt = GPT(CFG, seed=0)
    losses = reference_train(
        gpt, lambda s: _global_batch(s, dp), _optimizer(opt_name, gpt.parameters()), K
    )
    return losses, grads, _named(gpt)


def _assert_like_dense(got, opt_name, dp=1):
    losses, grads, params = _dense(opt_name, dp)
    torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=0)
    atol = 1e-6 if opt_name == "sgd" else 1e-4
    for name in params:
        msg = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(got["grads"][name], grads[name], **TOL, msg=msg)
        torch.testing.assert_close(got["params"][name], params[name], rtol=1e-5, atol=atol, msg=msg)


@pytest.mark.parametrize(
    "key",
    [
        ("cp", "ring_zigzag", "sgd"),
        ("cp", "ring_zigzag", "adamw"),
        ("cp", "ring", "sgd"),
        ("cp", "ulysses", "sgd"),
        ("tp", "sgd"),
        ("tp_sp", "sgd"),
        ("tp_sp", "adamw"),
        ("tp_sp", "full", "sgd"),
        ("cp", "ring_zigzag", "selective", "sgd"),
    ],
    ids=lambda k: "-".join(k),
)
@WORLDS
def test_cp_and_sp_gpt_losses_gradients_parameters_after_k_steps_equal_the_dense_model(n, key):
    for got in _gpt(n, key):
        _assert_like_dense(got, key[-1])


@pytest.mark.parametrize(
    "key", [("tp_sp", "full", "sgd"), ("cp", "ring_zigzag", "selective", "sgd")], ids="-".join
)
@WORLDS
def test_recomputation_under_sp_and_ring_attention_changes_no_bit(n, key):
    """Full recomputation under TP + SP (its all-gathers and reduce-scatters rerun in backward),
    selective under ring attention (its K/V ring reruns): the same losses, gradients and
    parameters as the same layout without recomputation, bit for bit."""
    plain = tuple(k for k in key if k not in ("full", "selective"))
    for got, want in zip(_gpt(n, key), _gpt(n, plain)):
        assert got["losses"] == want["losses"]
        for name in want["grads"]:
            assert torch.equal(got["grads"][name], want["grads"][name]), name
            assert torch.equal(got["params"][name], want["params"][name]), name


@pytest.mark.parametrize(
    "key", [("cp_dp", "sgd"), ("cp_tp_sp", "sgd"), ("cp_tp_sp_ulysses", "sgd")], ids="-".join
)
def test_2d_grids_cp_x_dp_and_cp_x_tp_sp_equal_the_dense_model(key):
    for got in _gpt(4, key):
        _assert_like_dense(got, "sgd", dp=2 if key[0] == "cp_dp" else 1)


@WORLDS
def test_sp_block_equals_tp_block_and_moves_the_same_bytes_plus_the_regathers(n):
    t, ranks = n, _on_ranks(_sp, n)
    one = (t - 1) / t * B * T * CFG.n_embd * 4  # one all-gather or reduce-scatter of (B, T, C)
    for save_gathered in (False, True):
        for res in ranks:
            tp, sp = res["sp_block", save_gathered][False], res["sp_block", save_gathered][True]
            torch.testing.assert_close(sp["y"], tp["y"], **TOL)
            torch.testing.assert_close(sp["dx"], tp["dx"], **TOL)
            for name in tp["grads"]:
                torch.testing.assert_close(sp["grads"][name], tp["grads"][name], **TOL)
            tp_bytes = tp["fwd"]["all_reduce"] + tp["bwd"]["all_reduce"]
            activations = sum(sp["fwd"].values()) + sum(
                v for k, v in sp["bwd"].items() if k != "all_reduce"
            )
            extra = 0 if save_gathered else 2 * one  # c_attn and c_fc re-gather their inputs
            assert activations == pytest.approx(tp_bytes + extra, rel=1e-12)
            want = formulas.sp_layer_bytes(B, T, CFG.n_embd, t, 4, save_gathered)
            got = {k: sp["fwd"].get(k, 0) + sp["bwd"].get(k, 0) for k in want}
            assert got == pytest.approx(want, rel=1e-12)
            assert tp_bytes == pytest.approx(formulas.tp_layer_bytes(B, T, CFG.n_embd, t))


@WORLDS
def test_sp_step_bytes_equal_the_formula(n):
    want = formulas.sp_step_bytes(CFG, B, T, n)
    for res in _gpt(n, ("tp_sp", "sgd")):
        assert res["bytes"] == pytest.approx(want, rel=1e-12)


@needs_extras("megatron")
def test_megatron_core_sequence_parallel_layers_equal_ours():
    for res in _on_ranks(_megatron_sp, 2):
        for got, want in zip(res["ours"], res["megatron"]):
            torch.testing.assert_close(got, want, **TOL)


# --- activation memory --------------------------------------------------------------------------


@WORLDS
def test_saved_activations_per_rank_none_tp_sp_cp_at_three_lengths_equal_the_formula(n):
    b, h, a = ACT["b"], ACT["h"], ACT["a"]
    got = dict(_on_ranks(_activations, n)[0])
    for s in ACT["seqs"]:  # none: the dense block in this process
        gpt = GPT(GPTConfig(n_layer=1, n_head=a, n_embd=h, block_size=s, vocab_size=256), seed=0)
        got["none", s], _ = saved_activation_bytes(gpt.blocks["0"], _rand(b, s, h, seed=12))
    for (name, s), measured in got.items():
        pred = formulas.layout_bytes(name, s, b, h, a, n)
        assert measured == pred, (name, s, measured, pred)  # to the byte, as the notes say
    for s in ACT["seqs"]:  # what each layout buys: SP and CP both divide by the group size
        assert got["tp_sp", s] < got["tp", s] < got["none", s]
        assert got["ring", s] == pytest.approx(got["none", s] / n, rel=0.02)


# --- bad input ----------------------------------------------------------------------------------


def test_sizes_that_do_not_split_are_one_line_errors():
    for args, pattern in (
        ((4, 1, 2, 63, "ring"), "seq_len 63 is not divisible by 2"),
        ((4, 1, 2, 66, "ring_zigzag"), "seq_len 66 is not divisible by 4"),
        ((4, 1, 8, 64, "ulysses"), "4 heads per TP rank do not split over cp 8"),
        ((4, 2, 4, 64, "ulysses"), "2 heads per TP rank do not split over cp 4"),
        ((4, 1, 2, 64, "flash"), "unknown attention 'flash'"),
    ):
        with pytest.raises(CPError, match=pattern) as info:
            check_cp(*args)
        assert "\n" not in str(info.value)
    with pytest.raises(SPError, match="needs tensor parallelism"):
        apply_sp(GPT(CFG, seed=0))
    with_dropout = GPT(dataclasses.replace(CFG, dropout=0.1), seed=0)
    with_dropout.tp = TPInfo(group=None, size=2, rank=0, vocab_size=256, padded_vocab_size=256)
    with pytest.raises(SPError, match="separate RNG stream per TP rank"):
        apply_sp(with_dropout)


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--cp=2", "--attn=ring", "--seq_len=63"], "2", "seq_len 63 is not divisible by 2"),
        (["--cp=2", "--seq_len=66"], "2", "seq_len 66 is not divisible by 4"),
        (["--cp=8", "--attn=ulysses"], "8", "4 heads per TP rank do not split over cp 8"),
        (["--cp=2", "--sp"], "2", "--sp needs tensor parallelism"),
        (["--cp=3"], "4", "cp 3 x tp 1 does not divide the world size 4"),
    ],
)
def test_train_script_rejects_bad_input_with_one_line_and_exit_2(args, world, message):
    assert message in script_error("day21_sp_cp.train", *args, env={"WORLD_SIZE": world})


def test_replicated_parameters_are_layernorms_and_row_biases():
    names = replicated_parameters(GPT(CFG, seed=0))
    assert "wpe.weight" not in names and "ln_f.weight" in names
    assert "blocks.0.attn.c_proj.bias" in names and "blocks.0.attn.c_attn.bias" not in names
