"""Day 15: every collective against its closed form (world and sub-groups, 2 and 4 ranks), DDP
against a single process, and the MNIST loader against the official counts."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from day15_collectives import collectives, ddp_mnist
from dtl import data
from dtl.reference import reference_train
from dtl.script_server import run_script
from dtl.testing import run_distributed


def _checks_on_world_and_sub_groups(names):
    out = []
    for name in names:
        out.append((name, *collectives.CHECKS[name](torch.device("cpu"))))
    sub, label = collectives.even_odd_groups()
    for name in names:
        out.append(
            (
                f"{name} [{label} sub-group]",
                *collectives.CHECKS[name](torch.device("cpu"), group=sub),
            )
        )
    return out


def _assert_closed_forms(names, world_size):
    per_rank = run_distributed(_checks_on_world_and_sub_groups, names, world_size=world_size)
    for rank, results in enumerate(per_rank):
        assert len(results) == 2 * len(names)
        for name, before, got, expected in results:
            assert before is not None
            if got is None:  # reduce/gather promise nothing to ranks other than the destination
                assert name.split(" [")[0] in ("reduce", "gather") and expected is None
                continue
            # integer-valued fp64 data: every order of summation is exact, so demand equality
            torch.testing.assert_close(
                got, expected, rtol=0, atol=0, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )


FOUR = ["all_reduce(SUM)", "all_gather", "reduce_scatter", "all_to_all"]  # day15.closed_forms
IDENTITY = ["AR == RS + AG"]  # day15.rs_plus_ag
RING = ["send/recv ring"]  # day15.send_recv_ring
# 3 ranks: uneven sub-groups, even {0, 2} and odd {1}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_four_collectives_give_their_closed_forms_on_world_and_sub_groups(world_size):
    _assert_closed_forms(FOUR, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_equals_reduce_scatter_then_all_gather_on_world_and_sub_groups(world_size):
    _assert_closed_forms(IDENTITY, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_send_recv_ring_passes_each_rank_its_left_neighbours_tensor(world_size):
    _assert_closed_forms(RING, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_other_collective_matches_its_closed_form_on_world_and_sub_groups(world_size):
    graded = FOUR + IDENTITY + RING
    _assert_closed_forms([n for n in collectives.CHECKS if n not in graded], world_size)


def _every_check_with_collectives_that_do_nothing():
    """Each check with the collectives it calls replaced by no-ops: per check, did it pass?"""

    class Done:  # what an async_op=True no-op hands back
        def wait(self):
            return True

        def is_completed(self):
            return True

    noop = lambda *args, **kwargs: Done()  # noqa: E731
    saved = {name: getattr(dist, name) for name in NOOPS if hasattr(dist, name)}
    for name in saved:
        setattr(dist, name, (lambda ops: []) if name == "batch_isend_irecv" else noop)
    try:
        # outputs that a no-op leaves untouched must not happen to hold the answer: zero them
        empty_like, torch.empty_like = torch.empty_like, torch.zeros_like
        empty, torch.empty = torch.empty, torch.zeros
        try:
            return {
                n: collectives.passed(*check(torch.device("cpu"))[1:])
                for n, check in collectives.CHECKS.items()
            }
        finally:
            torch.empty_like, torch.empty = empty_like, empty
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


NOOPS = (
    "broadcast",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all_single",
    "batch_isend_irecv",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter_single",  # torch >= 2.13 (dtl.compat calls whichever exists)
    "all_gather_single",
    "reduce_scatter_tensor",  # every torch
    "all_gather_into_tensor",
    "barrier",
)


def test_every_closed_form_check_fails_when_the_collective_does_nothing():
    # guards against a check that compares a result with itself: with the data movement removed,
    # every check must fail on at least one rank
    per_rank = run_distributed(_every_check_with_collectives_that_do_nothing, world_size=2)
    for name in collectives.CHECKS:
        assert not all(rank[name] for rank in per_rank), f"{name} passes without communicating"


def test_all_reduce_equals_reduce_scatter_then_all_gather_is_among_the_checks():
    assert collectives.CHECKS["AR == RS + AG"] is (
        collectives.check_all_reduce_is_reduce_scatter_plus_all_gather
    )
    assert set(FOUR + IDENTITY + RING) < set(collectives.CHECKS)


# --- DDP against one process ---------------------------------------------------------------

STEPS, PER_RANK_BATCH = 4, 8


def _global_batches(world_size):
    mnist = data.load_mnist()
    n = STEPS * PER_RANK_BATCH * world_size
    x = ddp_mnist.to_float(mnist["train_images"][:n], 0.1307, 0.3081).double()
    y = mnist["train_labels"][:n].long()
    return x.view(STEPS, world_size * PER_RANK_BATCH, 1, 28, 28), y.view(STEPS, -1)


def _ddp_train():
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = _global_batches(world)
    model = DDP(ddp_mnist.build_model(seed=1).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)  # rows of each global batch
    reference_train(model, lambda step: (xs[step][mine], ys[step][mine]), opt, STEPS)
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def _reference_train(world_size):
    xs, ys = _global_batches(world_size)
    model = ddp_mnist.build_model(seed=1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # one process, the whole global batch: the mean loss over all rows
    reference_train(model, lambda step: (xs[step], ys[step]), opt, STEPS)
    return model.state_dict()


def test_ddp_parameters_after_k_steps_equal_one_process_on_the_global_batches():
    per_rank = run_distributed(_ddp_train, world_size=2)
    reference = _reference_train(2)
    for name, ref in reference.items():
        # fp64: DDP averages two half-batch gradients, the reference takes one mean over the
        # global batch; only the order of additions differs, so 1e-10 is plenty. SGD, not
        # Adam: Adam's update is invariant to scaling the gradient, so it would hide a DDP that
        # summed instead of averaging; SGD's step would be twice too large.
        torch.testing.assert_close(per_rank[0][name], ref, rtol=1e-10, atol=1e-10)
        assert torch.equal(per_rank[0][name], per_rank[1][name]), f"replicas differ in {name}"
    first = next(iter(reference))
    assert not torch.equal(
        reference[first], ddp_mnist.build_model(seed=1).double().state_dict()[first]
    )


# --- MNIST -----------------------------------------------------------------------------------

TRAIN_LABEL_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]  # official
TEST_LABEL_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_mnist_loader_returns_the_official_splits_and_label_counts():
    mnist = data.load_mnist()
    assert mnist["train_images"].shape == (60000, 28, 28)
    assert mnist["test_images"].shape == (10000, 28, 28)
    assert mnist["train_images"].dtype == torch.uint8
    assert torch.bincount(mnist["train_labels"].long()).tolist() == TRAIN_LABEL_COUNTS
    assert torch.bincount(mnist["test_labels"].long()).tolist() == TEST_LABEL_COUNTS
    pixels = mnist["train_images"].float() / 255
    assert abs(pixels.mean().item() - 0.1307) < 1e-3 and abs(pixels.std().item() - 0.3081) < 1e-3


def test_mnist_idx_files_round_trip(tmp_path):
    mnist = data.load_mnist()
    for key, fname in data.IDX_FILES.items():
        data.write_idx(str(tmp_path / fname), mnist[key][:50].numpy())
    again = data.load_mnist(str(tmp_path))
    for key in data.MNIST_SPLITS:
        assert np.array_equal(again[key].numpy(), mnist[key][:50].numpy())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--epochs=two"], "config key 'epochs' expects int, got 'two'"),
        (["--learning_rate=1"], "unknown config key 'learning_rate'"),
        (["--mnist_path=/no/such/dir"], "mnist_path is not a folder: /no/such/dir"),
        (["--config", "/no/such.toml"], "config file not found: /no/such.toml"),
        (["--mnist_path=/"], "MNIST file train-images-idx3-ubyte[.gz] not found in /"),
        # the review's tracebacks and the minute of training before failing, now one line each
        (["--lr=nan"], "config key 'lr' must be a finite number > 0, got nan"),
        (["--lr=-1"], "config key 'lr' must be a finite number > 0, got -1.0"),
        (["--target_accuracy=2"], "config key 'target_accuracy' must be a fraction in [0, 1]"),
        (["--out_dir=/proc/no/such"], "out_dir '/proc/no/such' is not a writable folder"),
    ],
)
def test_ddp_mnist_bad_input_is_a_one_line_error_before_any_process_group(args, message):
    proc = run_script("day15_collectives.ddp_mnist", *args, timeout_s=60)
    assert proc.code == 2 and not proc.group
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
