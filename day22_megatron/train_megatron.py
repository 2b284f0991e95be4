"""Day 22: the shared GPT trained by megatron-core itself: GPTModel, its schedules, DDP, optimizer.

CPU (gloo), 4 ranks, ~15 s (megatron-core's imports are most of it):
    torchrun --standalone --nproc_per_node=4 -m day22_megatron.train_megatron \\
        --tensor-model-parallel-size=2 --pipeline-model-parallel-size=2
    torchrun --standalone --nproc_per_node=4 -m day22_megatron.train_megatron \\
        --pipeline-model-parallel-size=2 --num-layers-per-virtual-pipeline-stage=1 \\
        --use-distributed-optimizer                         # interleaved 1F1B, ZeRO-1 over dp 2
    torchrun --standalone --nproc_per_node=4 -m day22_megatron.train_megatron \\
        --tensor-model-parallel-size=2 --sequence-parallel --use-distributed-optimizer
GPUs (NCCL): the same lines with --nproc_per_node=gpu --config day22_megatron/gpu_megatron.toml,
or the Megatron-LM style scripts in day22_megatron/launch/ (2, 4, 8 GPUs, two nodes).

Environment: OMP_NUM_THREADS=1 (torchrun's default); CUDA_DEVICE_MAX_CONNECTIONS=1 on GPUs with
TP or SP (Megatron sets it so a layer's communication kernels queue in issue order; main() sets
it when TP > 1 and it is unset).

The flags are Megatron-LM's (`--tensor-model-parallel-size`, ... written with - or _, with = or
a space). What runs is megatron-core's own code: `parallel_state` (groups checked equal to
dtl.grid.ParallelGrid's), `GPTModel` with the local layer spec and the shared GPT's weights
(megatron_gpt.py converts them), `get_forward_backward_func()` (no pipelining, 1F1B, or
interleaved 1F1B), `DistributedDataParallel` (gradients in contiguous buffers, all-reduced, or
reduce-scattered for the distributed optimizer), `finalize_model_grads` (DP sync, tied
embedding and SP LayerNorm all-reduces), `get_megatron_optimizer` (Adam; with
--use-distributed-optimizer the DistributedOptimizer, which shards optimizer state like ZeRO-1)
and `OptimizerParamScheduler`. When the run's device is the CPU (gloo, on any machine),
dtl.megatron's two shims (cpu_shim, optimizer_shim) let it run; under NCCL they do nothing (the
log's shim line says which, and why). At the end rank 0 trains the dtl GPT in one process on
the same global batches with torch's AdamW, the same decay groups and clipping, and compares
losses, gradient norms and parameters.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

import dtl.megatron as dm
from day22_megatron import formulas, layouts, mcore
from day22_megatron.layouts import padded_preset
from day22_megatron.megatron_gpt import gather_dense
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import extras
from dtl.data import dp_micro_batches, load_corpus, tokenizer_for
from dtl.grid import ParallelGrid
from dtl.metrics import StepLogger
from dtl.model import GPT, PresetName
from dtl.optim import OptimConfig
from dtl.precision import PRECISIONS, PrecisionError, PrecisionName
from dtl.reference import Verdict, one_process_gpt, reference_verdict


@dataclass
class Config:
    # --tensor-model-parallel-size: ranks that split every layer's matrices (keep it in a node)
    tensor_model_parallel_size: int = 1
    # --pipeline-model-parallel-size: ranks that hold consecutive slices of the layers
    pipeline_model_parallel_size: int = 1
    # layers per model chunk for interleaved 1F1B (0: one chunk per rank, plain 1F1B)
    num_layers_per_virtual_pipeline_stage: int = 0
    sequence_parallel: bool = False  # shard LayerNorm/dropout activations over TP (needs TP > 1)
    micro_batch_size: int = 1  # sequences per micro-batch (per DP rank)
    global_batch_size: int = 8  # sequences per step over all DP ranks
    use_distributed_optimizer: bool = False  # shard Adam state (and fp32 grads) over DP: ZeRO-1
    model: PresetName = "tiny"  # GPT preset (dtl.model.PRESETS)
    num_layers: int = 0  # 0: the preset's number of layers
    # pad the vocabulary to a multiple of this x TP (Megatron's default 128; GPT-2: 50,304)
    make_vocab_size_divisible_by: int = layouts.VOCAB_MULTIPLE
    seq_length: int = 32  # tokens per sequence
    train_iters: int = 4  # optimizer steps
    lr: float = 1e-3  # Adam learning rate (constant: OptimizerParamScheduler, style constant)
    weight_decay: float = 0.1  # on matrices only (megatron's wd_mult 0 for biases and norms)
    clip_grad: float = 1.0  # global gradient-norm clip (megatron's default), 0 disables it
    adam_eps: float = 1e-8  # Adam epsilon (megatron's default)
    adam_beta1: float = 0.9  # Adam's first-moment decay (megatron's default)
    adam_beta2: float = 0.999  # Adam's second-moment decay (megatron's default; GPT-3: 0.95)
    precision: PrecisionName = "fp32"  # bf16: bf16 parameters, fp32 main params (GPUs)
    seed: int = 0  # model init and batches
    check: bool = True  # rank 0 trains the dtl GPT in one process and compares
    out_dir: str = ""  # empty: outputs/day22_megatron/megatron-tp<t>-pp<p>[-vpp<v>][-sp]-dp<d>

    def model_config(self):
        return padded_preset(
            self.model,
            self.num_layers,
            self.make_vocab_size_divisible_by,
            self.tensor_model_parallel_size,
        )

    @property
    def optim(self) -> OptimConfig:
        """Adam's settings (megatron decays the matrices only: its wd_mult 0 on the rest)."""
        return OptimConfig(
            lr=self.lr,
            eps=self.adam_eps,
            weight_decay=self.weight_decay,
            betas=(self.adam_beta1, self.adam_beta2),
            decay="matrices",
        )

    @property
    def microbatches(self) -> int:
        return self.layout.microbatches(self.global_batch_size, self.micro_batch_size)

    @property
    def layout(self) -> layouts.Layout:
        world = dtl_dist.launch_world_size()
        return layouts.Layout.from_world(
            world,
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size,
            layers_per_virtual_stage=self.num_layers_per_virtual_pipeline_stage,
            n_layer=self.model_config().n_layer,
        )

    def validate(self) -> None:
        err = dtl_config.ConfigError
        cfg = self.model_config()
        try:
            lay = self.layout
            layouts.check(
                lay,
                cfg,
                micro_batch_size=self.micro_batch_size,
                global_batch_size=self.global_batch_size,
                seq_length=self.seq_length,
                sequence_parallel=self.sequence_parallel,
            )
        except layouts.LayoutError as e:
            raise err(str(e)) from None
        try:  # the backend init() will choose, read before any process group exists
            on_gpu = dtl_dist.planned_backend() == "nccl"
        except dtl_dist.BackendError as e:
            raise err(str(e)) from None
        try:  # megatron-core's declaration (mcore.MEGATRON), on this run's device
            mcore.MEGATRON.require(self.precision, "cuda" if on_gpu else "cpu")
        except PrecisionError as e:
            raise err(str(e)) from None
        extras.require("train_megatron", "megatron")  # after the checks that need no library
        name = lay.name(self.sequence_parallel)
        self.out_dir = self.out_dir or f"outputs/day22_megatron/megatron-{name}"


# --- one training step through megatron's schedule (mcore.py) -----------------------------------


def micro_batches(tokens, cfg: Config, step: int, grid: ParallelGrid, device):
    """This DP rank's share of the step's global batch, cut into micro-batches of b rows."""
    return dp_micro_batches(
        tokens,
        cfg.seq_length,
        cfg.global_batch_size // grid.dp_size,
        cfg.micro_batch_size,
        step=step,
        seed=cfg.seed,
        dp_rank=grid.dp_rank,
        dp_size=grid.dp_size,
        device=device,
    )


def build(cfg: Config, grid: ParallelGrid, device) -> mcore.Parts:
    """megatron-core's pieces for this config (mcore.build, every argument from the flags)."""
    vpp = cfg.layout.vpp
    return mcore.build(
        cfg.model_config(),
        grid,
        device,
        optim=cfg.optim,
        clip_grad=cfg.clip_grad,
        steps=cfg.train_iters,
        vpp=vpp if vpp > 1 else None,
        sequence_parallel=cfg.sequence_parallel,
        distributed_optimizer=cfg.use_distributed_optimizer,
        seed=cfg.seed,
        precision=PRECISIONS[cfg.precision],
    )


def run(cfg: Config, info, grid: ParallelGrid) -> dict:
    mcfg = cfg.model_config()
    corpus = load_corpus(tokenizer=tokenizer_for(mcfg.vocab_size))
    vpp = cfg.layout.vpp if cfg.layout.vpp > 1 else None
    dm.init_parallel_state(grid, virtual_pipeline_size=vpp)
    try:
        with dm.cpu_shim():
            result = _train(cfg, info, grid, corpus)
    finally:
        dm.destroy_parallel_state()
    result["corpus"] = corpus
    return result


def _train(cfg: Config, info, grid: ParallelGrid, corpus) -> dict:
    parts = build(cfg, grid, info.device)
    chunks = parts.chunks
    # the converter, both ways, through megatron's own modules: loaded shards gathered back
    dense = GPT(cfg.model_config(), seed=cfg.seed).state_dict()
    back = gather_dense(chunks, cfg.model_config(), grid)
    roundtrip = max((back[k] - dense[k]).abs().max().item() for k in dense)
    forward_step = mcore.make_forward_step(cfg.seq_length, info.device)
    tokens = cfg.global_batch_size * cfg.seq_length
    log = StepLogger(cfg.out_dir, cfg.train_iters, tokens_per_step=tokens)
    last_stage_ranks = info.world_size // grid.pp_size  # dp x cp x tp ranks hold the loss
    losses, norms, times = [], [], []
    for step in range(cfg.train_iters):
        mbs = micro_batches(corpus.train, cfg, step, grid, info.device)
        dtl_dist.synchronize(info.device)
        t0 = time.perf_counter()
        loss, norm = mcore.train_step(
            parts,
            forward_step,
            mbs,
            seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size,
        )
        dtl_dist.synchronize(info.device)
        times.append(time.perf_counter() - t0)
        losses.append(dtl_dist.all_reduce_scalar(loss) / last_stage_ranks)
        norms.append(float(norm))
        log.log(step, loss=losses[-1], grad_norm=norms[-1], dt_s=times[-1])
    log.close()
    params = sum(p.numel() for c in chunks for p in c.parameters())
    layouts_ = mcore.buffer_layouts(parts)  # megatron's grad buffers, their parameters' order
    buffer = sum(n for n, _ in layouts_)
    padded = sum(mcore.distopt_buffer_elements(lay, grid.dp_size) for _, lay in layouts_)
    unpadded = sum(n for _, lay in layouts_ for n, _ in lay)
    full = gather_dense(chunks, cfg.model_config(), grid)
    return dict(
        state=mcore.state_bytes(parts),
        buffer=buffer,
        buffer_formula=padded if cfg.use_distributed_optimizer else unpadded,
        losses=losses,
        norms=norms,
        times=times,
        params=params,
        full=full,
        roundtrip=roundtrip,
        groups=dm.megatron_group_ranks(),
    )


# --- the report -----------------------------------------------------------------------------------


def report(cfg: Config, info, grid: ParallelGrid, result: dict) -> bool:
    lay = cfg.layout
    mcfg = cfg.model_config()
    want = formulas.params_per_rank(mcfg, lay, grid.pp_rank)
    got = torch.tensor([result["params"], want], dtype=torch.float64, device=info.device)
    mismatched = torch.tensor([float(result["params"] != want)], device=info.device)
    torch.distributed.all_reduce(mismatched)
    dtl_dist.print0(
        f"parameters on rank 0: {int(got[0]):,} held, {int(got[1]):,} by formula "
        f"(day22_megatron/formulas.py params_per_rank); ranks that differ: {int(mismatched.item())}"
    )
    dtl_dist.print0(f"dtl.megatron cpu_shim + optimizer_shim: {dm.shim_state()}")
    adam = result["state"]["optim"] // (2 * 4)  # fp32 m and v per element
    dtl_dist.print0(
        f"megatron-core state, rank 0: grad buffer {result['buffer']:,} elements (its padding "
        f"rule: {result['buffer_formula']:,}) for {result['params']:,} parameters; Adam's m and "
        f"v over {adam:,} elements"
    )
    dtl_dist.print0(
        f"converter: dtl GPT -> this layout's megatron shards -> dtl GPT, max |diff| "
        f"{result['roundtrip']:.1e} on rank 0"
    )
    verdict, norm_gap = _compare(cfg, info, grid, result)
    med_ms = sorted(result["times"])[len(result["times"]) // 2] * 1e3
    ok = verdict.ok and mismatched.item() == 0
    dtl_dist.print0(
        f"summary: day22 megatron-core {lay.name(cfg.sequence_parallel)} model={cfg.model} "
        f"schedule={lay.schedule}: {verdict}"
    )
    dtl_dist.print0(
        f"summary: grad norms (megatron's clip_grad over TP x PP) vs one process: max rel diff "
        f"{norm_gap:.1e}; params/rank = formula {'yes' if not mismatched.item() else 'NO'}; "
        f"median step {med_ms:.0f} ms"
    )
    return ok


def _compare(cfg: Config, info, grid: ParallelGrid, result: dict) -> tuple[Verdict, float]:
    if not cfg.check:
        return Verdict.skip("one-process check skipped (check=false)"), float("nan")
    ref_norms: list[float] = []

    def one_process():  # rank 0: the dtl GPT, torch's AdamW, the same groups and clipping
        losses, gpt = one_process_gpt(
            cfg.model_config(),
            result["corpus"].train,
            seq_len=cfg.seq_length,
            rows=cfg.global_batch_size,
            steps=cfg.train_iters,
            seed=cfg.seed,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            eps=cfg.adam_eps,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            clip_grad=cfg.clip_grad or None,
            grad_norms=ref_norms,
        )
        return losses, dict(gpt.named_parameters(remove_duplicate=False)), ref_norms  # lm_head

    # judged: losses, parameters and the norms before clipping (see train_4d's _compare)
    verdict = reference_verdict(
        result["losses"],
        result["full"],
        one_process,
        steps=cfg.train_iters,
        device=info.device,
        optimizer="Adam",
        grad_norms=result["norms"],
    )
    return verdict, verdict.norm_rel


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    if cfg.tensor_model_parallel_size > 1:  # read when CUDA starts (in init): set it first
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    info = dtl_dist.init()
    lay = cfg.layout
    grid = ParallelGrid(tp=lay.tp, pp=lay.pp, dp=lay.dp)
    dtl_config.save(cfg, cfg.out_dir, argv)
    dtl_dist.print0(
        f"grid: {grid}; {cfg.microbatches} micro-batches of {cfg.micro_batch_size} per DP rank, "
        f"schedule {lay.schedule}"
    )
    result = run(cfg, info, grid)
    dtl_dist.finish(report(cfg, info, grid, result))  # cleanup; exit 1 if a check failed


if __name__ == "__main__":
    main()
