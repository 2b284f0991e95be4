"""Day 18: train the shared GPT with ZeRO stage 0-3, by hand, with torch or with DeepSpeed.

CPU (gloo), 2 processes, ~10-20 s each:
    torchrun --standalone --nproc_per_node=2 -m day18_zero.train --stage=3 --impl=hand
    torchrun --standalone --nproc_per_node=2 -m day18_zero.train --stage=3 --impl=deepspeed
    torchrun --standalone --nproc_per_node=2 -m day18_zero.train --stage=1 --impl=torch
    ... --precision=bf16 (hand, deepspeed) | --grad_accum=4 | --no_sync=false | --model=tiny-nobias
GPUs (NCCL, one process per GPU):
    torchrun --standalone --nproc_per_node=gpu -m day18_zero.train --stage=3 --impl=hand \
        --config day18_zero/gpu.toml

Environment: OMP_NUM_THREADS=1 (torchrun sets it when unset; 2 ranks on 2 cores need it).
DS_ACCELERATOR is set from the run's device (dtl.deepspeed.use_run_accelerator): cpu for a gloo run,
on a GPU machine too, cuda under NCCL.

Each step prints the loss of the global batch, this rank's bytes of parameters / gradients /
optimizer state (counted from the live tensors just before the optimizer step) and the bytes
this rank sent (ring cost of every collective the step issued, from dtl.comm.CommCounter).
Then the measured state and traffic beside the paper's formulas, and (on CPU, fp32) the same
training in one process on the global batch, compared.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch

from day18_zero import engines, formulas
from day18_zero.ds_engine import default_ds_config_path
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.comm import CommCounter
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.deepspeed import DsConfigError, load_ds_config, planned_device_type
from dtl.metrics import StepLogger
from dtl.model import GPT, PresetName, preset
from dtl.optim import OptimConfig
from dtl.precision import PRECISIONS, PrecisionError, PrecisionName
from dtl.reference import Verdict, one_process_gpt, reference_verdict

MB = 1e6


@dataclass
class Config:
    # ZeRO stage: 0 (plain data parallel) | 1 | 2 | 3
    stage: Annotated[Literal[formulas.STAGES_ALL], "ZeRO stage"] = 2
    impl: Literal[engines.IMPLS] = "hand"  # hand | torch | deepspeed
    model: PresetName = "small"  # GPT preset (`small`: 7.3M parameters, 6.4M of them in wte)
    # fp32 | bf16 (bf16 params and grads, fp32 master, m, v) | fp16 (GPU, DeepSpeed's loss scaler)
    precision: PrecisionName = "fp32"
    batch_size: int = 4  # sequences per rank per micro-step (DeepSpeed's micro batch)
    seq_len: int = 64  # tokens per sequence
    grad_accum: int = 1  # micro-steps per optimizer step
    no_sync: bool = True  # hand/torch: no communication until the last micro-step
    steps: int = 5  # optimizer steps
    lr: float = 1e-3  # AdamW learning rate (DeepSpeed's "auto" values come from here)
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.0  # AdamW weight decay (DeepSpeed's AdamW defaults to 0, torch's 0.01)
    # hand stages 1-2 and torch DDP: gradient bucket size in MiB
    bucket_cap_mb: Annotated[float, dtl_config.POSITIVE] = 25.0
    prefetch: bool = True  # hand stage 3: all-gather the next block while this one computes
    ds_config: str = ""  # DeepSpeed JSON; empty: day18_zero/ds_config_zero<stage>.json
    check: bool = True  # fp32 only: rank 0 also trains one process on the global batch, compares
    seed: int = 0  # model init and batches
    out_dir: str = ""  # where the run writes; empty: outputs/day18_zero/<impl>-zero<stage>
    # derived by validate(): the device init() will give this run, and the checked ds_config
    device_type: str = field(default="", init=False)
    ds: dict | None = field(default=None, init=False)

    def validate(self) -> None:
        self.out_dir = self.out_dir or f"outputs/day18_zero/{self.impl}-zero{self.stage}"
        err = dtl_config.ConfigError
        try:
            self.device_type = planned_device_type()  # the device init() will give this run
        except DsConfigError as e:
            raise err(str(e)) from None
        try:  # the engine's own declaration (dtl.precision.declare), on this run's device
            engines.trainer_class(self.impl, self.stage).support.require(
                self.precision, self.device_type
            )
        except PrecisionError as e:
            raise err(str(e)) from None
        if self.seq_len > preset(self.model).block_size:
            raise err(f"seq_len {self.seq_len} exceeds {self.model}'s block_size")
        if self.ds_config and self.impl != "deepspeed":
            raise err(f"--ds_config is read by impl=deepspeed only; this run is impl={self.impl}")
        if self.impl == "deepspeed":
            self.ds = self._load_ds_config()

    def _load_ds_config(self) -> dict:
        path = self.ds_config or default_ds_config_path(self.stage)
        try:
            return load_ds_config(
                path,
                stage=self.stage,
                micro_batch=self.batch_size,
                grad_accum=self.grad_accum,
                world_size=dtl_dist.launch_world_size(),  # torchrun's, before init
                opt=self.optim(),
                precision=self.precision,
                device_type=self.device_type,  # DeepSpeed's accelerator: the run's device
            )
        except DsConfigError as e:
            raise dtl_config.ConfigError(str(e)) from None

    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)


def micro_batches(tokens, cfg: Config, step: int, rank: int, world: int, device):
    """This rank's micro-batches of `step`: its rows of the global batch, cut in grad_accum."""
    x, y = get_batch(
        tokens,
        cfg.seq_len,
        cfg.batch_size * cfg.grad_accum,
        seed=cfg.seed,
        step=step,
        dp_rank=rank,
        dp_size=world,
    )
    x, y = x.to(device), y.to(device)
    b = cfg.batch_size
    return [(x[m * b : (m + 1) * b], y[m * b : (m + 1) * b]) for m in range(cfg.grad_accum)]


def build_trainer(cfg: Config, info) -> engines.Trainer:
    gpt = GPT(preset(cfg.model), seed=cfg.seed).to(info.device)
    if engines.trainer_class(cfg.impl, cfg.stage).model_in_storage_dtype:
        gpt = gpt.to(PRECISIONS[cfg.precision].storage)  # the hand engines: bf16 parameters
    return engines.build(
        cfg.impl,
        cfg.stage,
        gpt,
        None,
        cfg.optim(),
        no_sync=cfg.no_sync,
        bucket_cap_mb=cfg.bucket_cap_mb,
        prefetch=cfg.prefetch,
        ds_config=getattr(cfg, "ds", None),
    )


def comm_of_step(counter: CommCounter, before: dict) -> dict[str, float]:
    """Ring bytes per rank by collective kind, issued since the `before` snapshot."""
    out = {k: v - before.get(k, 0) for k, v in counter.ring_bytes.items()}
    return {k: v for k, v in out.items() if v > 0}


def run(cfg: Config, info) -> dict:
    corpus = load_corpus(tokenizer=tokenizer_for(preset(cfg.model).vocab_size))
    # entered before the trainer exists: DeepSpeed binds torch.distributed's functions at init
    counter = CommCounter().__enter__()
    trainer = build_trainer(cfg, info)
    log = StepLogger(
        cfg.out_dir,
        cfg.steps,
        tensorboard=True,
        tokens_per_step=cfg.batch_size * cfg.seq_len * cfg.grad_accum * info.world_size,
    )
    losses, comms = [], []
    for step in range(cfg.steps):
        batches = micro_batches(corpus.train, cfg, step, info.rank, info.world_size, info.device)
        before = dict(counter.ring_bytes)
        t0 = time.perf_counter()
        local = trainer.step(batches)  # inside: the named ranges step, forward, backward, ...
        if info.device.type == "cuda":  # the step's kernels, not only their launch
            torch.cuda.synchronize(info.device)
        dt = time.perf_counter() - t0
        comms.append(comm_of_step(counter, before))
        # after the snapshot: not part of the step's traffic
        loss = dtl_dist.all_reduce_scalar(local, average=True)
        losses.append(loss)
        sb = trainer.bytes_before_step
        log.log(
            step,
            loss=loss,
            dt_s=dt,
            params_mb=f"{sb['params'] / MB:.2f}",
            grads_mb=f"{sb['grads'] / MB:.2f}",
            optim_mb=f"{sb['optim'] / MB:.2f}",
            comm_mb=f"{sum(comms[-1].values()) / MB:.2f}",
        )
    log.close()
    counter.__exit__(None, None, None)
    params = trainer.full_parameters()  # collective: every rank
    return dict(trainer=trainer, losses=losses, comm=comms[-1], params=params, corpus=corpus)


def reference(cfg: Config, info, corpus) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch of every step (what all ranks see together)."""
    losses, gpt = one_process_gpt(
        preset(cfg.model),
        corpus.train,
        seq_len=cfg.seq_len,
        rows=cfg.batch_size * cfg.grad_accum * info.world_size,
        steps=cfg.steps,
        seed=cfg.seed,
        make_optimizer=cfg.optim().make,
    )
    return losses, {n: p.detach() for n, p in gpt.named_parameters()}


def report(cfg: Config, info, result: dict) -> bool:
    """Measured beside the formulas; the one-process comparison. Returns False on a mismatch."""
    t: engines.Trainer = result["trainer"]
    n = info.world_size
    psi = _distinct_numel(result["params"])
    prec = t.state_precision(PRECISIONS[cfg.precision])
    # hand ZeRO pads each bucket to a multiple of N: its slices hold padded / N elements
    padded = t.padded_numel() if cfg.impl == "hand" else None
    want = formulas.model_state_bytes(psi, n, t.formula_stage(), prec, padded=padded)
    got = t.bytes_before_step
    dtl_dist.print0(
        f"{t.label}: Ψ = {psi:,} parameters, N = {n}, precision {prec.name} "
        f"({prec.param} + {prec.grad} + {prec.optim} bytes per parameter)"
    )
    rows = [
        ("params", got["params"], want.params),
        ("grads", got["grads"], want.grads),
        ("optim", got["optim"], want.optim),
        ("total", sum(got.values()), want.total),
    ]
    for name, g, w in rows:
        dtl_dist.print0(
            f"  {name:<7}{g / MB:>10.3f} MB measured  {w / MB:>10.3f} MB formula "
            f"(stage {t.formula_stage()})  {_pct(g, w)}"
        )
    if t.formula_note:
        dtl_dist.print0(f"  note: {t.formula_note}")
    _print_per_rank_totals(sum(got.values()))
    _print_live_and_device_memory(t, info, want.total)
    comm = result["comm"]
    elem = PRECISIONS[cfg.precision].storage.itemsize
    pred = formulas.comm_bytes_per_rank(t.padded_numel(), n, cfg.stage, elem)
    if cfg.stage == 3 and cfg.grad_accum > 1:
        pred *= (2 * cfg.grad_accum + 1) / 3  # gathered twice per micro-step, reduced once
    parts = " + ".join(f"{k} {v / MB:.3f}" for k, v in sorted(comm.items()))
    dtl_dist.print0(
        f"sent per rank in the last step: {parts} = {sum(comm.values()) / MB:.3f} MB;"
        f" formula {formulas.comm_volume_factor(cfg.stage)}Ψ(N-1)/N x {elem} B = "
        f"{pred / MB:.3f} MB ({_pct(sum(comm.values()), pred)})"
    )
    matches = _compare_with_one_process(cfg, info, result)
    total, formula_total = sum(got.values()), want.total
    dtl_dist.print0(
        f"summary: day18 stage={cfg.stage} impl={cfg.impl} precision={cfg.precision} ranks={n}: "
        f"{matches}; per-rank state {total / MB:.3f} MB vs formula {formula_total / MB:.3f} MB "
        f"({_pct(total, formula_total)}); sent {sum(comm.values()) / MB:.3f} MB/step vs formula "
        f"{pred / MB:.3f} MB"
    )
    return matches.ok


def _print_per_rank_totals(total: int) -> None:
    """The table is rank 0's; say so when another rank holds a different amount."""
    totals = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(totals, total)
    if len(set(totals)) > 1:
        per = ", ".join(f"rank {r} {v / MB:.3f}" for r, v in enumerate(totals))
        dtl_dist.print0(f"  per-rank totals differ: {per} MB")


def _print_live_and_device_memory(t: engines.Trainer, info, formula_total: float) -> None:
    live = getattr(getattr(t, "model", None), "live", None)
    if t.impl == "hand" and t.stage >= 2 and live is not None:
        buckets = t.model.buckets
        full = sum(b.padded_numel * b.full.data.element_size() for b in buckets)
        peak = live.peak_grad_bytes
        dtl_dist.print0(
            f"full (P,) gradient buffers alive during backward: peak {peak / MB:.3f}"
            f" MB of {full / MB:.3f} MB for all {len(buckets)} buckets (at most "
            f"{t.model.max_in_flight} reduce-scatters in flight + the bucket being filled)"
        )
    if t.impl == "hand" and t.stage == 3 and live is not None:
        dtl_dist.print0(
            f"ZeRO-3 gathered parameters: peak {live.peak_bytes / MB:.3f} MB, at most "
            f"{live.peak_units} blocks at once (limit: root + 2 blocks = "
            f"{live.limit_bytes() / MB:.3f} MB)"
        )
    if info.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(info.device)
        dtl_dist.print0(
            f"cuda max_memory_allocated {peak / MB:.1f} MB on rank 0: model states (formula) "
            f"{formula_total / MB:.1f} MB + activations, buffers and gathered parameters"
        )


def _compare_with_one_process(cfg: Config, info, result) -> Verdict:
    if not cfg.check or cfg.precision != "fp32":
        return Verdict.skip("one-process check skipped" + ("" if cfg.check else " (check=false)"))
    return reference_verdict(
        result["losses"],
        result["params"],
        lambda: reference(cfg, info, result["corpus"]),
        steps=cfg.steps,
        device=info.device,
    )


def _distinct_numel(params: dict[str, torch.Tensor]) -> int:
    seen, total = set(), 0
    for name, v in params.items():
        key = "wte.weight" if name == "lm_head.weight" else name  # the tied weight, once
        if key not in seen:
            seen.add(key)
            total += v.numel()
    return total


def _pct(measured: float, formula: float) -> str:
    return "exact" if measured == formula else f"{(measured - formula) / formula:+.2%}"


def save_ds_config(cfg: Config, info) -> None:
    """The resolved ds_config (every "auto" filled in) beside config.json, and its batch line."""
    ds = cfg.ds
    dtl_dist.print0(
        f"ds_config {cfg.ds_config or default_ds_config_path(cfg.stage)}: train_batch_size "
        f"{ds['train_batch_size']} = micro {ds['train_micro_batch_size_per_gpu']} x accumulation "
        f"{ds['gradient_accumulation_steps']} x world {info.world_size}"
    )
    if info.is_main:
        with open(os.path.join(cfg.out_dir, "ds_config.json"), "w") as f:
            json.dump(ds, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    if cfg.impl == "deepspeed":
        save_ds_config(cfg, info)
    result = run(cfg, info)
    dtl_dist.finish(report(cfg, info, result))  # cleanup; exit 1 if a check failed


if __name__ == "__main__":
    main()
