"""Test-wide settings: one thread per rank, Hugging Face offline, DeepSpeed's prebuilt ops."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DTL_TIMEOUT_S", "60")
# where `make install` built DeepSpeed's C++ ops (tools/warm_deepspeed_ops.py): a plain `pytest`
# must find them there too, or the first DeepSpeed test would compile for a minute
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
# ... with the venv's ninja, the one that built them: another ninja version cannot read the build
# log and rebuilds every op (measured: ~90 s inside the first DeepSpeed test)
_bin = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _bin:
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, rather than let DeepSpeed warn
torch.set_num_threads(1)
