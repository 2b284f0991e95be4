"""Day 23: train the shared GPT with DeepSpeed ZeRO-3 from one of the offload templates, and show
where its bytes went beside where the explainer said they would go.

CPU (gloo), 2 ranks, ~15 s (the NVMe template needs `apt-get install libaio-dev`):
    torchrun --standalone --nproc_per_node=2 -m day23_zero3_offload.train --ds_config=cpu
    torchrun --standalone --nproc_per_node=2 -m day23_zero3_offload.train --ds_config=nvme
    torchrun --standalone --nproc_per_node=2 -m day23_zero3_offload.train \\
        --ds_config=day23_zero3_offload/zero3_offload_opt_only.json      # any ds_config file
GPUs (NCCL): the same with --nproc_per_node=gpu --config day23_zero3_offload/gpu.toml (bf16).

Environment: OMP_NUM_THREADS=1; DS_ACCELERATOR follows the run's device (set by
dtl.deepspeed.use_run_accelerator: cpu for gloo, on a GPU machine too; cuda for NCCL);
TORCH_EXTENSIONS_DIR where `make install` built DeepSpeed's cpu_adam and async_io ops.

--ds_config is a template name (zero3, opt_only, cpu, nvme) or a path. The run reads the batch,
the optimizer and the clipping from it (one source of truth), checks it with checks.check
before any collective, trains `steps` steps (each `gradient_accumulation_steps` micro-batches of
`train_micro_batch_size_per_gpu` per rank), printing each step's loss, time, and the bytes this
process read and wrote on disk (the NVMe swap traffic); then the bytes per location read from
the engine (measure.py) beside predict.py's, and rank 0 trains the dense GPT in one process
with torch's AdamW, the same decay groups and clipping, and compares.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field

import torch

from day23_zero3_offload import checks, measure, predict
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import extras
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.deepspeed import (
    DsConfigError,
    apply_precision,
    import_deepspeed,
    planned_device_type,
    use_run_accelerator,
)
from dtl.metrics import StepLogger
from dtl.model import GPT, PresetName, preset
from dtl.optim import optimizer_groups
from dtl.precision import PrecisionName
from dtl.reference import ADAM_NORM_RTOL, Verdict, one_process_gpt, reference_verdict

MB = 1e6


@dataclass
class Config:
    ds_config: str = "cpu"  # template (zero3 | opt_only | cpu | nvme) or a ds_config JSON path
    model: PresetName = "small"  # GPT preset
    vocab_size: int = 0  # 0: the preset's (tests use a wider vocab so tensors reach 1 MiB)
    seq_len: int = 64  # tokens per sequence
    steps: int = 4  # optimizer steps
    nvme_path: str = ""  # overrides the template's nvme_path (empty: keep it)
    # fp32 | bf16 (bf16 params and grads, GPUs; the CPU check is fp32) | fp16 (GPUs, loss scaler)
    precision: PrecisionName = "fp32"
    check: bool = True  # rank 0 trains the dense model in one process and compares
    ckpt_dir: str = ""  # where engine.save_checkpoint writes (with save_at) / resume reads
    save_at: int = 0  # save after this many steps (0: never), then keep training
    resume: bool = False  # load the checkpoint in ckpt_dir and continue from its step
    seed: int = 0  # model init and batches
    out_dir: str = ""  # empty: outputs/day23_zero3_offload/<template>
    # derived by validate(): why this line cannot run here (NVMe without libaio), "" if it can
    skip_reason: str = field(default="", init=False)
    device_type: str = field(default="cpu", init=False)  # derived by validate(): the run's device

    def model_config(self):
        return preset(self.model, **({"vocab_size": self.vocab_size} if self.vocab_size else {}))

    @property
    def ds_path(self) -> str:
        return (
            checks.template_path(self.ds_config)
            if self.ds_config in checks.TEMPLATES
            else self.ds_config
        )

    def validate(self) -> None:
        err = dtl_config.ConfigError
        if self.seq_len > self.model_config().block_size:
            raise err(f"seq_len {self.seq_len} exceeds {self.model}'s block_size")
        if (self.save_at or self.resume) and not self.ckpt_dir:
            raise err("--save_at and --resume need --ckpt_dir")
        if self.save_at >= self.steps:
            raise err(f"save_at {self.save_at} must be < steps {self.steps}")
        world = dtl_dist.launch_world_size()
        self.skip_reason = ""
        try:
            self.device_type = planned_device_type()
            # DeepSpeed's accelerator = the run's device, before checks.check imports DeepSpeed
            use_run_accelerator(self.device_type)
            ds = self.load_ds_config()  # the file first: a wrong path is named without DeepSpeed
            extras.require("day23_zero3_offload.train", "deepspeed")  # check() imports it
            checks.check(ds, world)
        except checks.MissingLibaio as e:
            self.skip_reason = str(e)  # a SKIP in the tour, not a failure (lessons.toml)
        except DsConfigError as e:
            raise err(str(e)) from None
        name = os.path.splitext(os.path.basename(self.ds_path))[0]
        self.out_dir = self.out_dir or f"outputs/day23_zero3_offload/{name}"
        if self.resume:
            tag = os.path.join(self.ckpt_dir, "latest")
            if not os.path.isfile(tag):
                raise err(f"--resume: no DeepSpeed checkpoint in {self.ckpt_dir} (no 'latest')")

    def load_ds_config(self) -> dict:
        """The ds_config as this run uses it on its device: --nvme_path applied on a copy,
        and --precision by the kit's rule for every ds_config (dtl.deepspeed.apply_precision:
        DeepSpeed's section for the row, which the file may write only in agreement)."""
        ds = copy.deepcopy(checks.read(self.ds_path))
        zero = ds.setdefault("zero_optimization", {})
        for section in ("offload_param", "offload_optimizer"):
            if self.nvme_path and (zero.get(section) or {}).get("device") == "nvme":
                zero[section]["nvme_path"] = self.nvme_path
        apply_precision(ds, self.precision, self.device_type)
        return ds


def optimizer_settings(ds: dict) -> dict:
    params = ds.get("optimizer", {}).get("params", {})
    return dict(
        lr=params.get("lr", 1e-3),
        eps=params.get("eps", 1e-8),
        weight_decay=params.get("weight_decay", 0.0),
        clip=ds.get("gradient_clipping", 0.0),
    )


def build_engine(cfg: Config, ds: dict, device):
    """deepspeed.initialize on the dtl GPT, with Megatron's decay groups (matrices only), on the
    run's `device`: DeepSpeed moves the module there itself (its accelerator, set to match)."""
    deepspeed = import_deepspeed(device.type)
    gpt = GPT(cfg.model_config(), seed=cfg.seed)
    wd = optimizer_settings(ds)["weight_decay"]
    engine, *_ = deepspeed.initialize(
        model=gpt,
        model_parameters=optimizer_groups(gpt, wd),
        config=ds,
        dist_init_required=False,
    )
    return engine


def micro_batches(tokens, cfg: Config, ds: dict, step: int, info) -> list:
    """This rank's micro-batches of the step: the global batch is micro x accum x world rows."""
    b = ds["train_micro_batch_size_per_gpu"]
    k = ds.get("gradient_accumulation_steps", 1)
    x, y = get_batch(
        tokens,
        cfg.seq_len,
        b * k,
        seed=cfg.seed,
        step=step,
        dp_rank=info.rank,
        dp_size=info.world_size,
    )
    return [
        (x[i : i + b].to(info.device), y[i : i + b].to(info.device)) for i in range(0, b * k, b)
    ]


NORM_RTOL = ADAM_NORM_RTOL  # the gradient norms against one process (see _compare)


def train_step(engine, mbs) -> tuple[float, float]:
    """One optimizer step: DeepSpeed counts micro-steps and steps at the accumulation boundary.
    Returns this rank's mean loss and the global gradient norm before clipping (DeepSpeed's)."""
    from dtl.model import loss_fn

    total = 0.0
    for x, y in mbs:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        total += loss.item()
    return total / len(mbs), float(engine.get_global_grad_norm())


def run(cfg: Config, info, ds: dict | None = None, engine=None) -> dict:
    """Train cfg.steps steps (from the checkpoint's step with --resume); save at cfg.save_at.
    `engine`: one build_engine made already (to hook into it before training)."""
    ds = ds or cfg.load_ds_config()
    mcfg = cfg.model_config()
    corpus = load_corpus(tokenizer=tokenizer_for(mcfg.vocab_size))
    if engine is None:
        measure.clear_swap_files(ds, info.rank)  # another run's files would be counted too
        engine = build_engine(cfg, ds, info.device)
    peak = measure.PeakGathered(engine)  # the gathered parameters' high-water mark
    first_step, states = 0, {}
    if cfg.resume:
        _, client = engine.load_checkpoint(cfg.ckpt_dir)
        first_step = client["step"]
        states["loaded"] = full_parameters(engine)  # what the checkpoint gave back
        dtl_dist.print0(f"resumed from {cfg.ckpt_dir} at step {first_step}")
    rows = ds["train_micro_batch_size_per_gpu"] * ds.get("gradient_accumulation_steps", 1)
    log = StepLogger(cfg.out_dir, cfg.steps, tokens_per_step=rows * info.world_size * cfg.seq_len)
    losses, norms, times, swapped = [], [], [], []
    for step in range(first_step, cfg.steps):
        mbs = micro_batches(corpus.train, cfg, ds, step, info)
        io0, t0 = measure.io_bytes(), time.perf_counter()
        loss, norm = train_step(engine, mbs)
        norms.append(norm)
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        times.append(time.perf_counter() - t0)
        io1 = measure.io_bytes()
        swapped.append({k: io1[k] - io0[k] for k in io1})
        losses.append(dtl_dist.all_reduce_scalar(loss, average=True))
        if cfg.save_at and step + 1 == cfg.save_at:
            # every rank writes its own partitions (and, with NVMe, reads its swap files back)
            engine.save_checkpoint(
                cfg.ckpt_dir, tag=f"step{step + 1}", client_state={"step": step + 1}
            )
            states["saved"] = full_parameters(engine)  # what a resume must give back
        log.log(
            step,
            loss=losses[-1],
            dt_s=times[-1],
            disk_read_mb=f"{swapped[-1]['read'] / MB:.1f}",
            disk_write_mb=f"{swapped[-1]['write'] / MB:.1f}",
        )
    log.close()
    peak.remove()  # the hooks sample every module; a later use of the engine runs without them
    return dict(
        engine=engine,
        ds=ds,
        losses=losses,
        norms=norms,
        times=times,
        swapped=swapped,
        corpus=corpus,
        where=measure.locations(engine, info.rank, peak),
        **states,
    )


def full_parameters(engine) -> dict[str, torch.Tensor]:
    """name -> the full parameter, gathered from the ZeRO-3 partitions (collective)."""
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().float().cpu().clone() for n, p in params}


def report(cfg: Config, info, result: dict) -> bool:
    ds, where = result["ds"], result["where"]
    pred = predict.predict(ds, predict.param_groups(cfg.model_config()), info.world_size)
    rows = predict.table(pred, where)
    dtl_dist.print0(f"bytes on rank 0 by location (measure.py) vs predict.py:\n{rows}")
    worst = max(
        abs(where[loc][k] - pred[loc][k]) / pred[loc][k]
        for loc in predict.LOCATIONS
        for k in predict.KINDS
        if pred[loc][k]
    )
    unexpected = [
        f"{loc}.{k}"
        for loc in predict.LOCATIONS
        for k in predict.KINDS
        if where[loc][k] and not pred[loc][k]
    ]
    steady = result["swapped"][1:] or result["swapped"]
    disk = {k: sum(s[k] for s in steady) / len(steady) for k in ("read", "write")}
    want_disk = pred["disk"]
    med = sorted(result["times"])[len(result["times"]) // 2] * 1e3
    checked = cfg.check and not cfg.resume  # a resumed run has no first steps to compare
    verdict = _compare(cfg, info, result) if checked else Verdict.skip("one-process check skipped")
    ok = verdict.ok and worst <= 0.01 and not unexpected
    name = os.path.basename(cfg.ds_path)
    dtl_dist.print0(f"summary: day23 {name} model={cfg.model} ranks={info.world_size}: {verdict}")
    dtl_dist.print0(
        f"summary: bytes per location = prediction within {worst:.2%} (worst kind; "
        f"{'none' if not unexpected else ', '.join(unexpected)} unexpected); disk per step: read "
        f"{disk['read'] / MB:.1f} MB (predicted {want_disk['read'] / MB:.1f}), write "
        f"{disk['write'] / MB:.1f} MB (predicted {want_disk['write'] / MB:.1f}); median step "
        f"{med:.0f} ms"
    )
    return ok


def _compare(cfg: Config, info, result: dict) -> Verdict:
    full = full_parameters(result["engine"])
    opt = optimizer_settings(result["ds"])
    rows = result["ds"]["train_micro_batch_size_per_gpu"] * result["ds"].get(
        "gradient_accumulation_steps", 1
    )

    def one_process():
        norms: list[float] = []
        losses, gpt = one_process_gpt(
            cfg.model_config(),
            result["corpus"].train,
            seq_len=cfg.seq_len,
            rows=rows * info.world_size,
            steps=cfg.steps,
            seed=cfg.seed,
            lr=opt["lr"],
            weight_decay=opt["weight_decay"],
            eps=opt["eps"],
            clip_grad=opt["clip"] or None,
            grad_norms=norms,
        )
        return losses, dict(gpt.named_parameters()), norms

    # the norms too: the templates clip at 1.0, and clipping plus Adam hide a constant factor.
    # At NORM_RTOL (dtl.reference.ADAM_NORM_RTOL), not 1e-5: Adam's divided rounding noise
    # moves the next norms more than the losses; a constant factor still shows.
    return reference_verdict(
        result["losses"],
        full,
        one_process,
        steps=cfg.steps,
        device=info.device,
        optimizer="AdamW",
        grad_norms=result["norms"],
        norm_rtol=NORM_RTOL,
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    if cfg.skip_reason:
        dtl_dist.print0(f"skipped: {cfg.skip_reason}")
        return
    info = dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    result = run(cfg, info)
    dtl_dist.finish(report(cfg, info, result))  # cleanup; exit 1 if a check failed


if __name__ == "__main__":
    main()
