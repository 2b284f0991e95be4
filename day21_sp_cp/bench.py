"""Day 21 benchmark: the causal imbalance of ring attention, its overlap, and activation memory.

    torchrun --standalone --nproc_per_node=4 -m day21_sp_cp.bench --part=ring     # cp = 2 and 4
    torchrun --standalone --nproc_per_node=2 -m day21_sp_cp.bench --part=memory   # t = cp = 2
    torchrun --standalone --nproc_per_node=2 -m day21_sp_cp.bench --part=recompute  # t = 2

ring: causal ring attention (forward + backward) on one (1, heads, T, head dim) sequence, split
contiguous and zig-zag, at cp = 2 (two rings side by side) and cp = 4. Per rank: the blocks it
computed and their FLOPs (counted), and the CPU seconds its thread spent in block math
(time.thread_time: fair when 4 ranks share 2 cores, unlike a wall clock). Imbalance = slowest
rank / mean rank, counted and measured. Then the same work in one process (the fused kernel and
our block math with cp = 1), and how much of the K/V and dK/dV traffic waited: RingStats' wait
time and, from a torch.profiler trace per rank, the share of gloo's send/recv spans that fall
inside compute ranges (outputs/day21_sp_cp/bench/traces).
memory: the bytes one GPT-2-width layer (h 768, 12 heads) saves for backward on a rank under
none / TP / TP + SP / CP (ring) / CP (Ulysses) at three sequence lengths, beside
formulas.layer_terms; the long-context table of GPT-2 124M from the paper's formulas; a PNG.
recompute: the same layer under no / selective / full activation recomputation (dtl.model's
set_recompute), one rank of none, TP and TP + SP at t = 2, in bf16, with the scores materialized
(the paper's case) and with the fused kernel: measured, the formula (layer_terms under
recompute_terms) and the paper's Table 2 (16-bit, with dropout, which this model has not).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F

from day19_tp.activations import (
    korthikanti_recompute_bytes,
    recompute_terms,
    saved_activation_bytes,
)
from day19_tp.tp import apply_tp
from day21_sp_cp import formulas
from day21_sp_cp.cp import apply_cp
from day21_sp_cp.ring_attention import RingStats, attention_work, imbalance, ring_attention
from day21_sp_cp.sp import apply_sp
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.data import cp_shard
from dtl.grid import ParallelGrid
from dtl.model import GPT, Recompute, naive_attention, preset, sdpa_attention
from dtl.profile import hidden_fraction, parse_trace

SPLITS = ("contiguous", "zigzag")
RECOMPUTES = get_args(Recompute)
LAYOUTS = tuple(formulas.LAYOUTS)


@dataclass
class Config:
    # ring (imbalance, overlap, vs one process) | memory (activations) | recompute (the same
    # under activation recomputation)
    part: Literal["ring", "memory", "recompute"] = "ring"
    seq_len: int = 2048  # ring: tokens of the one sequence
    heads: int = 4  # ring: attention heads
    head_dim: int = 32  # ring: head dim
    reps: int = 3  # ring: measured forward + backward passes per case (after one warm-up)
    seqs: str = "256,512,1024"  # memory: the three sequence lengths
    out_dir: str = "outputs/day21_sp_cp/bench"  # config.json, traces, PNGs

    def validate(self) -> None:
        err = dtl_config.ConfigError
        world = dtl_dist.launch_world_size()
        if self.part == "ring" and (world < 2 or self.seq_len % (2 * world)):
            raise err(f"part=ring needs >= 2 ranks and seq_len divisible by 2 x {world}")
        if self.part in ("memory", "recompute") and world != 2:
            raise err(f"part={self.part} runs on 2 ranks (t = 2)")
        try:
            seqs = [int(s) for s in self.seqs.split(",")]
        except ValueError:
            raise err(f"seqs must be comma-separated integers, got '{self.seqs}'") from None
        if self.part in ("memory", "recompute") and any(s % 4 for s in seqs):
            raise err(f"every memory sequence length must divide by 4, got {seqs}")


# --- part ring ----------------------------------------------------------------------------------


def _qkv(cfg: Config, rank: int, cp: int, split: str):
    g = torch.Generator().manual_seed(0)
    shape = (1, cfg.heads, cfg.seq_len, cfg.head_dim)
    full = [torch.randn(shape, generator=g) for _ in range(3)]  # host: this bench is CPU-only
    return [cp_shard(t, rank, cp, split, dim=2).requires_grad_() for t in full]


def _ring_pass(cfg, grid: ParallelGrid, split, stats=None):
    q, k, v = _qkv(cfg, grid.cp_rank, grid.cp_size, split)
    out = ring_attention(q, k, v, grid.cp_group, split, True, stats)
    out.sum().backward()


def _block_flops(cfg: Config, cp: int, split: str, blocks: int) -> float:
    """Forward 4, backward 10 (recomputed scores, dV, dP, dQ, dK) x Tc² x hd x heads per block."""
    chunk = cfg.seq_len // (cp * (2 if split == "zigzag" else 1))
    return blocks * 14 * chunk * chunk * cfg.head_dim * cfg.heads


def measure_split(cfg: Config, grid: ParallelGrid, split: str) -> list[dict]:
    """Every cp rank's counted and measured work for one split (collective over the cp group)."""
    _ring_pass(cfg, grid, split)  # warm-up
    stats = RingStats()
    for _ in range(cfg.reps):
        _ring_pass(cfg, grid, split, stats)
    mine = torch.tensor(
        [
            stats.blocks / cfg.reps,
            stats.compute_cpu_s / cfg.reps,
            stats.wait_s / cfg.reps,
            stats.compute_s / cfg.reps,
        ],
        dtype=torch.float64,
        device=dtl_dist.run_device(grid.cp_group),  # it enters a collective
    )
    rows = [torch.empty_like(mine) for _ in range(grid.cp_size)]
    dist.all_gather(rows, mine, group=grid.cp_group)
    return [
        dict(blocks=int(r[0]), cpu_s=r[1].item(), wait_s=r[2].item(), wall_s=r[3].item())
        for r in rows
    ]


def one_process_seconds(cfg: Config, single: ParallelGrid) -> dict[str, float]:
    """The whole sequence in one process: the fused kernel, and our block math at cp = 1."""
    q, k, v = (t.detach().requires_grad_() for t in _qkv(cfg, 0, 1, "contiguous"))
    out = {}
    for name in ("sdpa", "ours_cp1"):
        best = float("inf")
        for _ in range(cfg.reps + 1):
            c0 = time.thread_time()
            if name == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = ring_attention(q, k, v, single.cp_group, "contiguous", True)
            y.sum().backward()
            best = min(best, time.thread_time() - c0)
        out[name] = best
    return out


def trace_overlap(cfg: Config, grid: ParallelGrid, rank: int) -> float:
    """Profile one zig-zag pass; the share of gloo send/recv time inside block-math ranges."""
    path = os.path.join(cfg.out_dir, "traces", f"rank{rank}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _ring_pass(cfg, grid, "zigzag")
    prof.export_chrome_trace(path)
    spans = parse_trace(path)
    comm = [(s.start_ms, s.end_ms) for s in spans if s.name in ("gloo:send", "gloo:recv")]
    compute = [(s.start_ms, s.end_ms) for s in spans if s.name == "ring.compute_s"]
    return hidden_fraction(comm, compute)


def part_ring(cfg: Config, info) -> str:
    results = {}
    for cp in (c for c in (2, 4) if c <= info.world_size and info.world_size % c == 0):
        grid = ParallelGrid(cp=cp, dp=info.world_size // cp)
        for split in SPLITS:
            results[cp, split] = measure_split(cfg, grid, split)
    single = ParallelGrid(cp=1, dp=info.world_size)
    alone = one_process_seconds(cfg, single)
    cp_max = max(cp for cp, _ in results)
    hidden = trace_overlap(cfg, ParallelGrid(cp=cp_max, dp=info.world_size // cp_max), info.rank)
    hidden = dtl_dist.all_reduce_scalar(hidden, average=True)
    if info.is_main:
        _print_ring(cfg, results, alone, hidden)
        _plot_ring(cfg, results)
    parts = []
    for cp in sorted({c for c, _ in results}):
        for split in SPLITS:
            rows = results[cp, split]
            counted = imbalance(r["blocks"] for r in rows)
            measured = imbalance(r["cpu_s"] for r in rows)
            parts.append(f"cp={cp} {split} {counted:.2f} counted / {measured:.2f} measured")
    rows = results[cp_max, "zigzag"]
    ratio = sum(r["cpu_s"] for r in rows) / alone["sdpa"]
    return (
        f"summary: day21 ring attention imbalance (slowest/mean rank): {'; '.join(parts)}; "
        f"ring CPU time over all ranks / one-process fused attention {ratio:.2f} at cp={cp_max}; "
        f"K/V transfer inside compute {hidden:.0%} (trace)"
    )


def _print_ring(cfg, results, alone, hidden) -> None:
    print(
        f"causal ring attention, (1, {cfg.heads}, {cfg.seq_len}, {cfg.head_dim}), forward + "
        f"backward, mean of {cfg.reps}; CPU seconds per rank (thread time)"
    )
    print(
        f"{'cp':>3} {'split':<11} {'rank':>4} {'blocks':>6} {'GFLOP':>7} {'needed':>7} "
        f"{'cpu ms':>8} {'wait ms':>8}"
    )
    for (cp, split), rows in results.items():
        needed = attention_work(cp, split)
        for r, row in enumerate(rows):
            gflop = _block_flops(cfg, cp, split, row["blocks"]) / 1e9
            need = _block_flops(cfg, cp, split, needed[r]["needed"]) / 1e9
            print(
                f"{cp:>3} {split:<11} {r:>4} {row['blocks']:>6} {gflop:>7.3f} {need:>7.3f} "
                f"{row['cpu_s'] * 1e3:>8.1f} {row['wait_s'] * 1e3:>8.1f}"
            )
        print(
            f"    imbalance: blocks {imbalance(x['blocks'] for x in rows):.2f}, causal pairs "
            f"{imbalance(x['needed'] for x in needed):.2f}, measured CPU "
            f"{imbalance(x['cpu_s'] for x in rows):.2f}"
        )
    print(
        f"one process, whole sequence: fused SDPA {alone['sdpa'] * 1e3:.1f} ms, our block math "
        f"at cp=1 {alone['ours_cp1'] * 1e3:.1f} ms (CPU)"
    )
    print(
        f"K/V and dK/dV transfers inside block-math ranges (trace, mean over ranks): {hidden:.0%}"
    )


def _plot_ring(cfg, results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = sorted({c for c, _ in results})
    fig, axes = plt.subplots(1, len(cps), figsize=(5 * len(cps), 3.5), squeeze=False)
    for ax, cp in zip(axes[0], cps):
        width = 0.38
        for i, split in enumerate(SPLITS):
            ms = [r["cpu_s"] * 1e3 for r in results[cp, split]]
            ax.bar([r + (i - 0.5) * width for r in range(cp)], ms, width, label=split)
        ax.set(title=f"cp = {cp}: block math per rank", xlabel="cp rank", ylabel="CPU ms")
        ax.set_xticks(range(cp))
        ax.legend()
    fig.tight_layout()
    path = os.path.join(cfg.out_dir, "imbalance.png")
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


# --- part memory --------------------------------------------------------------------------------


def _one_layer(layout: str, s: int, grid_tp, grid_cp) -> tuple[GPT, int]:
    """A one-layer GPT-2-width model laid out as `layout` on this rank, and the tokens of a
    length-s sequence its layer holds (s, or s/t under SP, s/cp under CP)."""
    cfg = preset("gpt2-124m", n_layer=1, block_size=s, vocab_size=256)
    gpt = GPT(cfg, seed=0)
    tokens = s
    if layout in ("tp", "tp_sp"):
        apply_tp(gpt, grid_tp)
    if layout == "tp_sp":
        apply_sp(gpt)
        tokens = s // grid_tp.tp_size
    if layout in ("ring", "ulysses"):
        apply_cp(gpt, grid_cp, "ring_zigzag" if layout == "ring" else "ulysses")
        tokens = s // grid_cp.cp_size
    return gpt, tokens


def _block_bytes(gpt: GPT, tokens: int, b: int = 1) -> int:
    """Bytes block 0 saves for backward on a (b, tokens, C) input in the model's dtype."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, tokens, gpt.cfg.n_embd, generator=g)  # host: this bench is CPU-only
    x = x.to(next(gpt.parameters()).dtype)
    got, _ = saved_activation_bytes(gpt.blocks["0"], x.requires_grad_())
    return got


def _layer_bytes(layout: str, s: int, grid_tp, grid_cp, b: int = 1) -> int:
    gpt, tokens = _one_layer(layout, s, grid_tp, grid_cp)
    return _block_bytes(gpt, tokens, b)


def _predicted(layout: str, s: int, n: int, b: int = 1) -> float:
    cfg = preset("gpt2-124m")
    return formulas.layout_bytes(layout, s, b, cfg.n_embd, cfg.n_head, n)


def part_memory(cfg: Config, info) -> str:
    grid_tp, grid_cp = ParallelGrid(tp=2), ParallelGrid(cp=2)
    seqs = [int(s) for s in cfg.seqs.split(",")]
    table = {}
    for s in seqs:
        for layout in LAYOUTS:
            table[layout, s] = (_layer_bytes(layout, s, grid_tp, grid_cp), _predicted(layout, s, 2))
    worst = max(abs(g - p) / p for g, p in table.values())
    if info.is_main:
        _print_memory(seqs, table)
        _plot_memory(cfg, seqs, table)
    return (
        f"summary: day21 activations of one GPT-2-width layer per rank (none, TP, TP+SP, ring, "
        f"Ulysses at t = cp = 2, s = {cfg.seqs}) vs formulas.layer_terms: worst "
        f"|measured - formula| = {worst:.1%}"
    )


def _print_memory(seqs, table) -> None:
    print("one layer, h 768, 12 heads, b 1, fp32, fused attention; MB saved for backward, rank 0")
    print(f"{'s':>6} " + " ".join(f"{name:>17}" for name in LAYOUTS))
    for s in seqs:
        cells = [f"{table[n, s][0] / 1e6:7.1f} / {table[n, s][1] / 1e6:7.1f}" for n in LAYOUTS]
        print(f"{s:>6} " + " ".join(f"{c:>17}" for c in cells))
    print("(measured / formula)")
    print("GPT-2 124M, 12 layers, b 1, 16-bit, the paper's formulas (GB of activations):")
    print(f"{'s':>7} {'s x s scores':>13} {'fused (34sbh)':>14} {'TP8 + SP':>9} {'+ CP8':>7}")
    for row in formulas.long_context_rows(preset("gpt2-124m"), [2**k * 1024 for k in range(1, 8)]):
        print(
            f"{row['s']:>7,} {row['scores']:>13.1f} {row['fused']:>14.2f} {row['tp_sp']:>9.3f} "
            f"{row['tp_sp_cp']:>7.4f}"
        )
    _print_attention_flops()


def _print_attention_flops() -> None:
    """The compute side of long context: attention's share of a training step's FLOPs."""
    models = {"GPT-2 124M": preset("gpt2-124m"), "7B (LLaMA-2 shape)": formulas.SEVEN_B}
    seqs = [2**k * 1024 for k in range(0, 8)]
    print("training FLOPs per token: attention 12·L·C·T against the weights' 6N (share of total)")
    print(f"{'s':>7} " + " ".join(f"{name:>20}" for name in models))
    for i, s in enumerate(seqs):
        cells = [formulas.attention_flops_rows(m, seqs)[i]["share"] for m in models.values()]
        print(f"{s:>7,} " + " ".join(f"{c:>20.1%}" for c in cells))
    for name, m in models.items():
        print(f"  {name}: attention equals 6N at T = {formulas.attention_crossover(m):,.0f}")


def _plot_memory(cfg, seqs, table) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in LAYOUTS:
        line = ax.plot(seqs, [table[name, s][1] / 1e6 for s in seqs], label=f"{name} (formula)")
        ax.plot(seqs, [table[name, s][0] / 1e6 for s in seqs], "o", color=line[0].get_color())
    ax.set(
        xlabel="sequence length s",
        ylabel="MB saved per layer per rank",
        xscale="log",
        yscale="log",
        title="one GPT-2-width layer, t = cp = 2 (dots: measured)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(cfg.out_dir, "activations.png")
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


# --- part recompute -----------------------------------------------------------------------------

RECOMPUTE_LAYOUTS = ("none", "tp", "tp_sp")
ATTENTIONS = {"materialized": naive_attention, "fused": sdpa_attention}


def _recompute_layer_bytes(
    layout: str, attention: str, mode: str, s: int, grid: ParallelGrid
) -> int:
    """Bytes block 0 of a one-layer GPT-2-width model (bf16) saves for backward on this rank."""
    gpt, tokens = _one_layer(layout, s, grid, None)  # no CP layout here
    gpt.set_attention(ATTENTIONS[attention])
    gpt.set_recompute(mode)
    return _block_bytes(gpt.to(torch.bfloat16), tokens)


def _recompute_formula(layout: str, attention: str, mode: str, s: int, t: int) -> float:
    cfg = preset("gpt2-124m")
    h, a, e = cfg.n_embd, cfg.n_head, 2
    kw = formulas.LAYOUTS[layout](t)
    # this bench runs on the CPU, whose LayerNorm keeps its mean and rstd in bf16 (CUDA: fp32)
    terms = formulas.layer_terms(
        s, 1, h, a, elem_bytes=e, attention=attention, ln_stats_bytes=e, **kw
    )
    layer_input = s // (t if kw.get("sp") else 1) * h * e
    return sum(recompute_terms(terms, mode, layer_input).values())


def _paper(layout: str, mode: str, s: int, t: int) -> float:
    cfg = preset("gpt2-124m")
    t = t if layout != "none" else 1
    return korthikanti_recompute_bytes(s, 1, cfg.n_embd, cfg.n_head, t, layout == "tp_sp", mode)


def part_recompute(cfg: Config, info) -> str:
    grid = ParallelGrid(tp=2)
    seqs = [int(s) for s in cfg.seqs.split(",")]
    rows = []
    for attention in ATTENTIONS:
        for layout in RECOMPUTE_LAYOUTS:
            for mode in RECOMPUTES:
                got = [_recompute_layer_bytes(layout, attention, mode, s, grid) for s in seqs]
                want = [_recompute_formula(layout, attention, mode, s, 2) for s in seqs]
                rows.append((attention, layout, mode, got, want, _paper(layout, mode, seqs[-1], 2)))
    worst = max(abs(g - w) for *_, got, want, _ in rows for g, w in zip(got, want))
    kept = {(a, lay, m): got[-1] for a, lay, m, got, *_ in rows}
    if info.is_main:
        _print_recompute(seqs, rows)
    sel = kept["materialized", "none", "selective"] / kept["materialized", "none", "none"]
    full = kept["materialized", "none", "full"] / kept["materialized", "none", "none"]
    return (
        f"summary: day21 recompute, one GPT-2-width layer per rank (none, TP, TP+SP at t = 2; "
        f"none / selective / full; s = {cfg.seqs}; bf16) vs layer_terms under recompute: worst "
        f"|measured - formula| = {worst:,.0f} B over {len(rows) * len(seqs)} cases; at "
        f"s = {seqs[-1]} with the scores materialized, "
        f"selective keeps {sel:.1%} and full {full:.1%} of no recomputation"
    )


def _print_recompute(seqs, rows) -> None:
    print("one layer, h 768, 12 heads, b 1, bf16; MB saved for backward on rank 0 (t = 2):")
    head = " ".join(f"{'s = ' + str(s):>17}" for s in seqs)
    paper = f"paper @ {seqs[-1]}"
    print(f"{'attention':<13}{'layout':<7}{'recompute':<10} {head} {paper:>13}")
    for attention, layout, mode, got, want, paper in rows:
        cells = " ".join(f"{g / 1e6:7.2f} / {w / 1e6:7.2f}" for g, w in zip(got, want))
        print(f"{attention:<13}{layout:<7}{mode:<10} {cells} {paper / 1e6:>13.2f}")
    print(
        "(measured / formula; paper: Korthikanti et al. Table 2, 16-bit with dropout: it adds "
        "the dropout masks, 2sbh + 3as²b, that this model (dropout 0) does not keep)"
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    info = dtl_dist.init(backend="gloo")  # counts work and bytes: CPU tensors, on any machine
    if torch.cuda.is_available():  # a GPU machine: say that this PASS is no GPU result
        dtl_dist.print0(
            "note: gloo on the CPU (forced: this bench counts CPU thread time, gloo's send/recv "
            "spans and CPU activation bytes); this PASS is not a GPU result"
        )
    dtl_config.save(cfg, cfg.out_dir, argv)
    parts = {"ring": part_ring, "memory": part_memory, "recompute": part_recompute}
    line = parts[cfg.part](cfg, info)
    dtl_dist.print0(line)
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
