"""Test-wide settings: one thread per rank, Hugging Face offline, outputs under a temp dir."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DTL_TIMEOUT_S", "60")

import torch  # noqa: E402

torch.set_num_threads(1)
