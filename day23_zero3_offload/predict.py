"""Day 23: where every byte of a ZeRO-3 (offload) run's training state will live, per rank:
device, CPU memory, NVMe; the largest GPT a budget fits; the links that bound offload.

The prediction, per rank, for a model of parameters n_i, N ranks, parameter bytes e (4 fp32,
2 bf16), each partition ceil(n_i / N) elements (ZeRO-3 pads every parameter on its own), and
the rules of DeepSpeed 0.19's stage3.py and swappers (measure.py reads the same places):

    gathered     the peak of full parameters held at once (device): what DeepSpeed's release
                 (reuse distance) and prefetch (live parameters) rules leave, at most every
                 non-persistent one; every one for the models a CPU runs (_gathered)
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

import math

from day23_zero3_offload.checks import (
    AIO_ALIGN,
    AIO_BLOCK_DEFAULT,
    MIN_AIO_BYTES,
    TEMPLATES,
    offload_device,
    read,
    template_path,
)
from dtl.exercise_seam import exercise
from dtl.model import GPT, GPTConfig, flops_per_token
from dtl.precision import PRECISIONS

GB, MiB = 1e9, 1024**2
LOCATIONS = ("device", "cpu", "nvme")
KINDS = ("params", "persistent", "gathered", "grads", "optim", "buffers")

H200_BF16_FLOPS = PRECISIONS["bf16"].peak_flops("H200")  # dense, dtl.precision


# --- the prediction --------------------------------------------------------------------------


def param_groups(cfg: GPTConfig) -> list[list[int]]:
    """The element counts of every parameter, in the optimizer groups train.py gives DeepSpeed
    (dtl.optim.optimizer_groups: the matrices, then biases and norms), a tied weight once."""
    import torch

    from dtl.optim import optimizer_groups

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


def element_bytes(ds: dict) -> int:
    """Bytes of a parameter element as the engine holds it: 2 in bf16, else 4."""
    return 2 if (ds.get("bf16") or {}).get("enabled") is True else 4


def persistence_threshold(zero: dict) -> int:
    """Parameters of at most this many elements stay whole on every rank (never gathered)."""
    return zero.get("stage3_param_persistence_threshold", 100_000)


@exercise("day23.bytes_per_location")
def predict(ds: dict, groups: list[list[int]], world: int) -> dict[str, dict[str, float]]:
    """This rank's bytes by location and kind, from the config and the parameter groups: the
    module top's table, rule by rule."""
    zero = ds.get("zero_optimization", {})
    e = element_bytes(ds)
    parts = [[math.ceil(n / world) for n in g] for g in groups]  # each parameter's partition
    flat = [k for g in parts for k in g]  # every partition's elements, k_i = ceil(n_i / N)
    subs = [s for g in parts for s in _sub_groups(g, zero.get("sub_group_size", 1_000_000_000))]
    out = {loc: dict.fromkeys(KINDS, 0.0) for loc in LOCATIONS}
    threshold = persistence_threshold(zero)
    param_dev, opt_dev = (
        offload_device(ds, "offload_param"),
        offload_device(ds, "offload_optimizer"),
    )  # "none", "cpu" or "nvme"
    min_aio = max(MIN_AIO_BYTES, (ds.get("aio") or {}).get("block_size", AIO_BLOCK_DEFAULT))
    swappable = lambda k, size=e: k * size >= min_aio  # noqa: E731  (k elements of `size` bytes)
    # Each kind's partitions at its home: the parameters (e bytes an element) where
    # offload_param puts them; the gradients (e bytes) and the fp32 master, m and v (12 bytes)
    # where offload_optimizer does; "nvme" keeps them in CPU memory, less what the drive takes:
    # the parameter partitions large enough to swap, and the optimizer's large enough
    # sub-groups (`subs`), three 1 KiB-aligned files each. A parameter of at most `threshold`
    # elements is also whole on every device.
    # exercise day23.bytes_per_location: begin
    param_home = "device" if param_dev == "none" else "cpu"
    opt_home = "device" if opt_dev == "none" else "cpu"
    out[param_home]["params"] = sum(flat) * e
    out[opt_home]["grads"] = sum(flat) * e
    out[opt_home]["optim"] = 12 * sum(flat)
    out["device"]["persistent"] = sum(n * e for g in groups for n in g if n <= threshold)
    if param_dev == "nvme":
        out["nvme"]["params"] = sum(k * e for k in flat if swappable(k))  # written at start
    if opt_dev == "nvme":
        out["nvme"]["optim"] = 3 * sum(_aligned(sum(s) * 4) for s in subs if swappable(sum(s), 4))
        out["cpu"]["optim"] = 12 * sum(sum(s) for s in subs if not swappable(sum(s), 4))
    # exercise day23.bytes_per_location: end
    out["device"]["gathered"] = _gathered(zero, [n for g in groups for n in g if n > threshold]) * e
    if zero.get("contiguous_gradients", True):  # the gradient-reduction bucket, preallocated
        out["device"]["buffers"] += zero.get("reduce_bucket_size", 500_000_000) * e
    paged = 0.0
    if param_dev == "nvme":  # beyond max_in_cpu, a swappable partition lives on the drive only
        section = zero["offload_param"]
        in_cpu = _cpu_resident(parts, subs, section.get("max_in_cpu", 1_000_000_000))
        paged_subs = [s for s, resident in zip(subs, in_cpu) if not resident]
        paged = sum(k * e for s in paged_subs for k in s if swappable(k))
        out["cpu"]["params"] = sum(
            k * e for s, r in zip(subs, in_cpu) for k in s if r or not swappable(k)
        )
        count, size = section.get("buffer_count", 5), section.get("buffer_size", 100_000_000)
        out["cpu"]["buffers"] += count * _aligned(size * e)
    read = write = paged  # parameters beyond max_in_cpu: in for forward, out after the update
    if opt_dev == "nvme":
        on_disk = [sum(s) for s in subs if swappable(sum(s), 4)]
        out["nvme"]["grads"] = (
            sum(k * 4 for k in flat if swappable(k)) if param_dev == "nvme" else 0
        )
        count = zero["offload_optimizer"].get("buffer_count", 4)
        out["cpu"]["buffers"] += count * _aligned(max(on_disk, default=0) * 4)
        params_in = out["nvme"]["params"]
        read += params_in + out["nvme"]["optim"]  # the step swaps its sub-groups in
        write += out["nvme"]["grads"] + out["nvme"]["optim"]
    out["disk"] = {"read": read, "write": write}
    return out


def _gathered(zero: dict, sizes: list[int]) -> int:
    """Peak elements ZeRO-3 holds gathered (full) at once. `sizes`: the non-persistent
    parameters in forward order (the GPT's: wte first, which the tied head uses again last).

    Two rules of DeepSpeed's coordinator (partitioned_param_coordinator.py) set it:
    - release: after a module runs, a parameter stays gathered if the module trace uses it
      again within stage3_max_reuse_distance elements (__params_to_release); `_retained` replays
      the trace (forward, then backward in reverse) and returns the peak this rule leaves;
    - prefetch: upcoming parameters are gathered ahead while fewer than
      stage3_max_live_parameters elements are available (__prefetch ... max_params_to_prefetch).
      The loop adds a parameter while it has room left, so it may overshoot by the last one.
    So the peak is at most the larger of the two, and never more than every parameter: an upper
    bound. For the small models this machine runs, nothing is ever released (the whole trace is
    shorter than the reuse distance): every parameter stays gathered, as the tests measure. From
    about a billion parameters on, the rules bind: day 23's scale.py simulates DeepSpeed at
    29-59 B and finds the peak at 0.64-0.91 x max_live_parameters (1e9 in the templates; the
    lower end on the 12,288-wide models), and where the cap is below the release rule's peak,
    exactly that peak (tests/test_day23_scale.py).
    The release rule's trace counts the non-persistent parameters only (a persistent one is
    under the threshold, 1e5 elements, against distances of 1e9)."""
    reuse = zero.get("stage3_max_reuse_distance", 1_000_000_000)
    live = zero.get("stage3_max_live_parameters", 1_000_000_000)
    if not sizes:
        return 0
    return min(sum(sizes), max(_retained(sizes, reuse), live + max(sizes)))


def _retained(sizes: list[int], reuse: float) -> int:
    """The peak the release rule alone leaves: one module per parameter, the trace forward (the
    tied head reuses parameter 0 at its end), then backward in reverse."""
    forward = list(range(len(sizes))) + [0]  # parameter ids in the order modules use them
    trace = forward + forward[::-1]
    held: set[int] = set()
    peak = 0
    for step, pid in enumerate(trace):
        held.add(pid)
        peak = max(peak, sum(sizes[i] for i in held))
        ahead, seen = 0, set()
        for nxt in trace[step + 1 :]:  # reused within the distance: kept
            if ahead >= reuse:
                break
            seen.add(nxt)
            ahead += sizes[nxt]
        if pid not in seen:
            held.discard(pid)
    return peak


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
SEQ_LEN = 1024  # tokens per sequence in the link table's step, for both models


def step_tokens(ds: dict, seq_len: int = SEQ_LEN) -> int:
    """Tokens one optimizer step of `ds` trains on one GPU: micro-batch x accumulation x s."""
    return ds["train_micro_batch_size_per_gpu"] * ds.get("gradient_accumulation_steps", 1) * seq_len


@exercise("day23.link_time")
def link_bytes(ds: dict, groups, world: int = 1) -> dict[str, float]:
    """Bytes one step moves over PCIe (each way) and NVMe, for one rank.

    offload_optimizer: the gradients go down (device -> CPU) and the updated parameters come
    back up. offload_param: every non-persistent parameter comes up for forward and stays to
    backward (_gathered); the update happens in CPU memory, so nothing else comes back.
    NVMe: predict's disk traffic."""
    pred = predict(ds, groups, world)
    e = 2 if (ds.get("bf16") or {}).get("enabled") is True else 4
    psi_r = sum(math.ceil(n / world) for g in groups for n in g) * e
    up = down = 0.0  # bytes over PCIe: up = CPU -> device, down = device -> CPU
    # exercise day23.link_time: begin
    if offload_device(ds, "offload_optimizer") != "none":
        down += psi_r  # gradients
        up += 0.0 if offload_device(ds, "offload_param") != "none" else psi_r
    if offload_device(ds, "offload_param") != "none":
        up += pred["device"]["gathered"]  # fetched once, kept to backward (_gathered)
    # exercise day23.link_time: end
    return dict(up=up, down=down, nvme_read=pred["disk"]["read"], nvme_write=pred["disk"]["write"])


@exercise("day23.link_time")
def bandwidth_table(models: dict[str, GPTConfig], seq_len: int = SEQ_LEN) -> str:
    """Per step on one H200, bf16: the seconds the links need beside the seconds of compute
    (at MFU of the dense peak) for the template's own step (`step_tokens`: its micro-batch and
    accumulation, sequences of `seq_len` tokens, the attention FLOPs at that length), and the
    tokens per step at which the compute would hide the slowest link (overlapped perfectly)."""
    head = (
        f"{'model':<11}{'template':<10}{'PCIe up GB':>11}{'down GB':>9}{'NVMe r GB':>10}"
        f"{'w GB':>7}{'link s':>8}{'compute s':>10}{'tokens to hide':>16}"
    )
    lines = [head]
    for name, cfg in models.items():
        per_token = flops_per_token(cfg, seq_len) / (MFU * H200_BF16_FLOPS)
        for t in TEMPLATES:
            ds = read(template_path(t))
            tokens = step_tokens(ds, seq_len)
            ds["bf16"] = {"enabled": True}
            b = link_bytes(ds, groups_by_formula(cfg))
            # the link's seconds (PCIe carries both directions at once; the drive reads, then
            # writes), and the tokens whose compute (per_token seconds each) lasts as long
            # exercise day23.link_time: begin
            link = max(
                b["up"] / (PCIE_GBS * GB),
                b["down"] / (PCIE_GBS * GB),
                b["nvme_read"] / (NVME_READ_GBS * GB) + b["nvme_write"] / (NVME_WRITE_GBS * GB),
            )
            hide = link / per_token
            # exercise day23.link_time: end
            lines.append(
                f"{name:<11}{t:<10}{b['up'] / GB:>11.2f}{b['down'] / GB:>9.2f}"
                f"{b['nvme_read'] / GB:>10.2f}{b['nvme_write'] / GB:>7.2f}{link:>8.2f}"
                f"{per_token * tokens:>10.3f}{hide:>16,.0f}"
            )
    return "\n".join(lines)
