"""Day 17: the one place that reads torch DDP's private logging, behind a version check.

torch's DistributedDataParallel records what its C++ Reducer did: the bucket layout after the
rebuild, and the backward compute / communication instants of sampled iterations. The lesson
reads them to put DDP's numbers beside the hand-written syncs'. They are private APIs:
    model._get_ddp_logging_data()                 dict of everything the Reducer logged
    model._set_ddp_runtime_logging_sample_rate(n) time every n-th iteration (default 100)
    model.logger.set_runtime_stats_and_log()      copy the last timings in now, not next forward
Written against torch 2.4-2.13. If a later torch renames or drops one of them, every caller gets
the same one-line error naming the call and the torch version, not an AttributeError deep inside
a training step.
"""

from __future__ import annotations

import torch

TESTED = ((2, 4), (2, 13))  # oldest and newest torch (major, minor) this file was checked with


class DDPInternalsChanged(RuntimeError):
    """torch changed a private DDP API the lesson reads; the message is one line."""


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _call(what: str, fn, *args):
    try:
        return fn(*args)
    except (AttributeError, TypeError, KeyError) as e:
        lo, hi = TESTED
        raise DDPInternalsChanged(
            f"torch {torch.__version__} changed DDP's private {what} ({type(e).__name__}: {e}); "
            f"day 17 reads it as torch {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]} define it"
        ) from None


def is_torch_ddp(model) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def time_every_iteration(model) -> None:
    """Make the Reducer time every iteration (its default samples one in 100)."""
    name = "_set_ddp_runtime_logging_sample_rate"
    _call(name, lambda: getattr(model, name)(1))


def logging_data(model, refresh: bool = False) -> dict:
    """The Reducer's logging dict; `refresh` first copies the last backward's timings into it
    (DDP does that itself only at the next forward)."""
    if refresh:
        _call("logger.set_runtime_stats_and_log", lambda: model.logger.set_runtime_stats_and_log())
    return _call("_get_ddp_logging_data", lambda: model._get_ddp_logging_data())


def comm_times_s(model) -> dict[str, float]:
    """compute_end, comm_start, comm_end of the last backward, seconds (the Reducer's CPU timer)."""
    log = logging_data(model, refresh=True)
    keys = ("backward_compute_time_end", "backward_comm_time_start", "backward_comm_time_end")
    values = _call("timing keys", lambda: [log[k] / 1e9 for k in keys])
    return dict(zip(("compute_end", "comm_start", "comm_end"), values))


def rebuilt_buckets(model) -> tuple[list[int], list[list[int]]] | None:
    """(bytes per bucket, parameter indices per bucket) after the rebuild, in launch order; None
    when DDP never rebuilt (find_unused_parameters=True keeps the initial layout)."""
    log = logging_data(model)
    if "rebuilt_bucket_sizes" not in log:
        return None
    sizes = [int(s) for s in str(log["rebuilt_bucket_sizes"]).split(",")]
    indices = [
        [int(i) for i in group.split()]
        for group in str(log["rebuilt_per_bucket_param_indices"]).split(",")
    ]
    return sizes, indices


def initial_bucket_sizes(model) -> list[int]:
    return [int(s) for s in str(logging_data(model)["bucket_sizes"]).split(",")]


def check_version() -> str | None:
    """A one-line warning when this torch is outside the tested range, else None."""
    lo, hi = TESTED
    if not lo <= _torch_version() <= hi:
        return (
            f"warning: torch {torch.__version__} is outside the versions day 17's DDP readout "
            f"was checked with ({lo[0]}.{lo[1]}-{hi[0]}.{hi[1]})"
        )
    return None
