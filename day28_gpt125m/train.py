"""Day 28: a ~125M GPT (GPT-2 124M, GPT-3 Small 125M) trained with any strategy of the course.

CPU (gloo), the `tiny` model, ~5-10 s:
    torchrun --standalone --nproc_per_node=2 -m day28_gpt125m.train --strategy=fsdp2
    torchrun --standalone --nproc_per_node=2 -m day28_gpt125m.train --strategy=zero3
    torchrun --standalone --nproc_per_node=4 -m day28_gpt125m.train --strategy=tp_pp --tp=2 --pp=2
    torchrun --standalone --nproc_per_node=4 -m day28_gpt125m.train --strategy=megatron \
        --tp=2 --pp=2
    torchrun --standalone --nproc_per_node=4 -m day28_gpt125m.train --strategy=ep \
        --model=tiny-moe --tp=2 --ep=2
GPUs (NCCL), GPT-2 124M, bf16, 0.5M tokens per step (the launch/ scripts for 2 and 8 GPUs, two
nodes, Slurm and the deepspeed launcher):
    torchrun --standalone --nproc_per_node=gpu -m day28_gpt125m.train \
        --config day28_gpt125m/gpu.toml

Environment: OMP_NUM_THREADS=1 on a CPU; DS_ACCELERATOR=cpu for zero3 on a CPU.

The recipe (recipe.py): AdamW (0.9, 0.95), weight decay 0.1 on matrices, warm-up + cosine,
clipping at 1.0, bf16 autocast on GPUs, gradient accumulation up to the global batch. The data
(data.py): the corpus tokenized once into memory-mapped shards under data_dir, read by
DataLoader workers a few steps ahead; a batch is a pure function of (seed, step, dp rank), so
every strategy sees the rows the one-process reference sees, and a resumed run starts at its
step. Each step line has the loss, lr, gradient norm, tokens/s and MFU (day 27's 6N + 12LHQT
against the device's dense bf16 peak; n/a on a CPU) and the time spent waiting for data; the
same go to TensorBoard. Every eval_every steps and at the end the full model is gathered to
rank 0 and evaluated on the validation shards; at the end rank 0 samples text from it. With
--check (small models), rank 0 trains the same GPT in one process and compares.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from day22_megatron import hsdp
from day22_megatron.ep import data_rank
from day22_megatron.layouts import VOCAB_MULTIPLE, Layout, LayoutError, check_experts, padded_preset
from day22_megatron.stack import grid_for
from day28_gpt125m import data as shards
from day28_gpt125m import fit, verdict
from day28_gpt125m.recipe import Recipe, generate, lr_at
from day28_gpt125m.strategies import (
    APPLIES,
    COMPILE,
    EXPERTS,
    MODEL_PARALLEL,
    REGISTRY,
    REPLICATES,
    STRATEGIES,
    Setup,
    Strategy,
    build,
    mean_loss,
)
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import extras
from dtl import profile as dtl_profile
from dtl.data import (
    DataError,
    check_source,
    get_tokenizer,
    load_corpus,
    split_micro_batches,
    tokenizer_for,
)
from dtl.deepspeed import DsConfigError, planned_device_type
from dtl.grid import ParallelGrid
from dtl.metrics import StepLogger, peak_flops
from dtl.model import GPT, PRESETS, PresetName, Recompute, flops_per_token, loss_fn, preset
from dtl.precision import PrecisionName
from dtl.shared_folder import require_shared_folder


@dataclass
class Config:
    # ddp | fsdp2 | zero2 | zero3 | tp_pp | tp_sp | ep | megatron | fsdp2_tp | fsdp2_dtensor_tp
    strategy: Literal[STRATEGIES] = "fsdp2"
    model: PresetName = "tiny"  # GPT preset: tiny, small, gpt2-124m, gpt3-125m; tiny-moe (ep)
    tp: int = 1  # tensor-parallel size (tp_pp, tp_sp, ep, megatron)
    pp: int = 1  # pipeline-parallel size (tp_pp, ep, megatron); dp = world / (tp x pp)
    ep: int = 1  # expert-parallel size (ep): each MoE layer's experts over ep of the dp ranks
    replicas: int = 1  # fsdp2: HSDP, sharded over world / replicas ranks, replicated (1: FSDP)
    # activation recomputation, dtl.model's set_recompute: none | selective | full
    recompute: Recompute = "none"
    micro_batch_size: int = 2  # sequences per micro-batch per DP rank
    global_batch_size: int = 8  # sequences per step (micro x accumulation x dp)
    seq_len: int = 32  # tokens per sequence
    steps: int = 8  # optimizer steps
    warmup: int = 2  # linear warm-up steps
    lr: float = 6e-4  # peak learning rate
    min_lr: float = 6e-5  # the cosine's end
    weight_decay: float = 0.1  # AdamW, matrices only
    clip: float = 1.0  # global gradient-norm clip (0: off)
    # fp32 | bf16: autocast (ddp, fsdp2) or DeepSpeed's bf16 (zero2, zero3); fp8: bf16 autocast
    # around float8 linears (ddp, fsdp2; dtl.conversion); GPUs
    precision: PrecisionName = "fp32"
    compile: bool = False  # torch.compile the model (ddp, fsdp2)
    data: str = "shakespeare"  # text source: shakespeare, a .txt file, a Hugging Face dataset
    data_dir: str = ""  # token shards, written on first use (empty: in outputs/day28_gpt125m)
    workers: int = 2  # DataLoader worker processes (0: batches built in the training process)
    eval_every: int = 0  # steps between validation losses (0: only at the end)
    eval_batches: int = 2  # validation batches per evaluation
    sample_tokens: int = 32  # tokens rank 0 samples at the end (0: none)
    save_every: int = 0  # steps between checkpoints (0: none)
    ckpt_dir: str = ""  # empty: <out_dir>/ckpt
    resume: bool = False  # continue from the latest checkpoint in ckpt_dir (at its step)
    stop_at: int = 0  # stop after this many steps, keeping the schedule of `steps` (0: steps)
    check: bool = True  # rank 0 trains the one-process GPT and compares (small models only)
    seed: int = 0  # model init and batches
    local_rank: int = -1  # passed by the deepspeed launcher; LOCAL_RANK is what is read
    out_dir: str = ""  # empty: outputs/day28_gpt125m/<strategy>-<model>
    # derived by validate(): the run's device type, and the precision its strategy trains in
    # there (--precision where the strategy declares it, else fp32), decided once
    device_type: str = field(default="cpu", init=False)
    runs_precision: str = field(default="fp32", init=False)

    def model_config(self):
        """The preset; under tensor parallelism (tp_pp, megatron) a vocabulary that tp does not
        divide is padded to a multiple of 128 x tp, Megatron's --make-vocab-size-divisible-by
        (day 22): GPT-2's 50,257 words split over no tp > 1 (`small`'s 50,304 and `tiny`'s 256
        need nothing, so their runs are unchanged). Padded rows are never a target; every
        strategy and the one-process reference of this run use the same config."""
        if self.strategy in MODEL_PARALLEL and PRESETS[self.model].vocab_size % self.tp:
            return padded_preset(self.model, 0, VOCAB_MULTIPLE, self.tp)
        return preset(self.model)

    @property
    def world(self) -> int:
        return dtl_dist.launch_world_size()

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def accum(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def forwards(self) -> int:
        """Forward passes per step over all ranks: an MoE's load-balancing loss counts the
        tokens of one (its one-process reference runs the same slices)."""
        return self.global_batch_size // self.micro_batch_size

    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep)

    def grid(self) -> ParallelGrid:
        """The run's grid (collective: builds its groups); with ep > 1 an ep axis inside dp."""
        return grid_for(self.layout())

    def recipe(self) -> Recipe:
        return Recipe(
            lr=self.lr,
            min_lr=self.min_lr,
            warmup=self.warmup,
            steps=self.steps,
            weight_decay=self.weight_decay,
            clip=self.clip,
            precision=self.runs_precision,
        )

    def _check_experts(self, kind: type[Strategy]) -> None:
        """An MoE model goes with a strategy that has experts, and its ep fits (day 22's rules)."""
        err = dtl_config.ConfigError
        moe = self.model_config().moe
        if self.ep > 1 and not kind.experts:
            raise err(f"--ep is for {', '.join(EXPERTS)}, not {self.strategy}")
        if kind.experts and moe is None:
            raise err(
                f"{self.strategy} trains a mixture of experts; {self.model} is dense "
                f"(use --model=tiny-moe)"
            )
        if moe is not None and not kind.experts:
            raise err(
                f"{self.model} is a mixture of experts: train it with --strategy="
                f"{' or '.join(EXPERTS)}"
            )
        try:
            check_experts(self.layout(), self.model_config())
        except LayoutError as e:
            raise err(str(e)) from None

    def validate(self) -> None:
        err = dtl_config.ConfigError
        if self.min_lr > self.lr:
            raise err(f"min_lr {self.min_lr:g} exceeds lr {self.lr:g}: the cosine decays to it")
        try:  # the text exists (file, folder or a dataset the hub knows): asked, not read
            check_source(self.data)
        except DataError as e:
            raise err(str(e)) from None
        if not APPLIES.get(self.precision):
            raise err(f"--precision={self.precision} is declared by no strategy here; use bf16")
        try:
            self.device_type = planned_device_type()
        except DsConfigError as e:
            raise err(str(e)) from None
        self.runs_precision = REGISTRY[self.strategy].runs_in(self.precision, self.device_type)
        if (self.tp > 1 or self.pp > 1) and self.strategy not in MODEL_PARALLEL:
            raise err(f"--tp/--pp are for {', '.join(MODEL_PARALLEL)}, not {self.strategy}")
        kind = REGISTRY[self.strategy]
        if self.pp > 1 and not kind.pipelines:
            raise err(f"{self.strategy} runs without a pipeline (pp = 1); for pp > 1 use tp_pp")
        if self.replicas > 1 and not kind.replicates:
            raise err(f"--replicas is for {', '.join(REPLICATES)}, not {self.strategy}")
        try:
            hsdp.check_replicas(self.replicas, self.world)
        except ValueError as e:
            raise err(str(e)) from None
        if kind.sequence_parallel and self.tp < 2:
            raise err(f"{self.strategy} needs --tp > 1: SP splits what TP keeps whole")
        if self.recompute != "none" and kind.no_recompute:
            raise err(kind.no_recompute)
        if self.world % (self.tp * self.pp):
            raise err(
                f"strategy {self.strategy} with tp {self.tp} x pp {self.pp} does not fit "
                f"{self.world} ranks (world = tp x pp x dp)"
            )
        if self.model_config().n_head % self.tp:  # TP splits the attention by whole heads
            raise err(
                f"--tp={self.tp} does not divide {self.model}'s {self.model_config().n_head} heads"
            )
        self._check_experts(kind)
        rows = self.micro_batch_size * self.dp
        if self.global_batch_size % rows:
            raise err(
                f"global batch {self.global_batch_size} is not divisible by micro-batch "
                f"{self.micro_batch_size} x dp {self.dp} = {rows}"
            )
        cfg = self.model_config()
        if self.seq_len > cfg.block_size:
            raise err(f"seq_len {self.seq_len} exceeds {self.model}'s block_size {cfg.block_size}")
        try:
            fit.check(self)  # the model state must fit the device: predicted before allocation
        except fit.FitError as e:
            raise err(str(e)) from None
        self.out_dir = self.out_dir or f"outputs/day28_gpt125m/{self.strategy}-{self.model}"
        self.ckpt_dir = self.ckpt_dir or os.path.join(self.out_dir, "ckpt")
        refusal = REGISTRY[self.strategy].no_checkpoints
        if (self.resume or self.save_every) and refusal:
            raise err(refusal)
        if self.stop_at and not 0 < self.stop_at < self.steps:
            raise err(f"stop_at {self.stop_at} must be between 0 and steps {self.steps}")
        if self.resume and not os.path.isfile(os.path.join(self.ckpt_dir, "latest")):
            raise err(f"--resume: no checkpoint in {self.ckpt_dir} (no 'latest' file)")
        extras.require(f"--strategy={self.strategy}", *REGISTRY[self.strategy].extras)


def tokens_folder(cfg: Config) -> str:
    tok = tokenizer_for(cfg.model_config().vocab_size, bpe="gpt2")
    return cfg.data_dir or f"outputs/day28_gpt125m/data-{cfg.data}-{tok}"


def prepare_data(cfg: Config):
    """The train and validation shards, written once by rank 0 from dtl.data's corpus."""
    folder = tokens_folder(cfg)
    tok = tokenizer_for(cfg.model_config().vocab_size, bpe="gpt2")
    require_shared_folder(folder, "data folder")  # rank 0 writes, every node reads
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(folder, "train", shards.INDEX)):
        corpus = load_corpus(cfg.data, tokenizer=tok)
        shards.write_shards(corpus.train, os.path.join(folder, "train"))
        shards.write_shards(corpus.val, os.path.join(folder, "val"))
    dist.barrier()
    return (
        shards.ShardedTokens(os.path.join(folder, "train")),
        shards.ShardedTokens(os.path.join(folder, "val")),
        get_tokenizer(tok),
    )


@torch.no_grad()
def evaluate(cfg: Config, full: dict, val, device) -> tuple[float, GPT]:
    """Validation loss of the gathered model on rank 0 (the same rows at any world size), and
    that model (rank 0 samples from it)."""
    gpt = GPT(cfg.model_config(), seed=cfg.seed).to(device)
    gpt.load_state_dict(full, strict=False)
    gpt.tie_weights()
    batches = shards.StepBatches(
        val, cfg.seq_len, cfg.micro_batch_size, dp_rank=0, dp_size=1, seed=cfg.seed + 1
    )
    losses = [
        loss_fn(gpt(x.to(device)), y.to(device)).item()
        for x, y in (batches[i] for i in range(cfg.eval_batches))
    ]
    return sum(losses) / len(losses), gpt


def run(cfg: Config, info, grid: ParallelGrid) -> dict:
    train, val, tokenizer = prepare_data(cfg)
    r = cfg.recipe()
    setup = Setup(
        cfg.model_config(),
        r,
        grid,
        info.device,
        micro_batch=cfg.micro_batch_size,
        accum=cfg.accum,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        steps=cfg.steps,
        recompute=cfg.recompute,
        replicas=cfg.replicas,
    )
    strategy = build(cfg.strategy, setup)
    if cfg.compile and cfg.strategy in COMPILE:
        strategy.model = torch.compile(strategy.model)
    if cfg.compile and cfg.strategy not in COMPILE:
        dtl_dist.print0(
            f"note: --compile is applied by {', '.join(COMPILE)} only; "
            f"{cfg.strategy} runs without it"
        )
    precision = cfg.runs_precision
    if precision != cfg.precision:
        on = " or ".join(REGISTRY[cfg.strategy].support.devices.get(cfg.precision, ())) or "none"
        dtl_dist.print0(
            f"note: {cfg.strategy} applies --precision={cfg.precision} on {on} only, and this "
            f"run's device is {cfg.device_type}: it runs {precision} ({cfg.precision} is applied "
            f"by {', '.join(APPLIES[cfg.precision])})"
        )
    start = strategy.load(cfg.ckpt_dir) if cfg.resume else 0
    if cfg.resume:
        dtl_dist.print0(f"resumed from {cfg.ckpt_dir} at step {start}")
        if start >= cfg.steps:
            dtl_config.exit_with_error(
                f"the checkpoint is at step {start}: nothing left of {cfg.steps}"
            )
    tokens = cfg.global_batch_size * cfg.seq_len
    peak = peak_flops(info.device, precision)
    log = StepLogger(
        cfg.out_dir,
        cfg.steps,
        tokens_per_step=tokens,
        flops_per_token=flops_per_token(cfg.model_config(), cfg.seq_len),
        peak_flops_per_device=peak,
        n_devices=info.world_size,
    )
    # the ranks that read other rows: dp, and ep inside it (tp and pp ranks share theirs)
    reader, readers = data_rank(grid)
    loader = shards.step_loader(
        train,
        seq_len=cfg.seq_len,
        rows=cfg.micro_batch_size * cfg.accum,
        dp_rank=reader,
        dp_size=readers,
        seed=cfg.seed,
        start_step=start,
        steps=cfg.stop_at or cfg.steps,
        workers=cfg.workers,
        pin_memory=info.device.type == "cuda",
    )
    losses, norms, times, waits, evals = [], [], [], [], []
    t_wait = time.perf_counter()
    for step, (x, y) in loader:
        waits.append(time.perf_counter() - t_wait)  # the step was ready, or it waited for data
        strategy.measure_state = step == (cfg.stop_at or cfg.steps) - 1  # state bytes: last step
        t0 = time.perf_counter()
        micro_batches = split_micro_batches(x, y, cfg.micro_batch_size, info.device)
        with dtl_profile.range(dtl_profile.STEP):  # named ranges inside: see dtl.profile
            loss, norm = strategy.step(micro_batches, lr_at(step, r))
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        times.append(time.perf_counter() - t0)
        losses.append(mean_loss(loss, grid))
        norms.append(norm)
        log.log(
            step,
            loss=losses[-1],
            lr=lr_at(step, r),
            grad_norm=norm,
            dt_s=times[-1],
            data_ms=f"{waits[-1] * 1e3:.0f}",
        )
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            evals.append((step + 1, _eval(cfg, strategy, val, info)))
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            strategy.save(cfg.ckpt_dir, step + 1)
        t_wait = time.perf_counter()
    log.close()
    full = strategy.full_parameters()
    val_loss, gpt = evaluate(cfg, full, val, info.device) if info.is_main else (None, None)
    sample = ""
    if info.is_main and cfg.sample_tokens:
        sample = generate(gpt, tokenizer, "ROMEO:", cfg.sample_tokens, seed=cfg.seed)
    strategy.close()
    return dict(
        losses=losses,
        norms=norms,
        times=times,
        waits=waits,
        evals=evals,
        full=full,
        val_loss=val_loss,
        sample=sample,
        train=train,
        start=start,
        state=strategy.last_state,
        sent=strategy.last_sent,
        predicted_sent=strategy.predicted_sent,
    )


def _eval(cfg: Config, strategy, val, info) -> float | None:
    full = strategy.full_parameters()  # collective: every rank gathers
    return evaluate(cfg, full, val, info.device)[0] if info.is_main else None


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    info = dtl_dist.init()
    grid = cfg.grid()
    dtl_config.save(cfg, cfg.out_dir, argv)
    hsdp_mesh = f" (HSDP: {cfg.replicas} replicas x {cfg.world // cfg.replicas} shards)"
    dtl_dist.print0(
        f"grid: {grid}{hsdp_mesh if cfg.replicas > 1 else ''}; {cfg.accum} micro-batches of "
        f"{cfg.micro_batch_size} x {cfg.seq_len} tokens per DP rank per step, "
        f"{cfg.global_batch_size * cfg.seq_len:,} tokens per step"
    )
    dtl_dist.print0(dtl_dist.hosts_line(info))  # all_gather_object of every rank's hostname
    result = run(cfg, info, grid)
    dtl_dist.finish(verdict.report(cfg, info, grid, result))  # cleanup; exit 1 if a check failed


if __name__ == "__main__":
    main()
