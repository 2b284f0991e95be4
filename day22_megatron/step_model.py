"""Day 22's step-time model, its assumptions stated as inputs (plan.py, and day 28's compare.py).

    step      = compute / (1 - bubble) + critical + exposed
    compute   = FLOPs per GPU / (mfu x peak)     peak: H100 SXM dense bf16 (dtl.precision)
    critical  TP's and PP's traffic / link       on the critical path: nothing else runs
    exposed   t - min(overlap x t, compute)      t: ZeRO-3's or DP's collectives / link; the
                                                 `overlap` share of them runs beside compute
    link      NVLink inside a node, InfiniBand across (GB/s per direction per GPU)

overlap = 1 is the course's model since day 17 (DDP's bucketed all-reduce, ZeRO-3's prefetched
all-gathers): every collective hidden until it takes longer than the compute beside it; 0 is a
run that overlaps nothing. A model, stated as one: no GPU here has checked its step times.

`ClusterConfig` holds the Config fields both scripts share (the cluster, the memory a run may
fill, the step model's inputs), so `--ib_gbs=25` means the same on either command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from day19_tp.formulas import IB_NDR_GBS, NVLINK_H100_GBS
from dtl.config import POSITIVE, Range
from dtl.precision import PRECISIONS

GB = 1e9
H100_BF16_FLOPS = PRECISIONS["bf16"].peak_flops("H100")  # dense, dtl.precision

# The share of an 80 GB GPU that predicted tensors may fill. The rest goes to the CUDA context,
# NCCL buffers and kernel workspaces (~3 GiB on an H100: NVIDIA-NeMo/Nemotron, "Post-Training
# GPU Memory Estimation: Nemotron 3 Nano", framework overhead) and to the caching allocator's
# fragmentation: 9.2 GB on average, up to 25 GB, across eight LLMs trained with DeepSpeed, FSDP
# and Colossal-AI on A100-80GB (Guo et al. 2024, GMLake, ASPLOS '24, arXiv 2401.08156, abstract).
# (80 - 3.2 - 9.2) / 80 = 0.845. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True wins back most
# of the fragmentation (Megatron-Bridge's memory-tuning guide): --usable_memory_fraction=0.9.
USABLE_MEMORY_FRACTION = 0.85


@dataclass(frozen=True)
class StepModel:
    mfu: float = 0.4  # the share of the dense bf16 peak the matmuls reach
    nvlink_gbs: float = NVLINK_H100_GBS  # inside a node
    ib_gbs: float = IB_NDR_GBS  # across nodes: one 400 Gb/s port per GPU
    overlap: float = 1.0  # the share of ZeRO-3's / DP's traffic that may run beside compute
    peak_flops: float = H100_BF16_FLOPS

    def compute_s(self, flops: float) -> float:
        return flops / (self.mfu * self.peak_flops)

    def link_s(self, nbytes: float, inside_node: bool) -> float:
        return nbytes / ((self.nvlink_gbs if inside_node else self.ib_gbs) * GB)

    def exposed_s(self, comm_s: float, compute_s: float) -> float:
        """What of `comm_s` seconds of overlappable traffic the step waits for."""
        return comm_s - min(self.overlap * comm_s, compute_s)

    def step_s(
        self,
        compute_s: float,
        bubble: float = 0.0,
        critical_s: float = 0.0,
        overlappable_s: float = 0.0,
    ) -> float:
        return compute_s / (1 - bubble) + critical_s + self.exposed_s(overlappable_s, compute_s)


@dataclass
class ClusterConfig:
    """Config fields of the scripts that plan for a cluster (a base of their Config)."""

    gpus_per_node: int = 8  # NVLink inside a node, InfiniBand across; TP stays inside one
    gpu_memory_gb: float = 80.0  # H100 SXM
    # the share of it predicted tensors may fill; the rest: CUDA context, NCCL, fragmentation
    usable_memory_fraction: Annotated[float, Range(lo=0, hi=1, lo_open=True)] = (
        USABLE_MEMORY_FRACTION
    )
    mfu: float = StepModel.mfu  # assumed share of the dense bf16 peak the matmuls reach
    nvlink_gbs: Annotated[float, POSITIVE] = StepModel.nvlink_gbs  # GB/s per GPU inside a node
    ib_gbs: Annotated[float, POSITIVE] = StepModel.ib_gbs  # GB/s per GPU across nodes
    # the share of ZeRO-3's / DP's collectives that may overlap compute (1: all, up to its time)
    overlap_fraction: float = StepModel.overlap

    @property
    def usable_gb(self) -> float:
        return self.gpu_memory_gb * self.usable_memory_fraction

    def step_model(self) -> StepModel:
        return StepModel(
            mfu=self.mfu,
            nvlink_gbs=self.nvlink_gbs,
            ib_gbs=self.ib_gbs,
            overlap=self.overlap_fraction,
        )
