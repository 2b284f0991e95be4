"""Day 20: train the shared GPT with a pipeline schedule (and data parallelism beside it).

CPU (gloo), ~10-20 s:
    torchrun --standalone --nproc_per_node=2 -m day20_pp.train --schedule=1f1b --pp=2
    torchrun --standalone --nproc_per_node=2 -m day20_pp.train --schedule=interleaved --chunks=2
    torchrun --standalone --nproc_per_node=4 -m day20_pp.train --schedule=zb --pp=4
    torchrun --standalone --nproc_per_node=2 -m day20_pp.train --schedule=dualpipev --pp=2
    torchrun --standalone --nproc_per_node=4 -m day20_pp.train --pp=2          # PP 2 x DP 2
GPUs (NCCL): torchrun --standalone --nproc_per_node=gpu -m day20_pp.train --pp=2 \
                 --config day20_pp/gpu.toml

Environment: OMP_NUM_THREADS=1 (torchrun's default; ranks share 2 cores here).

The grid is ParallelGrid(pp, dp = world / pp). Each step runs this rank's action list from
schedules.py through pipeline.PipelineRunner, then averages gradients over the DP group and
steps AdamW. It prints the loss, the step time, the measured idle fraction beside the formula's
bubble and the peak number of micro-batches holding activations; at the end it draws the ideal
and the measured timeline (timeline.png) and compares with one process on the global batch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from day20_pp import schedules, timeline
from day20_pp.pipeline import (
    PipelineError,
    PipelineRunner,
    build_stages,
    check_pipeline,
    stage_parameters,
    unique_parameters,
)
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import profile as dtl_profile
from dtl.data import dp_micro_batches, load_corpus, tokenizer_for
from dtl.grid import ParallelGrid
from dtl.metrics import StepLogger
from dtl.model import PresetName, preset
from dtl.reference import Verdict, one_process_gpt, reference_verdict


@dataclass
class Config:
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb | dualpipev
    pp: int = 2  # pipeline stages (ranks per pipeline; Megatron's pipeline_model_parallel_size)
    chunks: int = 1  # model chunks per rank (interleaved: Megatron's virtual pipeline size)
    microbatches: int = 8  # micro-batches per step (m)
    micro_batch_size: int = 2  # sequences per micro-batch
    model: PresetName = "small"  # GPT preset (`small` has 4 layers: pp x chunks must divide it)
    seq_len: int = 64  # tokens per sequence
    steps: int = 4  # optimizer steps
    lr: float = 1e-3  # AdamW learning rate
    check: bool = True  # rank 0 trains one process on the global batch and compares
    seed: int = 0  # model init and batches
    out_dir: str = ""  # where the run writes; empty: outputs/day20_pp/<schedule>-pp<pp>-dp<dp>

    def validate(self) -> None:
        if self.pp < 1 or self.chunks < 1:
            raise dtl_config.ConfigError(
                f"pp and chunks must be >= 1, got {self.pp}, {self.chunks}"
            )
        world = dtl_dist.launch_world_size()
        dp = world // self.pp if world % self.pp == 0 else 0
        self.out_dir = self.out_dir or f"outputs/day20_pp/{self.schedule}-pp{self.pp}-dp{dp}"
        err = dtl_config.ConfigError
        if world % self.pp:
            raise err(f"pp {self.pp} does not divide the world size {world}")
        try:
            plan = schedules.make(self.schedule, self.pp, self.microbatches, self.chunks)
            check_pipeline(preset(self.model), plan.placement.p, plan.placement.v)
        except (schedules.ScheduleError, PipelineError) as e:
            raise err(str(e)) from None
        if self.seq_len > preset(self.model).block_size:
            raise err(f"seq_len {self.seq_len} exceeds {self.model}'s block_size")


def micro_batches(tokens, cfg: Config, step: int, grid: ParallelGrid, device):
    rows = cfg.micro_batch_size * cfg.microbatches
    return dp_micro_batches(
        tokens,
        cfg.seq_len,
        rows,
        cfg.micro_batch_size,
        step=step,
        seed=cfg.seed,
        dp_rank=grid.dp_rank,
        dp_size=grid.dp_size,
        device=device,
    )


def run(cfg: Config, info, grid: ParallelGrid) -> dict:
    mcfg = preset(cfg.model)
    corpus = load_corpus(tokenizer=tokenizer_for(mcfg.vocab_size))
    # the schedule first: its placement says which stages this rank holds and who holds the ends
    actions = schedules.make(cfg.schedule, grid.pp_size, cfg.microbatches, cfg.chunks)
    place = actions.placement
    stages = [s.to(info.device) for s in build_stages(mcfg, grid, place, cfg.seed)]
    params = unique_parameters(stages)
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    shape = (cfg.micro_batch_size, cfg.seq_len)
    runner = PipelineRunner(stages, grid, mcfg, shape, placement=place)
    log = StepLogger(
        cfg.out_dir,
        cfg.steps,
        tokens_per_step=cfg.micro_batch_size * cfg.microbatches * cfg.seq_len * grid.dp_size,
    )
    losses, idle, idle_by_step, peaks, record = [], [], [], [], None
    for step in range(cfg.steps):
        batches = micro_batches(corpus.train, cfg, step, grid, info.device)
        dist.barrier()  # every rank starts the step together: idle time is the schedule's
        t0 = time.perf_counter()
        with dtl_profile.range(dtl_profile.STEP):  # the actions inside: F0, B0, ... (named)
            loss, record = runner.step(actions[grid.pp_rank], batches)
            dt = time.perf_counter() - t0
            # DP beside the pipeline: every stage's gradients averaged over its DP group
            dtl_dist.average_gradients(params, grid.dp_group)
            with dtl_profile.range(dtl_profile.OPTIMIZER):
                opt.step()
        opt.zero_grad(set_to_none=True)
        # the loss lives on each replica's last stage (0.0 elsewhere): sum, then mean over DP
        losses.append(dtl_dist.all_reduce_scalar(loss or 0.0) / grid.dp_size)
        idle.append(1 - sum(e - s for s, e, _ in record.spans) / dt)
        idle_by_step.append(dtl_dist.all_reduce_scalar(idle[-1], average=True))
        peaks.append(record.peak_in_flight)
        log.log(
            step,
            loss=losses[-1],
            dt_s=dt,
            idle=f"{idle_by_step[-1]:.0%}",
            in_flight=record.peak_in_flight,
        )
    log.close()
    return dict(
        stages=stages,
        losses=losses,
        idle=idle,
        idle_by_step=idle_by_step,  # mean over ranks, step by step (day 27 reads one of them)
        peak=max(peaks),
        record=record,
        corpus=corpus,
        actions=actions,
    )


def report(cfg: Config, info, grid: ParallelGrid, result: dict) -> bool:
    p, m = grid.pp_size, cfg.microbatches
    ideal = schedules.simulate(result["actions"])  # on the schedule's own placement
    formula = schedules.bubble_formula(cfg.schedule, p, m, cfg.chunks)
    v = result["actions"].placement.v  # stages per rank: DualPipe-V's V holds two
    mean_idle = sum(result["idle"][1:]) / max(1, len(result["idle"]) - 1)
    measured_idle = dtl_dist.all_reduce_scalar(mean_idle, average=True)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, result["peak"])
    mine = grid.ranks_along("pp")  # this rank's pipeline, stage by stage
    peaks = [peaks[r] for r in mine]
    dtl_dist.print0(
        f"bubble: formula {formula:.3f}; from the action lists (unit costs) {ideal.bubble:.3f}; "
        f"measured idle {measured_idle:.3f} (mean over ranks and steps after the first; host "
        "clock, real stage costs, not the formula's F/B ratio)"
    )
    by_step = " ".join(f"{x:.4f}" for x in result["idle_by_step"])
    dtl_dist.print0(f"idle by step (mean over ranks): {by_step}")
    dtl_dist.print0(
        f"peak micro-batches holding activations per rank: measured {peaks[:p]}, from the "
        f"lists {ideal.peak_in_flight()}"
    )
    spans = [None] * dist.get_world_size()
    dist.all_gather_object(spans, result["record"].spans)
    if info.is_main:
        path = os.path.join(cfg.out_dir, "timeline.png")
        timeline.save_pair(
            ideal.spans,
            [spans[r] for r in mine],
            f"{cfg.schedule}, p={p}, m={m}, v={v}: ideal (from the action lists), bubble "
            f"{ideal.bubble:.1%} (formula {formula:.1%})",
            f"measured, last step: idle {measured_idle:.1%}",
            path,
        )
        print(f"timeline: {path}", flush=True)
    verdict = _compare(cfg, info, grid, result)
    dtl_dist.print0(
        f"summary: day20 schedule={cfg.schedule} pp={p} dp={grid.dp_size} m={m} v={v}: "
        f"{verdict}; bubble formula {formula:.3f} = lists {ideal.bubble:.3f}; peak in flight "
        f"{max(peaks)} (lists {max(ideal.peak_in_flight())})"
    )
    return verdict.ok and peaks == ideal.peak_in_flight()


def _compare(cfg: Config, info, grid: ParallelGrid, result) -> Verdict:
    if not cfg.check:
        return Verdict.skip("one-process check skipped (check=false)")
    mine = {n: p.detach().cpu() for n, p in stage_parameters(result["stages"]).items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    full = {name: t for part in gathered for name, t in part.items()}

    def one_process():  # rank 0: the whole GPT on the global batch (lm_head: the tied weight)
        losses, dense = one_process_gpt(
            preset(cfg.model),
            result["corpus"].train,
            seq_len=cfg.seq_len,
            rows=cfg.micro_batch_size * cfg.microbatches * grid.dp_size,
            steps=cfg.steps,
            seed=cfg.seed,
            lr=cfg.lr,
        )
        return losses, {
            n: p for n, p in dense.named_parameters(remove_duplicate=False) if n in full
        }

    return reference_verdict(
        result["losses"], full, one_process, steps=cfg.steps, device=info.device
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    info = dtl_dist.init()
    grid = ParallelGrid(pp=cfg.pp, dp=info.world_size // cfg.pp)
    dtl_config.save(cfg, cfg.out_dir, argv)
    dtl_dist.print0(f"grid: {grid}")
    result = run(cfg, info, grid)
    dtl_dist.finish(report(cfg, info, grid, result))  # cleanup; exit 1 if a check failed


if __name__ == "__main__":
    main()
