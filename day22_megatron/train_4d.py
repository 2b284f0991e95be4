"""Day 22: our own 4-D stack (days 19-21's TP, SP, CP, day 20's PP, DP) on one ParallelGrid.

CPU (gloo), ~8 s at 4 ranks, ~13 s at 8:
    torchrun --standalone --nproc_per_node=4 -m day22_megatron.train_4d --tp=2 --pp=2
    torchrun --standalone --nproc_per_node=4 -m day22_megatron.train_4d --tp=2 --cp=2
    torchrun --standalone --nproc_per_node=4 -m day22_megatron.train_4d --pp=2 --chunks=2 \
        --num-layers=4  # dp 2: 4 virtual stages need 4 layers
    torchrun --standalone --nproc_per_node=8 -m day22_megatron.train_4d --tp=2 --pp=2  # dp 2
    torchrun --standalone --nproc_per_node=4 -m day22_megatron.train_4d --model=tiny-moe --ep=2 \
        --tp=2  # dp 2 (both expert-parallel): the fifth dimension
GPUs (NCCL):
    torchrun --standalone --nproc_per_node=gpu -m day22_megatron.train_4d --tp=2 --pp=2 \\
        --config day22_megatron/gpu_4d.toml

Environment: OMP_NUM_THREADS=1 (torchrun's default; ranks share 2 cores here).

The grid is ParallelGrid(dp, pp, cp, tp), TP innermost (Megatron's order, checked equal to
megatron-core's groups by dtl.megatron). stack.py composes apply_tp -> apply_sp -> apply_cp ->
apply_pp and averages gradients over dp x cp; the global batch is the same rows megatron-core's
run and the one-process reference see. Each step prints the loss, the global gradient norm and
the bytes this rank sent along each axis; then the per-rank state and bytes are printed beside
formulas.py and the bubble beside (p-1)/(v·m+p-1); at the end rank 0 trains the dense model in
one process and compares losses, gradient norms and parameters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from day21_sp_cp.cp import ATTENTION, CPError
from day22_megatron import formulas, layouts
from day22_megatron.distopt import DistributedOptimizer, padding_of
from day22_megatron.ep import EP_AXIS, data_rank, take_traffic
from day22_megatron.layouts import padded_preset
from day22_megatron.stack import (
    build_stack,
    check_stack,
    clip_gradients,
    forward_backward,
    full_state,
    grid_for,
    stack_modules,
    stack_state_bytes,
    sync_gradients,
)
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import profile as dtl_profile
from dtl.comm import CommCounter
from dtl.data import dp_micro_batches, load_corpus, tokenizer_for
from dtl.grid import ParallelGrid
from dtl.metrics import StepLogger, matches_formula
from dtl.model import PresetName, num_params
from dtl.optim import OptimConfig
from dtl.reference import Verdict, one_process_gpt, reference_verdict

MB = 1e6


@dataclass
class Config:
    tp: int = 1  # tensor-parallel size (Megatron's --tensor-model-parallel-size)
    pp: int = 1  # pipeline-parallel size (--pipeline-model-parallel-size); dp = world/(tp·cp·pp)
    cp: int = 1  # context-parallel size (--context-parallel-size); not with pp > 1 here
    ep: int = 1  # expert-parallel size (--expert-model-parallel-size): ep of the dp ranks hold
    # other experts and trade tokens by all-to-all; needs an MoE model (--model=tiny-moe)
    chunks: int = 1  # model chunks per pipeline rank: interleaved 1F1B when > 1 (Megatron's vpp)
    sp: bool = False  # sequence parallelism over the TP group (needs tp > 1; not with pp > 1)
    attn: str = "ring_zigzag"  # attention over cp: ring | ring_zigzag | ulysses
    model: PresetName = "tiny"  # GPT preset
    num_layers: int = 0  # 0: the preset's number of layers
    # pad the vocabulary to a multiple of this x tp, as Megatron does (GPT-2's 50,257 -> 50,304)
    make_vocab_size_divisible_by: int = layouts.VOCAB_MULTIPLE
    micro_batch_size: int = 1  # sequences per micro-batch (per DP rank)
    global_batch_size: int = 8  # sequences per step over all DP ranks
    seq_len: int = 32  # tokens per sequence
    steps: int = 4  # optimizer steps
    lr: float = 1e-3  # AdamW learning rate
    weight_decay: float = 0.1  # on matrices only (dtl.optim.optimizer_groups)
    clip_grad: float = 1.0  # global gradient-norm clip, 0 disables it
    eps: float = 1e-8  # AdamW epsilon
    seed: int = 0  # model init and batches
    check: bool = True  # rank 0 trains the dense model in one process and compares
    # ZeRO-1 as Megatron's --use-distributed-optimizer: Adam's m and v sliced over dp x cp
    distributed_optimizer: bool = False
    out_dir: str = ""  # empty: outputs/day22_megatron/ours-tp<t>-pp<p>[-vpp<v>][-cp<c>]-dp<d>

    @property
    def optim(self) -> OptimConfig:
        return OptimConfig(
            lr=self.lr, eps=self.eps, weight_decay=self.weight_decay, decay="matrices"
        )

    def model_config(self):
        return padded_preset(
            self.model, self.num_layers, self.make_vocab_size_divisible_by, self.tp
        )

    @property
    def layout(self) -> layouts.Layout:
        world = dtl_dist.launch_world_size()
        lay = layouts.Layout.from_world(world, tp=self.tp, pp=self.pp, cp=self.cp)
        return layouts.Layout(
            tp=lay.tp, pp=lay.pp, cp=lay.cp, dp=lay.dp, vpp=self.chunks, ep=self.ep
        )

    @property
    def microbatches(self) -> int:
        return self.layout.microbatches(self.global_batch_size, self.micro_batch_size)

    def validate(self) -> None:
        err = dtl_config.ConfigError
        if self.chunks > 1 and self.pp < 2:
            raise err(f"--chunks={self.chunks} needs --pp >= 2 (interleaving splits a pipeline)")
        try:
            lay = self.layout
            layouts.check(
                lay,
                self.model_config(),
                micro_batch_size=self.micro_batch_size,
                global_batch_size=self.global_batch_size,
                seq_length=self.seq_len,
                sequence_parallel=self.sp,
            )
            check_stack(self.model_config(), tp=lay.tp, pp=lay.pp, cp=lay.cp,
                        seq_len=self.seq_len, attn=self.attn, sp=self.sp)  # fmt: skip
        except (layouts.LayoutError, CPError) as e:
            raise err(str(e)) from None
        if self.distributed_optimizer and self.model_config().moe is not None:
            raise err("--distributed_optimizer runs on dense models here (no experts)")
        self.out_dir = self.out_dir or f"outputs/day22_megatron/ours-{lay.name(self.sp)}"


def micro_batches(tokens, cfg: Config, step: int, grid: ParallelGrid, device):
    """This data rank's rows of the step's global batch (dp x ep ranks see other rows), in
    micro-batches of micro_batch_size."""
    rank, size = data_rank(grid)
    return dp_micro_batches(
        tokens, cfg.seq_len, cfg.global_batch_size // size, cfg.micro_batch_size,
        step=step, seed=cfg.seed, dp_rank=rank, dp_size=size, device=device,
    )  # fmt: skip


def axis_groups(stack) -> dict[str, list]:
    """The process groups each axis's traffic travels on (what CommCounter attributes it by)."""
    grid = stack.grid
    pp = [grid.embedding_group]
    if stack.pipeline is not None:
        runner = stack.pipeline.runner
        pp += list(runner.lane_groups.values())  # its p2p lanes (day20 pipeline.py)
    return {
        "tp": [grid.tp_group],
        "cp": [grid.cp_group],
        "ep": [grid.group(EP_AXIS)] if EP_AXIS in grid.axes else [],
        "pp": pp,
        # the DP average and the clip's global norm: the groups the reduction table names
        "dp": [grid.group(*axes) for axes in stack.reduction.average_axes],
        "norm": [grid.group(*stack.reduction.norm_axes)]
        + ([dist.group.WORLD] if isinstance(stack.optimizer, DistributedOptimizer) else []),
    }


def run(cfg: Config, info, grid: ParallelGrid) -> dict:
    mcfg = cfg.model_config()
    corpus = load_corpus(tokenizer=tokenizer_for(mcfg.vocab_size))
    stack = build_stack(
        mcfg, grid, micro_batch_size=cfg.micro_batch_size, microbatches=cfg.microbatches,
        seq_len=cfg.seq_len, schedule="interleaved" if cfg.chunks > 1 else "1f1b",
        chunks=cfg.chunks, attn=cfg.attn, sp=cfg.sp, seed=cfg.seed, optim=cfg.optim,
        device=info.device, distributed_optimizer=cfg.distributed_optimizer,
    )  # fmt: skip
    groups = axis_groups(stack)
    log = StepLogger(cfg.out_dir, cfg.steps, tokens_per_step=cfg.global_batch_size * cfg.seq_len)
    holders = info.world_size // grid.pp_size  # the last stage's ranks hold the loss
    losses, norms, times, idle, sent, state = [], [], [], [], {}, {}
    for step in range(cfg.steps):
        mbs = micro_batches(corpus.train, cfg, step, grid, info.device)
        dist.barrier()  # every rank starts together: pipeline idle time is the schedule's
        t0 = time.perf_counter()
        with dtl_profile.range(dtl_profile.STEP):  # named ranges: see dtl.profile
            with CommCounter() as comm:
                loss = forward_backward(stack, mbs)
                t_fb = time.perf_counter() - t0
                sync_gradients(stack)
                norms.append(clip_gradients(stack, cfg.clip_grad or None))
                with dtl_profile.range(dtl_profile.OPTIMIZER):
                    stack.optimizer.step()  # ZeRO-1: the weights all-gathered in here
        state = stack_state_bytes(stack)
        stack.optimizer.zero_grad(set_to_none=True)
        dtl_dist.synchronize(info.device)
        times.append(time.perf_counter() - t0)
        if stack.pipeline is not None:
            idle.append(1 - sum(e - s for s, e, _ in stack.record.spans) / t_fb)
        sent = {axis: comm.ring_bytes_on(*gs) for axis, gs in groups.items()}
        traffic = take_traffic(stack_modules(stack))  # the rows this step's all-to-alls moved
        a2a = comm.bytes["all_to_all"]
        # every call of the step, on any group: a collective outside the four axes (one on the
        # world group, say) shows here and nowhere else
        sent["total"] = sum(comm.group_ring_bytes.values())
        losses.append(dtl_dist.all_reduce_scalar(loss or 0.0) / holders)
        log.log(
            step,
            loss=losses[-1],
            grad_norm=norms[-1],
            dt_s=times[-1],
            **{f"{a}_mb": f"{b / MB:.3f}" for a, b in sent.items() if b and a != "total"},
        )
    log.close()
    return dict(
        stack=stack, losses=losses, norms=norms, times=times, idle=idle, sent=sent,
        state=state, corpus=corpus, full=full_state(stack), device=info.device,
        traffic=traffic, all_to_all=a2a, padding=padding_of(stack.optimizer),
    )  # fmt: skip


def measured_vs_formula(cfg: Config, grid: ParallelGrid, result: dict) -> tuple[list[str], bool]:
    """Lines for rank 0's figures, and whether every rank's equal their formulas exactly."""
    lay, mcfg = cfg.layout, cfg.model_config()
    zero1 = cfg.distributed_optimizer
    pad = result["padding"]  # ZeRO-1's flats padded to multiples of dp x cp (0 without)
    want_state = formulas.state_bytes(mcfg, lay, grid.pp_rank, zero1, pad)
    want_comm = formulas.comm_bytes(
        mcfg, lay, grid.pp_rank, micro_batch_size=cfg.micro_batch_size,
        microbatches=cfg.microbatches, seq_len=cfg.seq_len, sp=cfg.sp,
        distributed_optimizer=zero1, padding=pad,
    )  # fmt: skip
    t = result["traffic"]  # the rows the routing sent and received, per the dispatchers
    data = formulas.ep_bytes(mcfg, t.rows_sent, t.rows_received, t.calls) if lay.ep > 1 else 0
    if lay.ep > 1:  # ring-equivalent, as CommCounter reports every axis
        want_comm["ep"] = data * (lay.ep - 1) / lay.ep
    want_comm["total"] = sum(want_comm.values())  # the axes' sum: nothing sent outside them
    got = {**result["state"], **result["sent"]}
    want = {**want_state, **want_comm}
    exact = {k: matches_formula(got[k], want[k]) for k in want}
    lines = [
        f"  {k:<7}{got[k] / MB:>12.3f}{want[k] / MB:>12.3f}  {'exact' if exact[k] else 'MISMATCH'}"
        for k in want
    ]
    if zero1:  # the padding the formulas were given
        lines.append(
            f"  ZeRO-1: Adam's m and v sliced over d = {lay.dp * lay.cp} ranks; the flat "
            f"buffers padded by {pad} elements"
        )
    if lay.ep > 1:  # the all-to-alls' data (S of every call), against the rows' formula
        exact["all-to-all"] = matches_formula(result["all_to_all"], data)
        lines.append(
            f"  all-to-all data, last step: {t.calls} layer forwards sent {t.rows_sent} and "
            f"received {t.rows_received} rows of {mcfg.n_embd}: 2 (sent + received) C e + "
            f"{t.calls} x E counts = {data:,.0f} B, counted {result['all_to_all']:,.0f} B"
        )
    bad = torch.tensor([float(not all(exact.values()))], device=result["device"])
    dist.all_reduce(bad)
    return lines, bad.item() == 0


def report(cfg: Config, info, grid: ParallelGrid, result: dict) -> bool:
    lay = cfg.layout
    lines, exact = measured_vs_formula(cfg, grid, result)
    dtl_dist.print0(
        "rank 0, per step (MB; state in bytes held, traffic = ring bytes sent per axis):\n"
        f"  {'what':<7}{'measured':>12}{'formula':>12}\n" + "\n".join(lines)
    )
    bubble = ""
    if lay.pp > 1:
        steady = result["idle"][1:] or result["idle"]
        idle = dtl_dist.all_reduce_scalar(sum(steady) / len(steady), average=True)
        want = formulas.bubble(lay, cfg.microbatches)
        bubble = f"; pipeline idle {idle:.3f} measured vs bubble formula {want:.3f}"
        dtl_dist.print0(
            f"bubble: (p-1)/(v·m+p-1) = {want:.3f} for p={lay.pp}, v={lay.vpp}, "
            f"m={cfg.microbatches}; measured idle {idle:.3f} (mean over ranks, host clock, real "
            "stage costs: the last stage also runs the head and the loss)"
        )
    verdict, norm_gap = _compare(cfg, info, grid, result)
    ok = verdict.ok and exact
    med = sorted(result["times"])[len(result["times"]) // 2] * 1e3
    dtl_dist.print0(
        f"summary: day22 ours {lay.name(cfg.sp)} model={cfg.model} schedule={lay.schedule}: "
        f"{verdict}"
    )
    dtl_dist.print0(
        f"summary: grad norms vs one process: max rel diff {norm_gap:.1e}; state and bytes per "
        f"axis = formula {'yes' if exact else 'NO'} (all ranks){bubble}; median step {med:.0f} ms"
    )
    return ok


def _compare(cfg: Config, info, grid: ParallelGrid, result: dict) -> tuple[Verdict, float]:
    if not cfg.check:
        return Verdict.skip("one-process check skipped (check=false)"), float("nan")
    ref_norms: list[float] = []

    def one_process():
        mcfg = cfg.model_config()  # an MoE's aux loss is per forward: one per rank's micro-batch
        slices = cfg.layout.dp * cfg.microbatches if mcfg.moe else 1
        losses, gpt = one_process_gpt(
            mcfg, result["corpus"].train, seq_len=cfg.seq_len,
            rows=cfg.global_batch_size, steps=cfg.steps, seed=cfg.seed, lr=cfg.lr,
            weight_decay=cfg.weight_decay, eps=cfg.eps, clip_grad=cfg.clip_grad or None,
            grad_norms=ref_norms, slices=slices,
        )  # fmt: skip
        return losses, dict(gpt.named_parameters(remove_duplicate=False)), ref_norms  # lm_head

    # judged: losses, parameters, and the norms before clipping (clipping at 1.0 and Adam's
    # scale invariance would hide a gradient off by a constant factor from the other two)
    verdict = reference_verdict(
        result["losses"], result["full"], one_process, steps=cfg.steps, device=info.device,
        grad_norms=result["norms"],
    )  # fmt: skip
    return verdict, verdict.norm_rel


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    info = dtl_dist.init()
    lay = cfg.layout
    grid = grid_for(lay)
    dtl_config.save(cfg, cfg.out_dir, argv)
    split = f"; {ATTENTION[cfg.attn]} split" if lay.cp > 1 else ""
    dtl_dist.print0(
        f"grid: {grid}{split}; {cfg.microbatches} micro-batches of {cfg.micro_batch_size} per "
        f"DP rank, schedule {lay.schedule}"
    )
    mcfg = cfg.model_config()
    if mcfg.moe is not None:  # what an MoE holds against what one token uses
        dtl_dist.print0(
            f"model: {cfg.model}, {num_params(mcfg):,} parameters, "
            f"{num_params(mcfg, active=True):,} active per token ({mcfg.moe.top_k} of "
            f"{mcfg.moe.n_expert} experts per layer, {grid.sizes.get(EP_AXIS, 1)} ep ranks)"
        )
    result = run(cfg, info, grid)
    dtl_dist.finish(report(cfg, info, grid, result))  # cleanup; exit 1 if a check failed


if __name__ == "__main__":
    main()
