"""DeepSpeed, the course's way: imported on the run's device, its ds_config read, filled and checked
before any collective (the twin of dtl/megatron.py). Days 18, 23 and 28 build their engines with it.

A ds_config is plain DeepSpeed JSON. Values written "auto" (the Hugging Face convention) are filled
from the run's own config, so one number lives in one place; a number written in the JSON must
agree with the run, or the run stops:

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size
                       (--batch_size)                   (--grad_accum)                (torchrun)

Checked before any collective, each a one-line DsConfigError: the file exists and is JSON; every
top-level key is one DeepSpeed reads (it silently ignores the others: "zero_optimisation" would
train without ZeRO); `zero_optimization`, `bf16`, `fp16` validate against DeepSpeed's own
pydantic models; `optimizer` has known keys (DeepSpeed never checks them: a misspelled "parmas"
trains at the default learning rate); the batch identity holds; the precision section is the
run's (`apply_precision`), and one DeepSpeed declares on the run's device (no fp16 on a CPU).

DeepSpeed's device is the run's: DeepSpeed picks its "accelerator" once, when it is first
imported (CUDA whenever a GPU is visible), and binds its op builders (FusedAdam, cpu_adam) to it
then. A gloo run on a GPU machine (DTL_BACKEND=gloo, or more ranks than GPUs) keeps every tensor
on the CPU; with the CUDA accelerator DeepSpeed would put its partitions and buffers on
cuda:<local rank> beside them. `use_run_accelerator` sets DS_ACCELERATOR to the run's device
type before the first import, and refuses, in one line, a DeepSpeed already imported with the
other one. `import_deepspeed` is how every day imports it.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist

from dtl import dist as dtl_dist
from dtl import extras
from dtl.optim import OptimConfig
from dtl.precision import ANY_DEVICE, GPU_ONLY, Precision, PrecisionError, declare

# The precisions DeepSpeed trains in here: its bf16 and fp16 sections (fp16 with its own loss
# scaler; DeepSpeed refuses fp16 on a CPU), or neither for fp32. Every ds_config of the course
# gets its section from `apply_precision`, so DeepSpeed trains the row it was asked for or none.
DEEPSPEED = declare(
    "DeepSpeed",
    {"fp32": ANY_DEVICE, "bf16": ANY_DEVICE, "fp16": GPU_ONLY},
    why="its bf16 and fp16 sections are the precisions it has; it has no float8 matmuls",
)
# DeepSpeed's section for the dtype a row stores parameters in; fp32 enables none
SECTIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class DsConfigError(ValueError):
    """A ds_config problem, in one line, found before any collective."""


def planned_device_type() -> str:
    """The device type ("cuda" or "cpu") this run computes on, known before dtl.dist.init()
    runs (a ds_config is checked, and DeepSpeed's accelerator chosen, before any group exists).
    With a process group, its backend's device; before, the rule init() will apply: NCCL, hence
    CUDA, only when every local rank has a GPU of its own; DTL_BACKEND overrides."""
    if dist.is_initialized():
        return dtl_dist.run_device().type
    try:
        backend = dtl_dist.planned_backend()
    except dtl_dist.BackendError as e:
        raise DsConfigError(str(e)) from None
    return "cuda" if backend == "nccl" else "cpu"


def _chosen_accelerator() -> str | None:
    """The device name of the accelerator DeepSpeed has chosen already, None if not imported."""
    real = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(real, "ds_accelerator", None)
    return None if chosen is None else chosen.device_name()


def use_run_accelerator(device_type: str) -> None:
    """Make DeepSpeed's accelerator the run's device type ("cuda" or "cpu"; a torch.device's
    .type): DS_ACCELERATOR, which DeepSpeed reads once, when it is first imported. Called before
    anything imports DeepSpeed; afterwards it only checks: a DeepSpeed imported already with the
    other accelerator is a one-line DsConfigError (its op builders cannot be re-bound)."""
    want = "cuda" if device_type == "cuda" else "cpu"
    chosen = _chosen_accelerator()
    if chosen is not None and chosen != want:
        raise DsConfigError(
            f"DeepSpeed was imported with its {chosen} accelerator but this run's device is "
            f"{want}: set DS_ACCELERATOR={want} (or call use_run_accelerator) before the import"
        )
    os.environ["DS_ACCELERATOR"] = want  # also what DeepSpeed's own subprocesses inherit


def import_deepspeed(device_type: str) -> Any:  # the deepspeed module (untyped)
    """DeepSpeed, imported with the run's accelerator (`use_run_accelerator`) and with its
    zero.Init honouring the dtype it is given (`_honour_zero_init_dtype`). Every day that builds
    a DeepSpeed engine imports it through here."""
    use_run_accelerator(device_type)
    import deepspeed

    _honour_zero_init_dtype(deepspeed.zero.Init)
    return deepspeed


def _honour_zero_init_dtype(init_cls: Any) -> None:  # deepspeed.zero.Init
    """DeepSpeed 0.19.8's zero.Init._set_dtype reads `dtype or torch.float16 if fp16 else ...`,
    which Python groups as `(dtype or fp16) if fp16 else (bf16 ...)`: on an accelerator without
    fp16 (a CPU whose `torch.ops.mkldnn._is_mkldnn_fp16_supported()` is False, an AMD EPYC say)
    the dtype given is dropped for bf16. deepspeed.initialize gives ZeRO-3 the model's dtype,
    so fp32 parameters offloaded to NVMe got bf16 swap buffers and came back bf16 ("expected m1
    and m2 to have the same dtype"). Patched only where the source still has that line, so a
    fixed DeepSpeed runs untouched; a given dtype is kept, the rest is DeepSpeed's own rule."""
    original = init_cls._set_dtype
    if getattr(original, "_dtl_honours_dtype", False):
        return
    if "dtype or torch.float16 if" not in inspect.getsource(original):
        return

    def _set_dtype(self: Any, ds_config: Any, dtype: torch.dtype | None) -> None:
        if dtype is not None:  # as DeepSpeed does where fp16 is supported (a GPU)
            self.dtype = dtype
        else:
            original(self, ds_config, dtype)

    _set_dtype._dtl_honours_dtype = True  # type: ignore[attr-defined]  # a marker on a function
    init_cls._set_dtype = _set_dtype


@lru_cache(maxsize=1)
def known_top_level_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed reads, found by letting DeepSpeedConfig parse a dict that
    records every lookup (it has no list of its own; no collective runs)."""
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS, DeepSpeedConfig

    seen: set[Any] = set()  # the keys looked up (strings, through object-typed dunders)

    class Keys(list[str]):
        def __contains__(self, k: object) -> bool:
            seen.add(k)
            return list.__contains__(self, k)

    class Recorder(dict[str, Any]):
        def __getitem__(self, k: str) -> Any:
            seen.add(k)
            return super().__getitem__(k)

        def get(self, k: str, default: Any = None) -> Any:
            seen.add(k)
            return super().get(k, default)

        def __contains__(self, k: object) -> bool:
            seen.add(k)
            return super().__contains__(k)

        def keys(self) -> Keys:  # type: ignore[override]  # a recording list, not a view
            return Keys(super().keys())

    DeepSpeedConfig(Recorder(train_micro_batch_size_per_gpu=1))
    seen |= {"sequence_parallel_size", "data_parallel_size"}  # read by deepspeed.initialize
    return frozenset(seen - set(_REMOVED_TOP_LEVEL_CONFIG_KEYS))


def check_sections(ds: dict[str, Any]) -> None:
    """Raise DsConfigError (one line) for a top-level key DeepSpeed does not read, a
    zero_optimization / bf16 / fp16 section its pydantic models reject, or an unknown optimizer
    key (day 23's explainer runs the same checks on its templates)."""
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    unknown = sorted(set(ds) - known_top_level_keys())
    if unknown:
        raise DsConfigError(
            f"unknown top-level ds_config key(s) {unknown} (DeepSpeed would silently ignore them)"
        )
    for key, model in (
        ("zero_optimization", DeepSpeedZeroConfig),
        ("bf16", DeepSpeedBF16Config),
        ("fp16", DeepSpeedFP16Config),
    ):
        try:
            model(**ds.get(key, {}))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in (key, *err["loc"]))
            raise DsConfigError(f"ds_config '{where}': {err['msg']}") from None
    opt = ds.get("optimizer")
    if opt is None:
        return
    unknown = sorted(set(opt) - {"type", "params", "legacy_fusion"})
    if unknown:
        raise DsConfigError(f"unknown key(s) {unknown} in ds_config 'optimizer'")
    if str(opt.get("type", "")).lower() in ("adam", "adamw"):
        allowed = set(inspect.signature(FusedAdam.__init__).parameters) - {"self", "params"}
        allowed |= {"adam_w_mode", "torch_adam", "fp32_optimizer_states"}
        unknown = sorted(set(opt.get("params", {})) - allowed)
        if unknown:
            raise DsConfigError(f"unknown key(s) {unknown} in ds_config 'optimizer.params'")


def read_ds_config(path: str, error: type[DsConfigError] = DsConfigError) -> dict[str, Any]:
    """A ds_config file's JSON, or `error` in one line: the file is missing, or not JSON."""
    if not os.path.isfile(path):
        raise error(f"ds_config file not found: {path}")
    try:
        with open(path) as f:
            ds: dict[str, Any] = json.load(f)
            return ds
    except json.JSONDecodeError as e:
        raise error(f"ds_config {path} is not valid JSON: {e}") from None


def _resolve(ds: dict[str, Any], path: tuple[str, ...], value: object, source: str) -> None:
    """Fill an "auto" (or missing) value from the run; a written value must equal the run's."""
    *parents, leaf = path
    node = ds
    for p in parents:
        node = node.setdefault(p, {})
    written = node.get(leaf, "auto")
    if written == "auto":
        node[leaf] = value
    elif written != value:
        raise DsConfigError(
            f"ds_config '{'.'.join(path)}' is {written!r} but the run has {value!r} ({source}); "
            'write "auto" there or make them agree'
        )


def apply_precision(ds: dict[str, Any], name: str, device_type: str) -> Precision:
    """Enable, in `ds`, DeepSpeed's section for the row `name` and disable the other (a section
    written in the file must agree with the run, as every value); DsConfigError (one line) for a
    row DeepSpeed does not declare, or not on `device_type`. Returns the row."""
    try:
        row = DEEPSPEED.require(name, device_type)
    except PrecisionError as e:
        raise DsConfigError(str(e)) from None
    wanted = SECTIONS.get(row.storage)  # None: fp32, no section
    for section in SECTIONS.values():
        if section in ds or section == wanted:
            _resolve(ds, (section, "enabled"), section == wanted, "--precision")
    return row


def load_ds_config(
    path: str,
    *,
    stage: int,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    opt: OptimConfig,
    precision: str,
    device_type: str,
) -> dict[str, Any]:
    """Read, check and complete a ds_config for a run on `device_type`; raises DsConfigError
    (one line). DeepSpeed's accelerator is set to `device_type` before DeepSpeed is imported."""
    ds = read_ds_config(path)
    extras.require("impl=deepspeed", "deepspeed", error=DsConfigError)
    use_run_accelerator(device_type)
    want_batch = micro_batch * grad_accum * world_size
    _resolve(ds, ("train_micro_batch_size_per_gpu",), micro_batch, "--batch_size")
    _resolve(ds, ("gradient_accumulation_steps",), grad_accum, "--grad_accum")
    written = ds.get("train_batch_size", "auto")
    if written != "auto" and written != want_batch:
        raise DsConfigError(
            f"ds_config train_batch_size {written} != micro-batch {micro_batch} x accumulation "
            f"{grad_accum} x world size {world_size} = {want_batch}"
        )
    ds["train_batch_size"] = want_batch
    _resolve(ds, ("zero_optimization", "stage"), stage, "--stage")
    for name, value in opt.deepspeed_params().items():
        _resolve(ds, ("optimizer", "params", name), value, f"--{name}")
    apply_precision(ds, precision, device_type)
    check_sections(ds)  # after the "auto" values are filled: DeepSpeed's models see numbers
    return ds
