"""dtl.data: the offline GPT-2 tokenizer, the cached corpus, batches as a pure function of
(seed, step, dp_rank, dp_size), Hugging Face datasets from a local path, clear errors."""

import json
import os

import numpy as np
import pytest
import torch

from dtl import data


def test_gpt2_tokenizer_is_the_real_50257_token_bpe_offline():
    tok = data.get_tokenizer("gpt2")
    assert tok.vocab_size == 50257
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's published ids
    text = "O Romeo, Romeo! wherefore art thou Romeo?"
    assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_round_trips_any_text():
    tok = data.get_tokenizer("byte")
    assert tok.vocab_size == 256 and tok.decode(tok.encode("naïve ✓")) == "naïve ✓"


def test_corpus_is_real_shakespeare_and_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("DTL_CACHE", str(tmp_path))
    corpus = data.load_corpus("shakespeare", tokenizer="gpt2")
    assert corpus.vocab_size == 50257 and corpus.tokenizer_name == "gpt2"
    assert 1_300_000 < len(corpus.train) < 1_500_000  # ~1.57M GPT-2 tokens, 10% held out
    assert len(corpus.val) == int((len(corpus.train) + len(corpus.val)) * 0.1)
    cached = [f for f in os.listdir(tmp_path) if f.endswith(".npy")]
    assert len(cached) == 1
    again = data.load_corpus("shakespeare", tokenizer="gpt2")  # read back from the cache
    assert np.array_equal(again.train, corpus.train)
    text = data.get_tokenizer("gpt2").decode(corpus.train[:2000])
    assert "HAMLET" in data.load_text()[:3_000_000] and len(text) > 1000


def test_batches_are_a_pure_function_of_seed_step_and_dp_coordinates():
    tokens = np.arange(10_000, dtype=np.uint16)
    x1, y1 = data.get_batch(tokens, 16, 4, seed=3, step=5)
    x2, y2 = data.get_batch(tokens, 16, 4, seed=3, step=5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(y1[:, :-1], x1[:, 1:])  # targets are inputs shifted by one token
    assert not torch.equal(x1, data.get_batch(tokens, 16, 4, seed=3, step=6)[0])
    assert not torch.equal(x1, data.get_batch(tokens, 16, 4, seed=4, step=5)[0])
    assert x1.dtype == torch.int64 and x1.shape == (4, 16)


def test_dp_ranks_together_see_exactly_the_single_process_batch():
    tokens = np.arange(10_000, dtype=np.uint16)
    whole, _ = data.get_batch(tokens, 8, 12, seed=0, step=2, dp_rank=0, dp_size=1)
    for dp_size in (2, 3, 4):
        parts = [
            data.get_batch(tokens, 8, 12 // dp_size, seed=0, step=2, dp_rank=r, dp_size=dp_size)[0]
            for r in range(dp_size)
        ]
        assert torch.equal(torch.cat(parts), whole)


def test_hugging_face_dataset_from_a_local_file(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(3)))
    assert data.load_text(str(path)) == "line 0\n\nline 1\n\nline 2"
    with pytest.raises(data.DataError, match="has no column 'body'"):
        data.load_text(str(path), text_field="body")


@pytest.mark.parametrize(
    "source, message",
    [
        ("/no/such/dir", "dataset path not found: /no/such/dir"),
        ("./missing.txt", "text file not found: ./missing.txt"),
    ],
)
def test_missing_data_paths_are_one_line_errors(source, message):
    with pytest.raises(data.DataError, match=message) as err:
        data.load_text(source)
    assert "\n" not in str(err.value)


def test_missing_mnist_folder_and_unknown_tokenizer_are_one_line_errors(tmp_path):
    with pytest.raises(data.DataError, match="MNIST folder not found"):
        data.load_mnist("/no/such/mnist")
    with pytest.raises(data.DataError, match="MNIST file train-images-idx3-ubyte"):
        data.load_mnist(str(tmp_path))
    with pytest.raises(data.DataError, match="unknown tokenizer 'bpe'"):
        data.get_tokenizer("bpe")


def test_a_hub_dataset_name_offline_is_a_one_line_error_not_a_retry_loop(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(data.DataError, match="could not load dataset 'nobody/no-such-set'") as err:
        data.load_text("nobody/no-such-set")
    assert "\n" not in str(err.value)


def test_every_start_offset_is_reachable_and_a_too_short_corpus_is_an_error():
    tokens = np.arange(9, dtype=np.uint16)  # seq_len 8 needs 9 tokens: exactly one row fits
    x, y = data.get_batch(tokens, 8, 3, seed=0, step=0)
    assert x[0].tolist() == list(range(8)) and y[0].tolist() == list(range(1, 9))
    with pytest.raises(data.DataError, match="8 tokens cannot fill one sequence of 8 \\+ 1"):
        data.get_batch(tokens[:8], 8, 1, seed=0, step=0)


def test_an_edited_local_text_file_is_tokenized_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DTL_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be")
    first = data.load_corpus(str(text), tokenizer="byte", val_fraction=0.0)
    text.write_text("that is the question, longer")
    os.utime(text, ns=(1, 2))  # a different mtime even on coarse-grained file systems
    again = data.load_corpus(str(text), tokenizer="byte", val_fraction=0.0)
    assert bytes(again.train.tolist()).decode() == "that is the question, longer"
    assert len(first.train) != len(again.train)


# --- context parallelism: the sequence split over cp ranks -------------------------------------


@pytest.mark.parametrize("split", data.CP_SPLITS)
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_ranks_together_see_exactly_the_single_process_batch(split, cp_size):
    tokens = np.arange(5000, dtype=np.uint16)  # token id = its offset: positions are checkable
    T, kw = 16, dict(seed=3, step=2, dp_rank=1, dp_size=2)
    x_full, y_full = data.get_batch(tokens, T, 4, **kw)
    xs, ys, poss = [], [], []
    for r in range(cp_size):
        x, y = data.get_batch(tokens, T, 4, **kw, cp_rank=r, cp_size=cp_size, cp_split=split)
        pos = data.cp_positions(T, r, cp_size, split)
        assert x.shape == y.shape == (4, T // cp_size) and pos.shape == (T // cp_size,)
        # the position ids say where each held token sits in the full sequence
        assert torch.equal(x, x_full[:, pos]) and torch.equal(y, y_full[:, pos])
        xs, ys, poss = xs + [x], ys + [y], poss + [pos]
    assert torch.equal(data.cp_unshard(xs, split), x_full)
    assert torch.equal(data.cp_unshard(ys, split), y_full)
    assert torch.equal(data.cp_unshard(poss, split, dim=0), torch.arange(T))


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert data.cp_positions(16, 0, 4, "zigzag").tolist() == [0, 1, 14, 15]
    assert data.cp_positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    assert data.cp_positions(16, 3, 4, "zigzag").tolist() == [6, 7, 8, 9]
    assert data.cp_positions(16, 1, 4, "contiguous").tolist() == [4, 5, 6, 7]
    # causal work balance: with zig-zag every rank attends to the same number of (q, k) pairs
    work = [sum(p + 1 for p in data.cp_positions(16, r, 4, "zigzag").tolist()) for r in range(4)]
    assert len(set(work)) == 1
    contiguous = [sum(p + 1 for p in data.cp_positions(16, r, 4).tolist()) for r in range(4)]
    assert contiguous == sorted(contiguous) and contiguous[-1] > 3 * contiguous[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cp_size=3), r"seq_len 16 is not divisible by 3 \(contiguous split over cp_size 3\)"),
        (dict(cp_size=3, cp_split="zigzag"), "seq_len 16 is not divisible by 6"),
        (dict(cp_size=2, cp_rank=2), r"cp_rank 2 is not in \[0, cp_size=2\)"),
        (dict(cp_split="ring"), "unknown cp split 'ring'; choose one of contiguous, zigzag"),
    ],
)
def test_bad_cp_layouts_are_one_line_errors(kwargs, message):
    with pytest.raises(data.DataError, match=message) as err:
        data.get_batch(np.arange(100, dtype=np.uint16), 16, 2, seed=0, step=0, **kwargs)
    assert "\n" not in str(err.value)
