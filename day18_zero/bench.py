"""Day 18 benchmark: hand ZeRO-2 vs DeepSpeed stage 2, hand ZeRO-3 vs FSDP2, step time ratios.

Not a test: timings on a shared 2-core box are noisy, so both trainers live in one process
group, train the same model on the same batches, and their steps alternate (A, B, A, B, ...);
each ratio is median(A) / median(B) after warm-up steps.
    torchrun --standalone --nproc_per_node=2 -m day18_zero.bench                 # ~1-2 min
    torchrun --standalone --nproc_per_node=2 -m day18_zero.bench --pairs=zero3
GPUs: torchrun --standalone --nproc_per_node=gpu -m day18_zero.bench --model=gpt2-124m \
          --precision=bf16 --seq_len=512 --batch_size=8
Writes outputs/day18_zero/bench/bench.csv.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from day18_zero import engines
from day18_zero.ds_engine import default_ds_config_path
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.deepspeed import DsConfigError, load_ds_config, planned_device_type
from dtl.metrics import write_csv
from dtl.model import GPT, PresetName, preset
from dtl.optim import OptimConfig
from dtl.precision import PRECISIONS, PrecisionError, PrecisionName

# pair name -> (A, B): (impl, stage) of the two trainers compared
PAIRS = {
    "zero2": (("hand", 2), ("deepspeed", 2)),
    "zero3": (("hand", 3), ("torch", 3)),
}


@dataclass
class Config:
    pairs: str = "zero2,zero3"  # comma-separated: zero2 (hand vs DeepSpeed), zero3 (hand vs FSDP2)
    model: PresetName = "small"  # GPT preset
    # fp32 | bf16, for zero2; zero3 always runs fp32 (FSDP2 here has no master)
    precision: PrecisionName = "fp32"
    batch_size: int = 4  # sequences per rank
    seq_len: int = 64  # tokens per sequence
    steps: int = 12  # steps per trainer, alternating
    warmup: int = 2  # first steps of each trainer left out of the medians
    out_dir: str = "outputs/day18_zero/bench"  # bench.csv
    # derived by validate(): the pairs as a list, and the zero2 pair's checked ds_config
    pair_list: list = field(default_factory=list, init=False)
    device_type: str = field(default="", init=False)
    ds: dict | None = field(default=None, init=False)

    def validate(self) -> None:
        err = dtl_config.ConfigError
        self.pair_list = [p.strip() for p in self.pairs.split(",") if p.strip()]
        bad = [p for p in self.pair_list if p not in PAIRS]
        if bad or not self.pair_list:
            raise err(f"unknown pair(s) {bad}; choose from {', '.join(PAIRS)}")
        try:  # the precision runs in a pair whose two engines both declare it
            self.device_type = planned_device_type()
            runs = [pair_supports(p, self.precision, self.device_type) for p in self.pair_list]
        except (DsConfigError, PrecisionError) as e:
            raise err(str(e)) from None
        if not any(runs):
            raise err(f"no pair here trains in {self.precision}: {', '.join(self.pair_list)}")
        if self.steps <= self.warmup:
            raise err(f"steps ({self.steps}) must exceed warmup ({self.warmup})")
        if "zero2" in self.pair_list:
            try:
                self.ds = self.ds_config(2, self.device_type)
            except DsConfigError as e:
                raise err(str(e)) from None

    def ds_config(self, stage: int, device_type: str) -> dict:
        """The stage's shipped ds_config for a run on `device_type` (its DeepSpeed device)."""
        return load_ds_config(
            default_ds_config_path(stage),
            stage=stage,
            micro_batch=self.batch_size,
            grad_accum=1,
            world_size=dtl_dist.launch_world_size(),
            opt=OptimConfig(),
            precision=self.precision,
            device_type=device_type,
        )


def pair_supports(pair: str, name: str, device_type: str) -> bool:
    """Whether both engines of `pair` train in `name` on `device_type`; PrecisionError (one
    line) for a precision one of them refuses outright, which no pair can bench."""
    supports = [engines.trainer_class(impl, stage).support for impl, stage in PAIRS[pair]]
    if not any(name in s.devices for s in supports):
        supports[0].require(name, device_type)  # raises, naming what the engine trains in
    return all(s.trains(name, device_type) for s in supports)


def pair_precision(cfg: Config, pair: str) -> str:
    """Both sides of a pair train in one precision: the one asked where both engines declare
    it, fp32 (which every engine trains in) where one does not (FSDP2 here has no master)."""
    return cfg.precision if pair_supports(pair, cfg.precision, cfg.device_type) else "fp32"


def make_trainer(cfg: Config, pair: str, impl: str, stage: int, device) -> engines.Trainer:
    gpt = GPT(preset(cfg.model), seed=0).to(device)
    precision = PRECISIONS[pair_precision(cfg, pair)]  # both sides of a pair in one precision
    if engines.trainer_class(impl, stage).model_in_storage_dtype:
        gpt = gpt.to(precision.storage)
    return engines.build(
        impl,
        stage,
        gpt,
        None,
        OptimConfig(),
        ds_config=getattr(cfg, "ds", None) if impl == "deepspeed" else None,
    )


def timed_step(trainer: engines.Trainer, batch, device) -> float:
    t0 = time.perf_counter()
    trainer.step([batch])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def compare(cfg: Config, info, tokens, pair: str) -> dict:
    (impl_a, stage_a), (impl_b, stage_b) = PAIRS[pair]
    a = make_trainer(cfg, pair, impl_a, stage_a, info.device)
    b = make_trainer(cfg, pair, impl_b, stage_b, info.device)
    times_a, times_b = [], []
    for step in range(cfg.steps):
        x, y = get_batch(
            tokens,
            cfg.seq_len,
            cfg.batch_size,
            seed=0,
            step=step,
            dp_rank=info.rank,
            dp_size=info.world_size,
        )
        batch = (x.to(info.device), y.to(info.device))
        first, second = (a, b) if step % 2 == 0 else (b, a)  # alternate who goes first
        t_first = timed_step(first, batch, info.device)
        t_second = timed_step(second, batch, info.device)
        ta, tb = (t_first, t_second) if first is a else (t_second, t_first)
        if step >= cfg.warmup:
            times_a.append(ta)
            times_b.append(tb)
    med_a, med_b = statistics.median(times_a), statistics.median(times_b)
    return dict(
        pair=pair,
        precision=pair_precision(cfg, pair),
        a=a.label,
        b=b.label,
        a_ms=med_a,
        b_ms=med_b,
        ratio=med_a / med_b,
        steps=len(times_a),
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    corpus = load_corpus(tokenizer=tokenizer_for(preset(cfg.model).vocab_size))
    rows = [compare(cfg, info, corpus.train, pair) for pair in cfg.pair_list]
    if info.is_main:
        write_csv(rows, os.path.join(cfg.out_dir, "bench.csv"))
    for r in rows:
        dtl_dist.print0(
            f"summary: bench {r['pair']} on {info.world_size} ranks, {cfg.model} {r['precision']}: "
            f"{r['a']} / {r['b']} step time = {r['a_ms']:.0f} / {r['b_ms']:.0f} ms = "
            f"{r['ratio']:.2f} (medians of {r['steps']} interleaved steps)"
        )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
