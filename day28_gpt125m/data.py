"""Day 28's data pipeline: the corpus pre-tokenized into memory-mapped shards, a DataLoader with
workers and prefetch that keeps the step fed, and an exact resume position.

    index = write_shards(tokens, "data/shakespeare-gpt2", shard_tokens=1 << 20)   # once
    data = ShardedTokens("data/shakespeare-gpt2")  # np.memmap over every shard: no copy
    loader = step_loader(data, seq_len=1024, rows=16, dp_rank=r, dp_size=n, seed=0,
                         start_step=k, steps=K, workers=2)
    for step, (x, y) in loader: ...                    # step k, k+1, ...: where a resume left off

The shard format is llm.c's (karpathy/llm.c dev/data/data_common.py): a header of 256 int32
(magic 20240520, version 1, the token count) and then the tokens as uint16, so shards written
here load there and the other way round. Tokenizing once is the point: a 10 B-token corpus takes
hours to tokenize and seconds to memory-map, and every rank and worker reads the same bytes.

A batch is a pure function of (seed, step, dp_rank, dp_size): its rows start at
dtl.data.batch_offsets, the same offsets dtl.data.get_batch uses on the same token stream. So
the loader feeds exactly what every earlier day and the one-process reference see, and resuming
at step k is nothing more than starting the sampler at k: no iterator state to save.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dtl.data import DataError, batch_offsets

MAGIC, VERSION = 20240520, 1
HEADER_INTS = 256  # int32s before the tokens
HEADER_BYTES = HEADER_INTS * 4
INDEX = "index.json"


def write_shards(tokens: np.ndarray, out_dir: str, shard_tokens: int = 1 << 24) -> dict:
    """Write `tokens` as shard_00000.bin, ... of at most shard_tokens tokens, and index.json."""
    if tokens.max(initial=0) > np.iinfo(np.uint16).max:
        raise DataError("token ids above 65,535 do not fit the uint16 shard format")
    os.makedirs(out_dir, exist_ok=True)
    names = []
    for i, start in enumerate(range(0, len(tokens), shard_tokens)):
        piece = np.asarray(tokens[start : start + shard_tokens], dtype=np.uint16)
        header = np.zeros(HEADER_INTS, dtype=np.int32)
        header[:3] = (MAGIC, VERSION, len(piece))
        name = f"shard_{i:05d}.bin"
        tmp = os.path.join(out_dir, name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(piece.tobytes())
        os.replace(tmp, os.path.join(out_dir, name))  # atomic: a reader never sees half a shard
        names.append(name)
    index = {"shards": names, "tokens": int(len(tokens)), "dtype": "uint16"}
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump(index, f, indent=1)
    return index


def _open_shard(path: str) -> np.memmap:
    if not os.path.isfile(path):
        raise DataError(f"shard not found: {path}")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if len(header) < 3 or header[0] != MAGIC or header[1] != VERSION:
        raise DataError(f"{path} is not a token shard (magic {MAGIC}, version {VERSION} expected)")
    n = int(header[2])
    if os.path.getsize(path) != HEADER_BYTES + 2 * n:
        raise DataError(f"{path} is truncated: its header says {n:,} tokens")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,))


class ShardedTokens:
    """Every shard of a folder as one read-only token sequence (memory-mapped, lazily opened:
    a DataLoader worker opens its own maps after the fork)."""

    def __init__(self, folder: str):
        path = os.path.join(folder, INDEX)
        if not os.path.isfile(path):
            raise DataError(f"no {INDEX} in {folder}: write the shards first (write_shards)")
        with open(path) as f:
            self.index = json.load(f)
        self.paths = [os.path.join(folder, n) for n in self.index["shards"]]
        # validates every header now; a worker gets the paths and reopens them (__getstate__)
        self._maps: list[np.memmap] | None = [_open_shard(p) for p in self.paths]
        sizes = [m.shape[0] for m in self._maps]
        if sum(sizes) != self.index["tokens"]:
            raise DataError(f"{folder}: shards hold {sum(sizes):,} tokens, index says otherwise")
        self.starts = np.cumsum([0, *sizes])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def maps(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [_open_shard(p) for p in self.paths]
        return self._maps

    def __getstate__(self):  # to a worker: paths and sizes, never open maps
        return {**self.__dict__, "_maps": None}

    def read(self, start: int, n: int) -> np.ndarray:
        """tokens[start : start + n], across shard boundaries if need be."""
        out = []
        while n > 0:
            shard = int(np.searchsorted(self.starts, start, side="right")) - 1
            piece = np.asarray(self.maps[shard][start - int(self.starts[shard]) :][:n])
            out.append(piece)
            start, n = start + len(piece), n - len(piece)
        return np.concatenate(out)


class StepBatches(Dataset):
    """Item `step` = this DP rank's (x, y) of that step, (rows, seq_len) int64 each: the rows
    dtl.data.get_batch would give for the same tokens, seed, step and DP coordinates."""

    def __init__(
        self, data: ShardedTokens, seq_len: int, rows: int, *, dp_rank: int, dp_size: int, seed: int
    ):
        self.data, self.seq_len, self.rows = data, seq_len, rows
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed

    def __len__(self) -> int:
        return 2**62  # any step: the sampler says which

    def __getitem__(self, step: int):
        offsets = batch_offsets(
            len(self.data), self.seq_len, self.dp_size * self.rows, self.seed, step
        )
        mine = offsets[self.dp_rank * self.rows : (self.dp_rank + 1) * self.rows]
        rows = np.stack([self.data.read(int(o), self.seq_len + 1) for o in mine.tolist()])
        rows = torch.from_numpy(rows.astype(np.int64))  # host: a worker's batch; the loop moves it
        return rows[:, :-1], rows[:, 1:]


def step_loader(
    data: ShardedTokens,
    *,
    seq_len: int,
    rows: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    start_step: int,
    steps: int,
    workers: int = 2,
    prefetch: int = 4,
    pin_memory: bool = False,
):
    """Yield (step, (x, y)) for steps start_step .. steps-1: worker processes build the batches
    `prefetch` steps ahead while the model trains (workers=0: in this process, for a baseline)."""
    ds = StepBatches(data, seq_len, rows, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
    sampler = range(start_step, steps)
    loader = DataLoader(
        ds,
        batch_size=None,  # an item is already a batch
        sampler=sampler,
        num_workers=workers,
        prefetch_factor=prefetch if workers else None,
        persistent_workers=False,
        pin_memory=pin_memory,
    )
    return zip(sampler, loader)
