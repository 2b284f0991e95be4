"""Day 24: a DCP checkpoint as one torch.save file, and back.

    to_torch_save("ckpt/step_00000012", "full.pt")   # verified first; the full, unsharded state
    from_torch_save("full.pt", "ckpt_again")         # a DCP folder with its manifest (meta.json)
    load_torch_save("full.pt")                       # weights_only=True: tensors, never code

One file is what other tools read; the DCP folder is what a sharded run loads (each rank reads
its own chunks, at any world size).
"""

from __future__ import annotations

import json
import os
import time

import torch

from day24_checkpoint.ckpt import META, _manifest, code_version, verify


def to_torch_save(path: str, out_file: str) -> None:
    """A DCP checkpoint -> one torch.save file (the full, unsharded state dict, one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    verify(path)
    dcp_to_torch_save(path, out_file)


def from_torch_save(file: str, out_dir: str) -> None:
    """One torch.save file -> a DCP folder (loadable at any world size), with its manifest."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    torch_save_to_dcp(file, out_dir)
    meta = dict(
        step=-1,
        world_size=1,
        config={},
        code=code_version(),
        torch=torch.__version__,
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        files=_manifest(out_dir),
    )
    with open(os.path.join(out_dir, META), "w") as f:
        json.dump(meta, f, indent=1)


def load_torch_save(file: str) -> dict:
    """Read a torch.save checkpoint safely: weights_only=True unpickles tensors, numbers and
    containers only, never arbitrary objects (a pickle can run any code it names)."""
    return torch.load(file, map_location="cpu", weights_only=True)
