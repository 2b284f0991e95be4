"""Day 23: read a ZeRO-3 offload ds_config, say in one line what is wrong with it, and say where
every byte of the model's training state will live: device, CPU memory, NVMe.

    python -m day23_zero3_offload.explain --ds_config=day23_zero3_offload/zero3_offload_nvme.json \\
        --model=gpt2-124m --world=8
    torchrun --standalone --nproc_per_node=1 -m day23_zero3_offload.explain --fit_budget_gb=80

Checks, each a one-line error (ExplainError) before anything is built:
  - day 18's: the top-level keys DeepSpeed reads, `zero_optimization` / `bf16` / `fp16` against
    DeepSpeed's own pydantic models (a misspelled key is "Extra inputs are not permitted"),
    the optimizer's keys;
  - the batch identity, train_batch_size = micro-batch x accumulation x world, where written;
  - stage-specific keys DeepSpeed's model accepts at any stage and then ignores: `offload_param`
    and every `stage3_*` key need stage 3; `offload_optimizer` needs stage >= 1;
  - `aio` keys: DeepSpeed reads block_size, queue_depth, intra_op_parallelism, single_submit,
    overlap_events, use_gds (swap_tensor/aio_config.py) and nothing else (the documented
    `thread_count` is silently ignored);
  - NVMe: `nvme_path` given, creatable and writable; DeepSpeed's async_io op buildable, which
    needs libaio (`apt-get install libaio-dev`).

The prediction, per rank, for a model of parameters n_i, N ranks, parameter bytes e (4 fp32,
2 bf16), each partition ceil(n_i / N) elements (ZeRO-3 pads every parameter on its own), and
the rules of DeepSpeed 0.19's stage3.py and swappers (measure.py reads the same places):

    gathered     the peak of full parameters held at once (device): every non-persistent one
                 (the reuse rule at its default; measured so at smaller distances too, _gathered)
    params       sum ceil(n_i/N)·e        device; CPU with offload_param; NVMe with offload_param
                                           nvme for partitions of >= max(1 MiB, aio block_size)
                                           bytes (smaller ones stay in CPU memory)
    persistent   n_i·e for n_i <= stage3_param_persistence_threshold: whole on every rank's device
    grads        sum ceil(n_i/N)·e        device; CPU with offload_optimizer; with the optimizer
                                           and the parameters on NVMe the swappable partitions'
                                           gradients also on disk (the nvme template, measured;
                                           optimizer-only NVMe is predicted without, unmeasured)
    optim        12·sum ceil(n_i/N)       fp32 master, exp_avg, exp_avg_sq; device, CPU, or NVMe
                                           (one file each per sub-group, 1 KiB aligned)
    buffers      device: the gradient-reduction bucket, reduce_bucket_size x e (with
                 contiguous_gradients); NVMe only, pinned CPU: buffer_count x buffer_size x e
                 (parameters) + buffer_count x the largest sub-group x 4 (optimizer)
DeepSpeed's own estimator (estimate_zero3_model_states_mem_needs) is printed beside it: it
assumes mixed precision (18 bytes per parameter, 4 x the largest layer on the device) and a 1.5x
buffer factor on the CPU, so the two differ by design; the notes read both.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass

from day18_zero.ds_engine import DsConfigError, check_sections
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.metrics import PEAK_BF16_FLOPS
from dtl.model import GPT, PRESETS, GPTConfig, flops_per_token

GB, MiB = 1e9, 1024**2
MIN_AIO_BYTES = MiB  # deepspeed/runtime/swap_tensor/utils.py MIN_AIO_BYTES
AIO_ALIGN = 1024  # AIO_ALIGNED_BYTES: swap files are padded to a multiple
AIO_KEYS = {"block_size", "queue_depth", "intra_op_parallelism", "single_submit",
            "overlap_events", "use_gds"}  # fmt: skip
AIO_BLOCK_DEFAULT = 1048576
STAGE3_ONLY = ("offload_param", "sub_group_size")  # plus every stage3_* key
LOCATIONS = ("device", "cpu", "nvme")
KINDS = ("params", "persistent", "gathered", "grads", "optim", "buffers")
HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = {
    "zero3": "zero3.json",
    "opt_only": "zero3_offload_opt_only.json",
    "cpu": "zero3_offload_cpu.json",
    "nvme": "zero3_offload_nvme.json",
}


class ExplainError(DsConfigError):
    """A ds_config this day cannot run; one line."""


class MissingLibaio(ExplainError):
    """NVMe offload asked for on a machine without libaio (scripts show SKIP for it)."""


def template_path(name: str) -> str:
    return os.path.join(HERE, TEMPLATES[name])


# --- checks ----------------------------------------------------------------------------------


def read(path: str) -> dict:
    if not os.path.isfile(path):
        raise ExplainError(f"ds_config file not found: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ExplainError(f"ds_config {path} is not valid JSON: {e}") from None


def offload_device(ds: dict, section: str) -> str:
    return str((ds.get("zero_optimization", {}).get(section) or {}).get("device", "none"))


def check(ds: dict, world: int, *, nvme: bool = True) -> None:
    """Raise ExplainError (one line) for anything in `ds` that would not run as written on
    `world` ranks (module top). `nvme=False` skips the NVMe environment checks."""
    try:
        check_sections(ds)
    except DsConfigError as e:
        raise ExplainError(str(e)) from None
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    _check_batch(ds, world)
    if stage != 3:
        wrong = [k for k in zero if k.startswith("stage3_") or k in STAGE3_ONLY]
        if wrong:
            raise ExplainError(
                f"zero_optimization.{wrong[0]} is a ZeRO-3 key but stage is {stage}: DeepSpeed "
                "would accept it and do nothing (set stage 3, or remove it)"
            )
    if stage == 0 and offload_device(ds, "offload_optimizer") != "none":
        raise ExplainError("offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)")
    unknown = sorted(set(ds.get("aio") or {}) - AIO_KEYS)
    if unknown:
        raise ExplainError(
            f"unknown aio key(s) {unknown}: DeepSpeed reads only {sorted(AIO_KEYS)} "
            "(swap_tensor/aio_config.py) and would ignore them"
        )
    if nvme:
        for section in ("offload_param", "offload_optimizer"):
            if offload_device(ds, section) == "nvme":
                check_nvme_path(zero[section].get("nvme_path"), f"{section}.nvme_path")
                check_libaio()


def _check_batch(ds: dict, world: int) -> None:
    micro = ds.get("train_micro_batch_size_per_gpu")
    accum = ds.get("gradient_accumulation_steps", 1)
    total = ds.get("train_batch_size")
    if micro is None and total is None:
        raise ExplainError(
            "ds_config sets neither train_micro_batch_size_per_gpu nor train_batch_size"
        )
    if micro is not None and total is not None and total != micro * accum * world:
        raise ExplainError(
            f"train_batch_size {total} != micro-batch {micro} x accumulation {accum} x world "
            f"{world} = {micro * accum * world} (or leave train_batch_size out: DeepSpeed "
            "computes it)"
        )


def check_nvme_path(path, key: str = "nvme_path") -> None:
    if not path:
        raise ExplainError(f"offload to nvme needs zero_optimization.{key}")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ExplainError(f"{key} '{path}' is not a writable folder: {e.strerror}") from None


def check_libaio() -> None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise MissingLibaio(
            "NVMe offload needs DeepSpeed's async_io op, which needs libaio: "
            "apt-get install libaio-dev (then make install rebuilds the op)"
        )


# --- the prediction --------------------------------------------------------------------------


def param_groups(cfg: GPTConfig) -> list[list[int]]:
    """The element counts of every parameter, in the optimizer groups train.py gives DeepSpeed
    (dtl.model.optimizer_groups: the matrices, then biases and norms), a tied weight once."""
    import torch

    from dtl.model import optimizer_groups

    with torch.device("meta"):
        gpt = GPT(cfg)
    return [[p.numel() for p in g["params"]] for g in optimizer_groups(gpt, 0.0)]


def _aligned(nbytes: float) -> int:
    return int(math.ceil(nbytes / AIO_ALIGN) * AIO_ALIGN)


def _sub_groups(parts: list[int], sub_group_size: int) -> list[list[int]]:
    """DeepSpeed cuts each optimizer group into sub-groups of whole parameters of at most
    sub_group_size elements (one optimizer step and one set of swap files each)."""
    groups, current = [], []
    for k in parts:
        if current and sum(current) + k > sub_group_size:
            groups.append(current)
            current = []
        current.append(k)
    return [*groups, current] if current else groups


def predict(ds: dict, groups: list[list[int]], world: int) -> dict[str, dict[str, float]]:
    """This rank's bytes by location and kind, from the config and the parameter groups."""
    zero = ds.get("zero_optimization", {})
    e = 2 if (ds.get("bf16") or {}).get("enabled") else 4
    parts = [[math.ceil(n / world) for n in g] for g in groups]  # each parameter's partition
    flat = [k for g in parts for k in g]
    subs = [s for g in parts for s in _sub_groups(g, zero.get("sub_group_size", 1_000_000_000))]
    out = {loc: dict.fromkeys(KINDS, 0.0) for loc in LOCATIONS}
    threshold = zero.get("stage3_param_persistence_threshold", 100_000)
    out["device"]["persistent"] = sum(n * e for g in groups for n in g if n <= threshold)
    out["device"]["gathered"] = _gathered([n for g in groups for n in g if n > threshold]) * e
    if zero.get("contiguous_gradients", True):  # the gradient-reduction bucket, preallocated
        out["device"]["buffers"] += zero.get("reduce_bucket_size", 500_000_000) * e
    min_aio = max(MIN_AIO_BYTES, (ds.get("aio") or {}).get("block_size", AIO_BLOCK_DEFAULT))
    swappable = lambda k, size=e: k * size >= min_aio  # noqa: E731
    param_dev, opt_dev = (
        offload_device(ds, "offload_param"),
        offload_device(ds, "offload_optimizer"),
    )
    paged = 0.0
    if param_dev == "nvme":
        section = zero["offload_param"]
        in_cpu = _cpu_resident(parts, subs, section.get("max_in_cpu", 1_000_000_000))
        paged_subs = [s for s, resident in zip(subs, in_cpu) if not resident]
        paged = sum(k * e for s in paged_subs for k in s if swappable(k))
        out["cpu"]["params"] = sum(
            k * e for s, r in zip(subs, in_cpu) for k in s if r or not swappable(k)
        )
        out["nvme"]["params"] = sum(k * e for k in flat if swappable(k))  # written at start, all
        count, size = section.get("buffer_count", 5), section.get("buffer_size", 100_000_000)
        out["cpu"]["buffers"] += count * _aligned(size * e)
    else:
        out["cpu" if param_dev == "cpu" else "device"]["params"] = sum(flat) * e
    opt_home = "cpu" if opt_dev != "none" else "device"
    out[opt_home]["grads"] = sum(flat) * e
    read = write = paged  # parameters beyond max_in_cpu: in for forward, out after the update
    if opt_dev == "nvme":
        on_disk = [sum(s) for s in subs if swappable(sum(s), 4)]
        out["nvme"]["optim"] = 3 * sum(_aligned(S * 4) for S in on_disk)  # master, m, v
        out["cpu"]["optim"] = 12 * sum(sum(s) for s in subs if not swappable(sum(s), 4))
        out["nvme"]["grads"] = (
            sum(k * 4 for k in flat if swappable(k)) if param_dev == "nvme" else 0
        )
        count = zero["offload_optimizer"].get("buffer_count", 4)
        out["cpu"]["buffers"] += count * _aligned(max(on_disk, default=0) * 4)
        params_in = sum(k * e for k in flat if swappable(k)) if param_dev == "nvme" else 0
        read += params_in + out["nvme"]["optim"]  # the step swaps its sub-groups in
        write += out["nvme"]["grads"] + out["nvme"]["optim"]
    else:
        out[opt_home]["optim"] = 12 * sum(flat)
    out["disk"] = {"read": read, "write": write}
    return out


def _gathered(gathered_sizes: list[int]) -> int:
    """Peak elements ZeRO-3 holds gathered (full) at once: every non-persistent parameter.

    DeepSpeed's release rule (partitioned_param_coordinator.py, __params_to_release) keeps a
    parameter gathered after its module ran if the trace reuses it within
    stage3_max_reuse_distance elements; every parameter is reused in backward, so at the
    default (1e9) nothing is released from forward to backward. Smaller distances and
    stage3_max_live_parameters are meant to release earlier, but measured here (bench.py
    --part=keys, a 4 x 256 GPT, DeepSpeed 0.19.8 on CPU) neither lowered the peak: it stayed
    at every non-persistent parameter. The prediction follows the measurement."""
    return sum(gathered_sizes)


def _cpu_resident(parts, subs, max_in_cpu: int) -> list[bool]:
    """Which sub-groups get DeepSpeed's flat pinned CPU copy under params-on-NVMe: each
    optimizer group gets min(its size, max_in_cpu - what earlier groups took) elements, and a
    sub-group lives there if it fits whole (stage3.py, _create_param_groups_fp16_flat_cpu_memory).
    The others are paged: read from NVMe for every forward, written after every update."""
    resident, taken = [], 0
    sub_iter = iter(subs)
    for group in parts:
        room = max(0, min(sum(group), max_in_cpu - taken))
        taken += sum(group)
        offset, left = 0, sum(group)
        while left > 0:
            s = next(sub_iter)
            resident.append(offset + sum(s) <= room)
            offset += sum(s)
            left -= sum(s)
    return resident


def deepspeed_estimate(ds: dict, sizes: list[int], world: int) -> tuple[float, float]:
    """(CPU bytes per node, device bytes per GPU) from DeepSpeed's estimator for this config."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        sum(sizes),
        max(sizes),
        num_gpus_per_node=world,
        cpu_offload=offload_device(ds, "offload_optimizer") != "none",
        cpu_offload_params=offload_device(ds, "offload_param") != "none",
    )
    return cpu, gpu


def totals(where: dict[str, dict[str, float]]) -> dict[str, float]:
    return {loc: sum(where[loc].values()) for loc in LOCATIONS}


def table(pred: dict, measured: dict | None = None) -> str:
    """Rows: location x kind, MB; measured beside predicted where given."""
    head = f"{'where':<8}{'kind':<12}{'predicted MB':>14}" + (
        f"{'measured MB':>13}{'diff':>8}" if measured else ""
    )
    lines = [head]
    for loc in LOCATIONS:
        for kind in KINDS:
            want = pred[loc][kind]
            got = measured[loc][kind] if measured else None
            if not want and not got:
                continue
            row = f"{loc:<8}{kind:<12}{want / 1e6:>14.3f}"
            if measured:
                diff = (got - want) / want if want else float("inf")
                row += f"{got / 1e6:>13.3f}{diff:>+8.2%}"
            lines.append(row)
    return "\n".join(lines)


# --- the largest GPT a budget fits -------------------------------------------------------------

WIDTHS = (768, 1024, 1536, 2048, 2560, 4096, 5120, 6144, 8192, 12288)
DEPTHS = (12, 24, 32, 40, 48, 64, 80, 96)


def gpt_of(n_layer: int, n_embd: int) -> GPTConfig:
    """A GPT of the grid: heads of 128 (at least one), GPT-3's 2,048 positions, GPT-2's padded
    vocabulary."""
    n_head = max(1, n_embd // 128)
    return GPTConfig(
        n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=2048, vocab_size=50304
    )


def groups_by_formula(cfg: GPTConfig) -> list[list[int]]:
    """param_groups(cfg) without building the model (a 100B GPT's thousands of meta tensors
    take seconds): the matrices, then the biases and LayerNorm vectors, in model order."""
    C, V, T, L = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    matrices = [V * C, T * C, *[3 * C * C, C * C, 4 * C * C, 4 * C * C] * L]
    vectors = [*[C, C, 3 * C, C, C, C, 4 * C, C] * L, C, C]
    return [matrices, vectors]


def fits(ds: dict, groups, world: int, device_budget: float, cpu_budget: float) -> bool:
    """Does the model state fit: per rank on the device (resident partitions, persistent and
    gathered parameters, buffers), and in the node's CPU memory (every rank's together)?"""
    t = totals(predict(ds, groups, world))
    return t["device"] <= device_budget and t["cpu"] * world <= cpu_budget


def largest_fit(
    ds: dict,
    world: int,
    device_budget: float,
    cpu_budget: float = 1e12,
    widths=WIDTHS,
    depths=DEPTHS,
) -> GPTConfig | None:
    """The GPT of the grid (widths x depths) with the most parameters that fits both budgets."""
    best, best_n = None, 0
    for L in depths:
        for C in widths:
            groups = groups_by_formula(gpt_of(L, C))
            n = sum(map(sum, groups))
            if n > best_n and fits(ds, groups, world, device_budget, cpu_budget):
                best, best_n = gpt_of(L, C), n
    return best


# --- what bounds offload on one GPU: the links -------------------------------------------------

# one H200 SXM (or H100 SXM): its host link is PCIe Gen5 x16, 64 GB/s per direction on paper,
# ~55 GB/s measured by bandwidthTest-style copies from pinned memory; one PCIe Gen4 NVMe SSD:
# ~7 GB/s read, ~4 GB/s write (datasheets of current data-centre drives). Assumptions, named.
PCIE_GBS = 55.0
NVME_READ_GBS, NVME_WRITE_GBS = 7.0, 4.0
MFU = 0.4


def link_bytes(ds: dict, groups, world: int = 1) -> dict[str, float]:
    """Bytes one step moves over PCIe (each way) and NVMe, for one rank.

    offload_optimizer: the gradients go down (device -> CPU) and the updated parameters come
    back up. offload_param: every non-persistent parameter comes up for forward and stays to
    backward (_gathered); the update happens in CPU memory, so nothing else comes back.
    NVMe: predict's disk traffic."""
    pred = predict(ds, groups, world)
    e = 2 if (ds.get("bf16") or {}).get("enabled") else 4
    psi_r = sum(math.ceil(n / world) for g in groups for n in g) * e
    up = down = 0.0
    if offload_device(ds, "offload_optimizer") != "none":
        down += psi_r  # gradients
        up += 0.0 if offload_device(ds, "offload_param") != "none" else psi_r
    if offload_device(ds, "offload_param") != "none":
        up += pred["device"]["gathered"]  # fetched once, kept to backward (_gathered)
    return dict(up=up, down=down, nvme_read=pred["disk"]["read"], nvme_write=pred["disk"]["write"])


def bandwidth_table(models: dict[str, GPTConfig], tokens: int) -> str:
    """Per step on one H200, bf16: the seconds the links need beside the seconds of compute
    (at MFU of the dense peak) for `tokens` tokens, and the tokens per step at which the
    compute would hide the slowest link (overlapped perfectly)."""
    head = (
        f"{'model':<11}{'template':<10}{'PCIe up GB':>11}{'down GB':>9}{'NVMe r GB':>10}"
        f"{'w GB':>7}{'link s':>8}{'compute s':>10}{'tokens to hide':>16}"
    )
    lines = [head]
    for name, cfg in models.items():
        per_token = flops_per_token(cfg, cfg.block_size) / (MFU * PEAK_BF16_FLOPS["H200"])
        for t in TEMPLATES:
            ds = read(template_path(t))
            ds["bf16"] = {"enabled": True}
            b = link_bytes(ds, groups_by_formula(cfg))
            link = max(
                b["up"] / (PCIE_GBS * GB),
                b["down"] / (PCIE_GBS * GB),
                b["nvme_read"] / (NVME_READ_GBS * GB) + b["nvme_write"] / (NVME_WRITE_GBS * GB),
            )
            lines.append(
                f"{name:<11}{t:<10}{b['up'] / GB:>11.2f}{b['down'] / GB:>9.2f}"
                f"{b['nvme_read'] / GB:>10.2f}{b['nvme_write'] / GB:>7.2f}{link:>8.2f}"
                f"{per_token * tokens:>10.2f}{link / per_token:>16,.0f}"
            )
    return "\n".join(lines)


# --- the command line --------------------------------------------------------------------------


@dataclass
class Config:
    ds_config: str = ""  # a ds_config to check and explain (empty: the four templates)
    model: str = "gpt2-124m"  # dtl preset whose bytes are predicted
    world: int = 8  # ranks (GPUs) the config will run on
    fit_budget_gb: float = 80.0  # device memory per GPU for "the largest GPT that fits" (0: skip)
    cpu_budget_gb: float = 1000.0  # CPU memory of the node for the same question (DGX H100: 2 TB)
    out_dir: str = "outputs/day23_zero3_offload/explain"  # config.json

    def validate(self) -> None:
        if self.model not in PRESETS:
            raise dtl_config.ConfigError(f"unknown model '{self.model}'; {', '.join(PRESETS)}")
        if self.world < 1:
            raise dtl_config.ConfigError(f"world must be >= 1, got {self.world}")
        paths = [self.ds_config] if self.ds_config else [template_path(t) for t in TEMPLATES]
        try:
            for path in paths:
                check(read(path), self.world, nvme=False)  # the NVMe folder is the user's
        except DsConfigError as e:
            raise dtl_config.ConfigError(str(e)) from None


def explain(path: str, cfg: GPTConfig, world: int, name: str) -> str:
    ds = read(path)
    groups = param_groups(cfg)
    pred = predict(ds, groups, world)
    sizes = [n for g in groups for n in g]
    cpu, gpu = deepspeed_estimate(ds, sizes, world)
    t = totals(pred)
    return (
        f"{os.path.basename(path)}: {name}, {sum(sizes):,} parameters, {world} ranks\n"
        f"{table(pred)}\n"
        f"  per rank: device {t['device'] / GB:.3f} GB, CPU {t['cpu'] / GB:.3f} GB, NVMe "
        f"{t['nvme'] / GB:.3f} GB; DeepSpeed's estimator: device {gpu / GB:.3f} GB per GPU, "
        f"CPU {cpu / GB:.3f} GB per node (mixed precision, 1.5x buffers)"
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    dtl_dist.init()
    dtl_config.save(cfg, cfg.out_dir, argv)
    model = PRESETS[cfg.model]
    paths = [cfg.ds_config] if cfg.ds_config else [template_path(t) for t in TEMPLATES]
    for path in paths:
        dtl_dist.print0(explain(path, model, cfg.world, cfg.model))
    if cfg.fit_budget_gb:
        for path in paths:
            best = largest_fit(
                read(path), cfg.world, cfg.fit_budget_gb * GB, cfg.cpu_budget_gb * GB
            )
            what = (
                f"{best.n_layer} layers x {best.n_embd} wide, "
                f"{sum(map(sum, groups_by_formula(best))) / 1e9:.1f} B parameters"
                if best
                else "none of the grid"
            )
            dtl_dist.print0(
                f"summary: largest GPT whose model state fits {cfg.fit_budget_gb:.0f} GB per "
                f"device x {cfg.world} and {cfg.cpu_budget_gb:.0f} GB of CPU with "
                f"{os.path.basename(path)}: {what}"
            )
    from day22_megatron.plan import MODELS as PLAN_MODELS  # the 6.6B GPT of day 22's plan

    models = {"gpt2-124m": PRESETS["gpt2-124m"], "gpt-6.6b": PLAN_MODELS["gpt-6.6b"]}
    tokens = 2 * 1024 * 16  # the templates' micro-batch of 2, x16 accumulation, s = 1024
    dtl_dist.print0(
        f"one H200, bf16, per step of {tokens:,} tokens: the links (PCIe {PCIE_GBS:.0f} GB/s "
        f"each way, NVMe {NVME_READ_GBS:.0f}/{NVME_WRITE_GBS:.0f} GB/s) vs compute at "
        f"{MFU:.0%} MFU\n{bandwidth_table(models, tokens)}"
    )
    dtl_dist.print0(
        f"summary: day23 explain {len(paths)} config(s) checked for {cfg.world} ranks: ok"
    )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
