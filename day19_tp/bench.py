"""Day 19 measurements: what t buys and costs (table), and our TP block vs megatron-core's (ratio).

    torchrun --standalone --nproc_per_node=4 -m day19_tp.bench --part=table   # t = 1, 2, 4
    torchrun --standalone --nproc_per_node=2 -m day19_tp.bench --part=ratio   # ~1 min
    python -m day19_tp.bench --part=node --model=gpt2-124m --batch_size=8 --seq_len=1024
GPUs: torchrun --standalone --nproc_per_node=gpu -m day19_tp.bench --part=table --model=gpt2-124m \
          --seq_len=512

table: for every t dividing the world (dp = world / t), one launch: parameters per rank,
activation bytes saved by one layer per rank (saved-tensor hooks), TP bytes sent per step
(CommCounter) and the median step time, each beside its formula. Writes table.csv.
ratio: one transformer layer at tp = 2, ours (apply_tp on a dtl GPT block) and megatron-core's
TransformerLayer (local spec, CPU shim) on the same shapes, forward + backward steps alternating;
median(ours) / median(megatron). Timings on a shared CPU box are noisy: read the ratio, not ms.
node: formulas only, no process group: one layer's 4 TP all-reduces per rank (batch_size x
seq_len tokens, 2-byte values, bandwidth term only) over NVLink and over one InfiniBand port,
beside its weight matmuls at an assumed rate (formulas.layer_comm_seconds,
layer_compute_seconds): why TP stays inside a node.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from day19_tp import formulas
from day19_tp.activations import korthikanti_bytes, layer_terms, saved_activation_bytes
from day19_tp.tp import apply_tp, tp_loss
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import extras
from dtl.comm import CommCounter
from dtl.grid import ParallelGrid
from dtl.metrics import write_csv
from dtl.model import GPT, PresetName, preset

MB = 1e6


@dataclass
class Config:
    # table (t = 1, 2, 4, ... that divide the world) | ratio (ours / megatron) | node (formulas)
    part: Literal["table", "ratio", "node"] = "table"
    model: PresetName = "small"  # GPT preset
    batch_size: int = 4  # sequences per rank
    seq_len: int = 64  # tokens per sequence
    steps: int = 6  # timed steps per configuration (after one warm-up)
    out_dir: str = "outputs/day19_tp/bench"  # table.csv

    def validate(self) -> None:
        if self.seq_len > preset(self.model).block_size:
            raise dtl_config.ConfigError(
                f"seq_len {self.seq_len} exceeds {self.model}'s block_size"
            )
        if self.part == "ratio":  # ours against megatron-core's TransformerLayer
            extras.require("part=ratio", "megatron")


def _tp_sizes(world: int, cfg) -> list[int]:
    return [t for t in (1, 2, 4, 8) if world % t == 0 and cfg.n_head % t == 0]


def table_row(cfg: Config, t: int, world: int, device) -> dict:
    mcfg = preset(cfg.model)
    grid = ParallelGrid(tp=t, dp=world // t)
    gpt = apply_tp(GPT(mcfg, seed=0), grid, pad_vocab=True).to(device)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    s, b, h, a = cfg.seq_len, cfg.batch_size, mcfg.n_embd, mcfg.n_head
    g = torch.Generator().manual_seed(0)  # a CPU generator: the same tokens on any device
    x = torch.randint(0, mcfg.vocab_size, (b, s + 1), generator=g).to(device)
    hidden = torch.randn(b, s, h, device=device, requires_grad=True)
    act, _ = saved_activation_bytes(gpt.blocks["0"], hidden)
    times = []
    for step in range(cfg.steps + 1):
        t0 = time.perf_counter()
        with CommCounter(group=grid.tp_group) as comm:
            tp_loss(gpt, gpt(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step:
            times.append((time.perf_counter() - t0) * 1e3)
    dist.barrier()
    elem = 4
    return dict(
        t=t,
        dp=world // t,
        params=sum(p.numel() for p in gpt.parameters()),
        params_formula=formulas.params_per_rank(mcfg, t),
        act_layer=act,
        act_formula=sum(layer_terms(s, b, h, a, t, elem, False, True).values()),
        act_korthikanti_16bit=korthikanti_bytes(s, b, h, a, t),
        comm=comm.ring_bytes_per_rank(),
        comm_formula=formulas.ring_bytes(
            sum(formulas.comm_elements_per_step(mcfg, b * s).values()), elem, t
        ),
        step_ms=statistics.median(times),
    )


def run_table(cfg: Config, info) -> list[dict]:
    rows = [
        table_row(cfg, t, info.world_size, info.device)
        for t in _tp_sizes(info.world_size, preset(cfg.model))
    ]
    dtl_dist.print0(
        f"{'t':>3}{'dp':>4}{'params/rank':>13}{'(formula)':>12}{'act/layer MB':>14}"
        f"{'(formula)':>11}{'(paper 16b)':>12}{'TP MB/step':>12}{'(formula)':>11}"
        f"{'step ms':>9}"
    )
    for r in rows:
        dtl_dist.print0(
            f"{r['t']:>3}{r['dp']:>4}{r['params']:>13,}{r['params_formula']:>12,}"
            f"{r['act_layer'] / MB:>14.3f}{r['act_formula'] / MB:>11.3f}"
            f"{r['act_korthikanti_16bit'] / MB:>12.3f}{r['comm'] / MB:>12.3f}"
            f"{r['comm_formula'] / MB:>11.3f}{r['step_ms']:>9.0f}"
        )
    return rows


def node_table(cfg: Config) -> str:
    """Why TP stays inside a node: per layer per rank, the 4 all-reduces' bytes and their time on
    NVLink and on one IB port, beside the layer's weight matmuls (t = 2, 4, 8; bf16 values)."""
    mcfg, tokens, elem = preset(cfg.model), cfg.batch_size * cfg.seq_len, 2
    flops = formulas.ASSUMED_MATMUL_FLOPS
    lines = [
        f"why TP stays inside a node: {cfg.model}, {cfg.batch_size} x {cfg.seq_len} tokens, "
        f"{elem}-byte values, bandwidth term only; per layer per rank",
        f"{'t':>3}{'sent (4 all-reduces)':>22}{f'NVLink {formulas.NVLINK_H100_GBS:.0f} GB/s':>18}"
        f"{f'IB {formulas.IB_NDR_GBS:.0f} GB/s':>13}{f'matmul at {flops / 1e12:.0f} TFLOP/s':>24}",
    ]
    ratios = []
    for t in (2, 4, 8):
        sent = formulas.ring_bytes(4 * tokens * mcfg.n_embd, elem, t)
        nvlink, ib = (
            formulas.layer_comm_seconds(mcfg, tokens, t, elem, gbs)
            for gbs in (formulas.NVLINK_H100_GBS, formulas.IB_NDR_GBS)
        )
        compute = formulas.layer_compute_seconds(mcfg, tokens, t, flops)
        ratios.append((nvlink / compute, ib / compute))
        what_if = "" if mcfg.n_head % t == 0 else f"  (what-if: {mcfg.n_head} heads do not split)"
        lines.append(
            f"{t:>3}{sent / MB:>19.1f} MB{nvlink * 1e3:>15.3f} ms{ib * 1e3:>10.2f} ms"
            f"{compute * 1e3:>21.3f} ms{what_if}"
        )
    lines.append(
        f"summary: day19 node {cfg.model}: TP comm / matmul per layer {ratios[0][0]:.2f}-"
        f"{ratios[-1][0]:.2f}x on NVLink, {ratios[0][1]:.1f}-{ratios[-1][1]:.1f}x on one IB port "
        f"(t = 2-8)"
    )
    return "\n".join(lines)


def _megatron_layer(grid: ParallelGrid, mcfg):
    from megatron.core import tensor_parallel as mtp
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import dtl.megatron as dm

    mtp.model_parallel_cuda_manual_seed(0)
    tcfg = dm.model_parallel_config(
        grid,
        config_class=TransformerConfig,
        num_layers=1,
        hidden_size=mcfg.n_embd,
        num_attention_heads=mcfg.n_head,
        ffn_hidden_size=4 * mcfg.n_embd,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **dm.FUSIONS_OFF,
    )
    return TransformerLayer(tcfg, get_gpt_layer_local_spec().submodules, layer_number=1)


def run_ratio(cfg: Config, info) -> dict:
    import dtl.megatron as dm

    mcfg = preset(cfg.model)
    grid = ParallelGrid(tp=2, dp=info.world_size // 2)
    device = info.device
    ours = apply_tp(GPT(mcfg, seed=0), grid).blocks["0"].to(device)
    s, b, h = cfg.seq_len, cfg.batch_size, mcfg.n_embd
    x_ours = torch.randn(b, s, h, device=device, requires_grad=True)  # ours: [b, s, h]
    x_theirs = torch.randn(s, b, h, device=device, requires_grad=True)  # megatron: [s, b, h]
    dm.init_parallel_state(grid)
    times = {"ours": [], "megatron": []}
    try:
        with dm.cpu_shim():
            # use_cpu_initialization builds megatron's weights on the CPU: move them to the
            # run's device, as ours are (megatron-LM's get_model calls .cuda() for the same)
            theirs = _megatron_layer(grid, mcfg).to(device)

            def step_ours():
                ours(x_ours).sum().backward()

            def step_theirs():
                out = theirs(x_theirs, attention_mask=None)
                (out[0] if isinstance(out, tuple) else out).sum().backward()

            for i in range(cfg.steps + 1):
                order = [("ours", step_ours), ("megatron", step_theirs)]
                for name, fn in order if i % 2 == 0 else reversed(order):
                    t0 = time.perf_counter()
                    fn()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if i:
                        times[name].append((time.perf_counter() - t0) * 1e3)
    finally:
        dm.destroy_parallel_state()
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(
        ours_ms=med["ours"],
        megatron_ms=med["megatron"],
        ratio=med["ours"] / med["megatron"],
        steps=len(times["ours"]),
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    if cfg.part == "node":  # formulas only: no process group, no tensors
        dtl_dist.print0(node_table(cfg))
        return
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    if cfg.part == "table":
        rows = run_table(cfg, info)
        if info.is_main:
            write_csv(rows, os.path.join(cfg.out_dir, "table.csv"))
        exact = all(
            r["params"] == r["params_formula"] and r["comm"] == r["comm_formula"] for r in rows
        )
        worst = max(abs(r["act_layer"] - r["act_formula"]) / r["act_formula"] for r in rows)
        dtl_dist.print0(
            f"summary: day19 table t = {', '.join(str(r['t']) for r in rows)} on "
            f"{info.world_size} ranks, {cfg.model}: params/rank and TP bytes/step "
            f"{'equal the formulas' if exact else 'DIFFER from the formulas'}; activations per "
            f"layer within {worst:.1%} of the term-by-term formula"
        )
    else:
        if info.world_size % 2:
            dtl_dist.exit_with_error("part=ratio needs an even number of ranks (tp = 2)")
        r = run_ratio(cfg, info)
        dtl_dist.print0(
            f"summary: day19 ratio tp=2 {cfg.model} layer: ours / megatron-core TransformerLayer "
            f"forward+backward = {r['ours_ms']:.1f} / {r['megatron_ms']:.1f} ms = "
            f"{r['ratio']:.2f} (target <= 1.2; medians of {r['steps']} interleaved steps)"
        )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
