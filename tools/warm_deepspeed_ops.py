"""Build DeepSpeed's C++ ops once, at install, so that no test or lesson ever compiles one.

    TORCH_EXTENSIONS_DIR=$PWD/.venv/torch_extensions python tools/warm_deepspeed_ops.py

DeepSpeed JIT-compiles its ops on first use and caches them in $TORCH_EXTENSIONS_DIR. On a CPU
that is: deepspeed_shm_comm on every deepspeed.initialize (~40 s to build), cpu_adam for optimizer
offload (~60 s), fused_adam for the ds_config optimizer "Adam" (~40 s), and async_io (+pin_memory)
for NVMe offload (~3-5 min, only when libaio-dev is installed). Building them inside a timed test
would blow its limit, so the Makefile runs this once after installing; on a warm cache it takes
seconds (ninja finds nothing to do). Why not DS_BUILD_*=1 pip install (pre-built ops)? Measured on
0.19.8: about as fast without NVMe, and its async_io is not linked against libaio (ImportError:
undefined symbol io_submit), while the JIT-built one works.

On a machine with CUDA it does nothing: DeepSpeed builds the GPU ops on first use there.
The ops must be loaded later with the same `ninja` that built them (the venv's, first on PATH):
a different ninja version cannot read the build log and rebuilds everything.
"""

import os
import sys
import time


def main() -> int:
    import torch

    from dtl.registry import use_venv_tools

    if torch.cuda.is_available():
        print("warm_deepspeed_ops: CUDA present, DeepSpeed builds its GPU ops on first use")
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    use_venv_tools(os.environ)  # the venv's ninja and ops folder, as tests and lessons will use
    ext = os.environ["TORCH_EXTENSIONS_DIR"]
    if not os.path.isabs(ext):
        print("warm_deepspeed_ops: set TORCH_EXTENSIONS_DIR to an absolute path", file=sys.stderr)
        return 2
    from deepspeed.accelerator import get_accelerator

    # a build killed half-way leaves <op>/lock behind, and every later load waits on it forever
    for op in os.listdir(ext) if os.path.isdir(ext) else []:
        lock = os.path.join(ext, op, "lock")
        if os.path.exists(lock):
            os.remove(lock)
            print(f"warm_deepspeed_ops: removed a stale {lock}")
    names = ["ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder"]
    if get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible():
        names.append("AsyncIOBuilder")  # NVMe offload; needs libaio-dev
    else:
        print("warm_deepspeed_ops: libaio-dev not installed, async_io (NVMe offload) not built")
    for name in names:  # one after the other: two compilers at once thrash 2 cores
        start = time.monotonic()
        get_accelerator().create_op_builder(name).load()
        print(f"warm_deepspeed_ops: {name:<20} {time.monotonic() - start:6.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
