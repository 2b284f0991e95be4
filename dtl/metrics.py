"""One stable log line per step, TensorBoard scalars, MFU against the peak of dtl.precision's table.

    step 12/100 | loss 3.2145 | lr 6.0e-04 | grad_norm 0.91 | 120 ms | 8,533 tok/s | mfu 41.2%

Only rank 0 prints, writes `log.txt` and the TensorBoard event files (`<out_dir>/tb/`); on other
ranks the logger is silent, so training loops never need `if rank == 0` around logging.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import TYPE_CHECKING, Any

import torch

from dtl.dist import get_rank
from dtl.precision import PRECISIONS
from dtl.profile import StepTimes

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm


def peak_flops(device: torch.device | str | None = None, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of `device` computing in `precision` (dtl.precision's table); None where
    the table has none (CPUs, an unlisted GPU). DTL_PEAK_TFLOPS overrides."""
    if os.environ.get("DTL_PEAK_TFLOPS"):
        return float(os.environ["DTL_PEAK_TFLOPS"]) * 1e12
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return PRECISIONS[precision].peak_flops(torch.cuda.get_device_name(device))


def mfu(
    flops_per_token: float, tokens_per_s: float, peak_per_device: float | None, n_devices: int = 1
) -> float | None:
    """Model FLOPs utilization = achieved model FLOP/s / (peak FLOP/s x devices)."""
    if not peak_per_device:
        return None
    return flops_per_token * tokens_per_s / (peak_per_device * n_devices)


def matches_formula(measured: float, predicted: float, rel: float = 1e-9) -> bool:
    """A counted figure (bytes held, bytes sent) equals its formula: equal up to float rounding."""
    return abs(measured - predicted) <= rel * max(abs(predicted), 1.0)


def memory_stats(device: torch.device | str | None = None) -> dict[str, float]:
    """Peak memory in MiB: CUDA allocator peaks on a GPU, process peak RSS on the CPU."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return {
            "max_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "max_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    return {"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def write_csv(rows: list[dict[str, Any]], path: str, fields: list[str] | None = None) -> None:
    """A table as CSV: one row per dict, the columns `fields` (default: the first row's keys;
    keys a row has beyond them are left out)."""
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or list(rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def format_step(
    step: int,
    total: int,
    *,
    loss: float | None = None,
    lr: float | None = None,
    grad_norm: float | None = None,
    dt_s: float | None = None,
    tokens_per_s: float | None = None,
    mfu_value: float | None = None,
    show_mfu: bool = False,
    unit: str = "tok",
    **extra: object,
) -> str:
    parts = [f"step {step}/{total}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if lr is not None:
        parts.append(f"lr {lr:.1e}")
    if grad_norm is not None:
        parts.append(f"grad_norm {grad_norm:.2f}")
    if dt_s is not None:
        parts.append(f"{dt_s * 1000:.0f} ms")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} {unit}/s")
    if show_mfu or mfu_value is not None:
        parts.append(f"mfu {mfu_value:.1%}" if mfu_value is not None else "mfu n/a")
    parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items()]
    return " | ".join(parts)


def _times_fields(t: StepTimes) -> dict[str, str]:
    fields = {
        "fwd_ms": f"{t.forward_ms:.0f}",
        "bwd_ms": f"{t.backward_ms:.0f}",
        "blocked_ms": f"{t.blocked_ms:.0f}",
    }
    if t.comm_ms is not None:
        fields["comm_ms"] = f"{t.comm_ms:.0f}"
    if t.overlap is not None:
        fields["overlap"] = f"{t.overlap:.0%}"
    return fields


class StepLogger:
    """Prints the step line, appends it to log.txt and writes TensorBoard scalars (rank 0)."""

    def __init__(
        self,
        out_dir: str,
        total_steps: int,
        *,
        tokens_per_step: int | None = None,
        flops_per_token: float | None = None,
        peak_flops_per_device: float | None = None,
        n_devices: int = 1,
        tensorboard: bool = True,
        progress: bool | None = None,
        unit: str = "tok",
    ):
        self.enabled = get_rank() == 0
        self.total = total_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_device
        self.n_devices = n_devices
        self.unit = unit  # what tokens_per_step counts: "tok" for LMs, "img" for MNIST
        self.writer: SummaryWriter | None = None
        self.bar: tqdm | None = None
        self.log_path = os.path.join(out_dir, "log.txt")
        if not self.enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        open(self.log_path, "w").close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(out_dir, "tb"))
        if progress if progress is not None else (sys.stderr.isatty() and total_steps >= 200):
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, leave=False, dynamic_ncols=True)

    def log(
        self,
        step: int,
        *,
        loss: float | None = None,
        lr: float | None = None,
        grad_norm: float | None = None,
        dt_s: float | None = None,
        times: StepTimes | None = None,
        print_line: bool = True,
        **extra: object,
    ) -> str:
        """One step: the line (printed and in log.txt) and TensorBoard scalars. `times`, a
        dtl.profile.StepTimes, sets dt_s when it is not given, adds its breakdown to the line and
        writes it under time/... (forward_ms, backward_ms, blocked_ms, optimizer_and_rest_ms)."""
        if times is not None:
            dt_s = dt_s if dt_s is not None else times.step_ms / 1e3
            extra = {**_times_fields(times), **extra}
        tok_s = self.tokens_per_step / dt_s if (self.tokens_per_step and dt_s) else None
        mfu_value = (
            mfu(self.flops_per_token, tok_s, self.peak, self.n_devices)
            if (tok_s and self.flops_per_token)
            else None
        )
        line = format_step(
            step,
            self.total,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            dt_s=dt_s,
            tokens_per_s=tok_s,
            mfu_value=mfu_value,
            show_mfu=self.flops_per_token is not None,
            unit=self.unit,
            **extra,
        )
        if not self.enabled:
            return line
        if self.bar is not None:
            self.bar.update(1)
        self._emit(line, print_line)
        scalars = {
            "loss/train": loss,
            "opt/lr": lr,
            "opt/grad_norm": grad_norm,
            "perf/step_ms": dt_s and dt_s * 1000,
            f"perf/{self.unit}_per_s": tok_s,
            "perf/mfu": mfu_value,
            **{f"extra/{k}": v for k, v in extra.items()},
            **(times.scalars() if times is not None else {}),
        }
        self.scalars(step, {k: v for k, v in scalars.items() if isinstance(v, (int, float))})
        return line

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, float(value), step)

    def info(self, line: str) -> None:
        """A free-form line: printed and logged on rank 0."""
        if self.enabled:
            self._emit(line, True)

    def _emit(self, line: str, print_line: bool) -> None:
        with open(self.log_path, "a") as f:
            f.write(line + "\n")
        if print_line and self.bar is not None:
            self.bar.write(line)
        elif print_line:
            print(line, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
