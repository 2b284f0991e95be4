"""Day 23: the checks a ZeRO-3 offload ds_config passes before anything is built.

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
"""

from __future__ import annotations

import os
import tempfile

from dtl.deepspeed import DsConfigError, check_sections, read_ds_config

MiB = 1024**2
MIN_AIO_BYTES = MiB  # deepspeed/runtime/swap_tensor/utils.py MIN_AIO_BYTES
AIO_ALIGN = 1024  # AIO_ALIGNED_BYTES: swap files are padded to a multiple
AIO_KEYS = {
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "single_submit",
    "overlap_events",
    "use_gds",
}
AIO_BLOCK_DEFAULT = 1048576
STAGE3_ONLY = ("offload_param", "sub_group_size")  # plus every stage3_* key
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
    """The ds_config's JSON (dtl.deepspeed's reader; its errors as this day's ExplainError)."""
    return read_ds_config(path, error=ExplainError)


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
