"""Day 23: where a running DeepSpeed ZeRO-3 engine keeps its bytes, read from the engine itself.

    where = locations(engine)      # {"device": {...}, "cpu": {...}, "nvme": {...}}, bytes by kind
    before = io_bytes(); step(); after = io_bytes()   # bytes this process read and wrote on disk

Each kind of state and the attribute of DeepSpeed 0.19's stage3.py / swapper it is read from:

    params     each parameter's partition `p.ds_tensor` (ds_numel elements), on the device;
               with offload_param the optimizer's flat pinned CPU buffers
               `param_groups_fp16_flat_cpu_memory` (NVMe: up to max_in_cpu elements) and any
               partition outside them that is too small to swap; a parameter with
               `ds_persist` (numel <= stage3_param_persistence_threshold) is also kept whole on
               every rank's device
    grads      `optimizer.grad_partitions_flat_buffer`, on the optimizer's `device` (the CPU with
               offload_optimizer)
    optim      the fp32 partitions `fp32_partitioned_groups_flat` (the master copy) and Adam's
               exp_avg / exp_avg_sq for each, where the optimizer keeps them (the CPU with
               offload_optimizer); a sub-group swapped to NVMe releases its tensors between
               steps: its bytes are its swap files
    gathered   the most parameter elements held full at once during the steps (PeakGathered)
    buffers    the gradient-reduction bucket (device); the pinned bounce buffers the NVMe
               swappers read into and write from (CPU)
    nvme       the bytes of this rank's files under nvme_path/zero_stage_3, by folder and name
               (os.stat: what is on disk); a parameter with a swap path is counted there only

On a CPU-only machine "device" and "cpu" are the same RAM: the split is DeepSpeed's own
bookkeeping (which tensor it placed where, by the rules above); on a GPU machine the same
attributes point at real GPU and host tensors. NVMe bytes are always real files.
"""

from __future__ import annotations

import os
import shutil

import torch

from day23_zero3_offload.predict import KINDS, LOCATIONS  # one table of where and what
from dtl.state import nbytes


def _empty() -> dict[str, dict[str, int]]:
    return {loc: dict.fromkeys(KINDS, 0) for loc in LOCATIONS}


def swap_folder(engine) -> str | None:
    """nvme_path/zero_stage_3 of this run, or None without NVMe offload."""
    for section in (engine.zero_offload_param(), engine.zero_offload_optimizer()):
        if section is not None and section.device == "nvme" and section.nvme_path:
            return os.path.join(str(section.nvme_path), "zero_stage_3")
    return None


def clear_swap_files(ds: dict, rank: int) -> None:
    """Remove this rank's swap files left in the ds_config's nvme_path by an earlier run (another
    model or template writes other file names, and swap_files would count them too). DeepSpeed
    writes them afresh when the engine is built; call it before."""
    zero = ds.get("zero_optimization", {})
    for section in ("offload_param", "offload_optimizer"):
        conf = zero.get(section) or {}
        if conf.get("device") != "nvme" or not conf.get("nvme_path"):
            continue
        folder = os.path.join(str(conf["nvme_path"]), "zero_stage_3")
        for root, dirs, _ in os.walk(folder):
            if f"rank{rank}" in dirs:
                shutil.rmtree(os.path.join(root, f"rank{rank}"), ignore_errors=True)


def swap_files(folder: str | None, rank: int) -> dict[str, int]:
    """Bytes on disk of this rank's swap files, by kind: `<dtype>params/rank<R>/*` are parameter
    partitions, `optimizer/rank<R>/*_gradient_*` gradients, the other optimizer files the fp32
    master partitions and Adam's exp_avg / exp_avg_sq (one file per sub-group each)."""
    out = dict.fromkeys(KINDS, 0)
    if not folder or not os.path.isdir(folder):
        return out
    for root, _, files in os.walk(folder):
        if os.path.basename(root) != f"rank{rank}":
            continue
        kind_of_folder = os.path.basename(os.path.dirname(root))
        for f in files:
            size = os.path.getsize(os.path.join(root, f))
            if kind_of_folder.endswith("params"):
                out["params"] += size
            elif "_gradient_" in f:
                out["grads"] += size
            else:
                out["optim"] += size
    return out


def locations(engine, rank: int, peak: PeakGathered | None = None) -> dict[str, dict[str, int]]:
    """This rank's bytes by location and kind, read from the engine and the disk (module top);
    `peak`, if it watched the steps, gives the gathered parameters' high-water mark."""
    opt = engine.optimizer
    out = _empty()
    out["device"]["buffers"] += reduce_buffer_bytes(engine)
    swapper = _param_swapper(engine)
    on_disk = set(swapper.id_to_path) if swapper is not None else set()
    if opt.offload_param:
        # ZeRO-3 moves the partitions into flat pinned CPU buffers (up to max_in_cpu elements
        # with NVMe); a partition outside them lives alone: in CPU memory if too small to swap,
        # else only in its swap file (and, while in use, in a swap buffer)
        flats = [t for t in opt.param_groups_fp16_flat_cpu_memory if t.numel() > 1]
        out["cpu"]["params"] += sum(nbytes(t) for t in flats)
        for p in engine.module.parameters():
            if not _inside(p.ds_tensor, flats) and p.ds_id not in on_disk:
                out["cpu"]["params"] += p.ds_tensor.ds_numel * p.ds_tensor.element_size()
    else:
        out["device"]["params"] += sum(
            p.ds_tensor.ds_numel * p.ds_tensor.element_size() for p in engine.module.parameters()
        )
    for p in engine.module.parameters():
        if p.ds_persist:  # small enough to stay whole on every rank, never gathered
            out["device"]["persistent"] += p.ds_numel * p.ds_tensor.element_size()
    if peak is not None:
        out["device"]["gathered"] = peak.peak * next(engine.module.parameters()).element_size()
    opt_home = "cpu" if opt.offload_optimizer else "device"
    out[opt_home]["grads"] += nbytes(opt.grad_partitions_flat_buffer)
    # the fp32 master partitions and Adam's state that are in memory (a swapped sub-group's are
    # released between steps: they are the optimizer's swap files)
    state = [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    masters = sum(nbytes(t) for t in opt.fp32_partitioned_groups_flat)
    out[opt_home]["optim"] += masters + sum(nbytes(t) for t in state if t.dim() > 0)
    if opt.swap_optimizer:
        manager = opt.optimizer_swapper.swap_buffer_manager
        out["cpu"]["buffers"] += sum(nbytes(b) for b in manager.all_buffers)
    if swapper is not None:
        out["cpu"]["buffers"] += nbytes(swapper.buffers)
    out["nvme"] = swap_files(swap_folder(engine), rank)
    return out


def _inside(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    """Is `t`'s memory part of one of `buffers` (a view into a flat buffer)?"""
    if t.numel() == 0:
        return False
    start = t.data_ptr()
    return any(b.data_ptr() <= start < b.data_ptr() + nbytes(b) for b in buffers)


def _param_swapper(engine):
    """The parameter swapper ZeRO-3 attaches to every parameter with params on NVMe."""
    for p in engine.module.parameters():
        if getattr(p, "nvme_swapper", None) is not None:
            return p.nvme_swapper
    return None


def io_bytes() -> dict[str, int]:
    """Bytes this process has read from and written to storage so far (Linux /proc/self/io:
    read_bytes / write_bytes count block I/O, which DeepSpeed's O_DIRECT aio always is)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
    except OSError:
        return {"read": 0, "write": 0}
    return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}


class PeakGathered:
    """The most elements of non-persistent parameters held full (gathered) at once, sampled
    after every module's forward pre-hook (DeepSpeed's fetch for the module runs first) and
    after its backward: the sum of `ds_numel` over the parameters whose `ds_status` is
    AVAILABLE. (DeepSpeed's coordinator keeps a counter of its own, `__n_available_params`, but
    it also counts persistent parameters, and not consistently across steps.)"""

    def __init__(self, engine):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self._available = ZeroParamStatus.AVAILABLE
        self._params = [p for p in engine.module.parameters() if not p.ds_persist]
        self.peak = 0
        self.handles = []
        for m in engine.module.modules():
            self.handles.append(m.register_forward_pre_hook(lambda *_: self._sample()))
            self.handles.append(m.register_full_backward_hook(lambda *_: self._sample()))

    def _sample(self) -> None:
        now = sum(p.ds_numel for p in self._params if p.ds_status == self._available)
        self.peak = max(self.peak, now)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def reduce_buffer_bytes(engine) -> int:
    """The contiguous gradient-reduction buckets (reduce_bucket_size elements each, with
    contiguous_gradients), on the device."""
    buckets = engine.optimizer.ipg_buckets.values()
    return sum(nbytes(getattr(b, "buffer", None)) for b in buckets)
