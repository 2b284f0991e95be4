"""Day 17: train the shared GPT with a chosen gradient sync and see where each step's time goes.

CPU (gloo), 2 processes, ~20 s each:
    torchrun --standalone --nproc_per_node=2 -m day17_ddp.train --sync=bucket
    torchrun --standalone --nproc_per_node=2 -m day17_ddp.train --sync=ddp
    ... --sync=naive | --sync=overlap | --grad_accum=4 | --bucket_cap_mb=5 --first_bucket_mb=5
GPUs (NCCL, one process per GPU):
    torchrun --standalone --nproc_per_node=gpu -m day17_ddp.train --sync=bucket \
        --config day17_ddp/gpu.toml

Environment: OMP_NUM_THREADS=1 (torchrun sets it when unset; 2 ranks on 2 cores need it),
TORCH_DISTRIBUTED_DEBUG=DETAIL (DDP names parameters that got no gradient).

Per step it prints the time in forward, in backward compute and blocked on communication, and the
overlap achieved (definitions in observe.py); then the bucket layout (torch DDP's read from its
logging data after the rebuild), a profiler trace per rank (traces/rank<R>.json) and timeline.png.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from day17_ddp import bridge, observe
from day17_ddp.ddp_manual import SyncError, check_sync_args, wrap
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import profile as dtl_profile
from dtl.comm import BUSBW_FACTOR
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.metrics import StepLogger
from dtl.model import GPT, PresetName, loss_fn, preset
from dtl.profile import StepTimes, overlap_fraction, quiet_native_stderr
from dtl.reference import replica_gap


@dataclass
class Config:
    sync: str = "bucket"  # naive | overlap | bucket | ddp
    # GPT preset; `small` has the 50,304-token vocabulary (25 MiB wte grad)
    model: PresetName = "small"
    tie_weights: bool = True  # lm_head shares wte; False gives lm_head its own 25 MiB gradient
    batch_size: int = 4  # sequences per rank per micro-step
    seq_len: int = 64  # tokens per sequence: 4 x 64 = 256 tokens per rank per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step; all but the last under no_sync()
    steps: int = 8  # optimizer steps
    warmup: int = 2  # steps left out of the medians (step 0 builds, step 1 uses rebuilt buckets)
    lr: float = 6e-4  # AdamW learning rate
    bucket_cap_mb: float = 25.0  # bucket size limit in MiB (DDP's default: 25)
    first_bucket_mb: float = 1.0  # first bucket's limit in MiB (DDP: 1, or the cap if you set it)
    find_unused_parameters: bool = False  # ddp only: traverse the graph after every forward
    gradient_as_bucket_view: bool = False  # ddp only: .grad becomes a view into the bucket
    static_graph: bool = False  # ddp only: the graph is the same every step (skips checks)
    profile_step: int = 4  # the first of the two steps traced by torch.profiler; -1 for none
    cost_model: str = bridge.DAY16_FIT  # day 16's alpha-beta fit: predicts each bucket's time
    seed: int = 0  # model init and batches
    out_dir: str = ""  # where the run writes; empty: outputs/day17_ddp/train-<sync>

    def validate(self) -> None:
        self.out_dir = self.out_dir or f"outputs/day17_ddp/train-{self.sync}"
        try:
            check_sync_args(self.sync, self.bucket_cap_mb, self.first_bucket_mb)
        except SyncError as e:
            raise dtl_config.ConfigError(str(e)) from None
        timed = sum(1 for s in range(self.warmup, self.steps) if s not in self.profiled_steps())
        if min(self.batch_size, self.seq_len, self.grad_accum) < 1 or timed < 1:
            raise dtl_config.ConfigError(
                "need batch_size, seq_len, grad_accum >= 1 and one timed "
                "step after warmup that is not one of the two profiled steps"
            )
        if self.cost_model != bridge.DAY16_FIT and not os.path.isfile(self.cost_model):
            raise dtl_config.ConfigError(f"cost_model file not found: {self.cost_model}")
        if self.seq_len > preset(self.model).block_size:
            raise dtl_config.ConfigError(
                f"seq_len {self.seq_len} exceeds the {self.model} "
                f"block_size {preset(self.model).block_size}"
            )

    def profiled_steps(self) -> tuple[int, ...]:
        """Two steps: the first pays the profiler's start-up, the timeline draws the second."""
        if self.profile_step < 0:
            return ()
        return tuple(s for s in (self.profile_step, self.profile_step + 1) if s < self.steps)


def build(cfg: Config, info):
    gpt = GPT(preset(cfg.model, tie_weights=cfg.tie_weights), seed=cfg.seed).to(info.device)
    ddp_kwargs = {}
    if cfg.sync == "ddp":
        ddp_kwargs = dict(
            find_unused_parameters=cfg.find_unused_parameters,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            static_graph=cfg.static_graph,
        )
    model = wrap(
        gpt,
        cfg.sync,
        bucket_cap_mb=cfg.bucket_cap_mb,
        first_bucket_mb=cfg.first_bucket_mb,
        **ddp_kwargs,
    )
    return gpt, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)


def train_step(model, opt, tokens, cfg: Config, step: int, info) -> tuple[StepTimes, float]:
    """One optimizer step; returns its timings and loss. Micro-steps but the last skip the sync.

    The clocks are host-side (time.perf_counter), the same clock the sync wrappers stamp their
    all-reduces with; on CUDA they time launches, so read GPU overlap from the trace instead.
    """
    x, y = get_batch(
        tokens,
        cfg.seq_len,
        cfg.batch_size * cfg.grad_accum,
        seed=cfg.seed,
        step=step,
        dp_rank=info.rank,
        dp_size=info.world_size,
    )
    x, y = x.to(info.device), y.to(info.device)  # (grad_accum * B, T) rows for this rank
    t_step = time.perf_counter()
    # named ranges (dtl.profile): record_function in a torch.profiler trace, NVTX on a GPU
    with dtl_profile.range(observe.STEP_MARK):  # the timeline finds its step by this mark
        fwd = bwd = 0.0
        for m in range(cfg.grad_accum):
            # the flag must hold during forward: DDP arms the backward sync there (see the notes)
            model.require_backward_grad_sync = m == cfg.grad_accum - 1
            rows = slice(m * cfg.batch_size, (m + 1) * cfg.batch_size)
            t0 = time.perf_counter()
            with dtl_profile.range(dtl_profile.FORWARD):
                loss = loss_fn(model(x[rows]), y[rows])
            t1 = time.perf_counter()
            with dtl_profile.range(dtl_profile.BACKWARD):
                (loss / cfg.grad_accum).backward()  # the last one all-reduces, inside backward
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
        with dtl_profile.range(observe.OPT_MARK):
            opt.step()
        opt.zero_grad(set_to_none=True)
    dtl_dist.synchronize(info.device)
    return observe.step_breakdown(model, fwd, bwd, time.perf_counter() - t_step), loss.item()


def run(cfg: Config, info) -> dict:
    # the GPT-2 BPE for the 50k-vocabulary presets, bytes for `tiny` (vocabulary 256)
    corpus = load_corpus(tokenizer=tokenizer_for(preset(cfg.model).vocab_size))
    gpt, model, opt = build(cfg, info)
    log = StepLogger(
        cfg.out_dir,
        cfg.steps,
        tokens_per_step=cfg.batch_size * cfg.seq_len * cfg.grad_accum * info.world_size,
        tensorboard=True,
    )
    rows: list[StepTimes] = []
    reduces: list = []  # per timed step: (bytes, launch, duration) of each all-reduce
    traced, prof = cfg.profiled_steps(), None  # profiler overhead: left out of the medians
    for step in range(cfg.steps):
        if traced and step == traced[0]:
            prof = start_profiler(info)
        times, loss = train_step(model, opt, corpus.train, cfg, step, info)
        if prof is not None and step == traced[-1]:
            stop_profiler(prof, cfg, info)
            prof = None
        if step >= cfg.warmup and step not in traced:
            rows.append(times)
            if (events := bridge.all_reduces(model)) is not None:
                reduces.append(events)
        log.log(step, loss=loss, times=times)  # the breakdown also goes to TensorBoard time/...
    log.close()
    if info.device.type == "cuda":
        dtl_dist.print0(
            "note: on CUDA the fwd/bwd/blocked/overlap columns and the bridge's measured "
            "all-reduce times are host-side (CPU launch) times; the timeline's backward compute "
            "and all-reduce lanes are GPU kernels (traces/rank<R>.json): read GPU overlap there"
        )
    names = _param_names(gpt)
    name, big = max(gpt.named_parameters(), key=lambda kv: kv[1].numel())
    dtl_dist.print0(
        f"largest gradient: {name} {tuple(big.shape)} x 4 bytes = "
        f"{big.numel() * 4:,} B = {big.numel() * 4 / 2**20:.2f} MiB"
    )
    return dict(
        rows=rows,
        reduces=reduces,
        layout=observe.bucket_layout(model, names),
        gap=replica_gap(gpt),  # max |p - p on rank 0|: 0.0 when the replicas are identical
        n_params=sum(p.numel() for p in gpt.parameters()),
    )


def _param_names(gpt) -> list[str]:
    return [n for n, p in gpt.named_parameters() if p.requires_grad]  # tied lm_head: once, as wte


def start_profiler(info):
    """torch.profiler around the profiled steps; rank R will write traces/rank<R>.json."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    prof = profile(activities=acts)
    with quiet_native_stderr():  # kineto's start/stop lines would split the step log
        prof.start()
    return prof


def stop_profiler(prof, cfg: Config, info) -> None:
    with quiet_native_stderr():
        prof.stop()
    os.makedirs(os.path.join(cfg.out_dir, "traces"), exist_ok=True)
    prof.export_chrome_trace(trace_path(cfg, info.rank))


def trace_path(cfg: Config, rank: int) -> str:
    return os.path.join(cfg.out_dir, "traces", f"rank{rank}.json")


def report(cfg: Config, info, result: dict) -> None:
    """Medians after warmup, the layout, the formulas beside the measurements, the timeline."""
    med = StepTimes.median(result["rows"])
    sizes, groups = result["layout"]
    n, S = info.world_size, sum(sizes)
    dtl_dist.print0(f"bucket layout ({cfg.sync}): " + observe.format_layout(sizes, groups))
    dtl_dist.print0(
        f"all-reduced per step S = {S:,} bytes = 4 bytes x {result['n_params']:,} "
        f"params"
        f" ({'ok' if S == 4 * result['n_params'] else 'MISMATCH'}); ring traffic per "
        f"rank 2(n-1)/n x S = {BUSBW_FACTOR['all_reduce'](n) * S / 1e6:.1f} MB at n={n}"
    )
    dtl_dist.print0(
        f"step = fwd + bwd compute + blocked + (optimizer + rest): {med.step_ms:.0f} ms = "
        f"{med.forward_ms:.0f} + {med.backward_ms:.0f} + {med.blocked_ms:.0f}"
        f" + {med.remainder_ms:.0f} ms (medians of {len(result['rows'])} steps; the last term "
        "is the remainder of the step, not a timed optimizer)"
    )
    # one quantity, computed from the medians it is printed with (a median of the per-step
    # ratios need not equal the ratio of the medians beside it)
    overlap = overlap_fraction(med.comm_ms, med.blocked_ms)
    dtl_dist.print0(
        f"window overlap = (comm span - blocked) / comm span = ({med.comm_ms:.0f}"
        f" - {med.blocked_ms:.0f}) / {med.comm_ms:.0f} = {overlap:.0%} (of the medians)"
    )
    for line in bridge_lines(cfg, info, result, sizes, med):
        dtl_dist.print0(line)
    traced = ""
    if info.is_main and cfg.profiled_steps():
        hidden = timeline(cfg, sizes, info.device)
        traced = f", {hidden:.0%} of all-reduce busy time under compute (trace)"
    dtl_dist.print0(
        f"summary: day17 sync={cfg.sync} model={cfg.model} ranks={n}: replicas identical "
        f"{'yes' if result['gap'] == 0 else 'NO'} (max diff {result['gap']:.1e}); step "
        f"{med.step_ms:.0f} ms = fwd {med.forward_ms:.0f} + bwd {med.backward_ms:.0f} + "
        f"blocked {med.blocked_ms:.0f} ms; window overlap {overlap:.0%}{traced}; "
        f"{len(sizes)} buckets"
    )


def bridge_lines(cfg: Config, info, result: dict, sizes: list[int], med: StepTimes):
    """Day 16's model of these all-reduces beside what this run measured."""
    fit = bridge.load_fit(cfg.cost_model)
    if fit is None:
        return [bridge.missing_line(cfg.cost_model)]
    if result["reduces"]:
        return bridge.report_lines(fit, cfg.cost_model, info.world_size, result["reduces"],
                                   med.blocked_ms)  # fmt: skip
    predicted = ", ".join(
        f"{b / bridge.MiB:.2f} MiB {bridge.predict_s(fit, b, info.world_size) * 1e3:.1f} ms"
        for b in sizes
    )
    return [
        f"alpha-beta bridge from day 16's fit ({cfg.cost_model}): buckets predicted {predicted}; "
        f"torch DDP does not expose per-bucket times (its Reducer logs one comm span: "
        f"{med.comm_ms:.0f} ms, median)"
    ]


def timeline(cfg: Config, sizes: list[int], device) -> float:
    lanes = observe.trace_spans(trace_path(cfg, 0))
    busy, hidden = observe.trace_overlap(lanes)
    path = os.path.join(cfg.out_dir, "timeline.png")
    step = cfg.profiled_steps()[-1]
    title = (
        f"day 17, sync={cfg.sync}, step {step}: all-reduce busy {busy:.0f} ms, "
        f"{hidden:.0%} of it during backward compute"
        + (" (GPU kernels)" if device.type == "cuda" else "")
    )
    observe.plot_timeline(lanes, title, path, sizes)
    print(f"trace: {title} -> {path}", flush=True)
    return hidden


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    result = run(cfg, info)
    report(cfg, info, result)
    failed = result["gap"] != 0
    dtl_dist.finish(not failed)


if __name__ == "__main__":
    main()
