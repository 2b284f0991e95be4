"""dtl.megatron: megatron-core's groups equal the grid's, a wrong order is caught, megatron's TP
layers match a dense MLP on CPU under the shim, and the shim undoes itself and refuses correctly."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtl.testing import needs_extras

NEEDS_MEGATRON = needs_extras("megatron")
if NEEDS_MEGATRON.args[0]:  # missing: the file imports it, so skip here (make test: fail)
    pytest.skip(allow_module_level=True, reason=NEEDS_MEGATRON.kwargs["reason"])

from megatron.core import package_info, tensor_parallel  # noqa: E402
from megatron.core.tensor_parallel import random as megatron_random  # noqa: E402

import dtl.megatron as dm  # noqa: E402
from dtl.grid import ParallelGrid  # noqa: E402
from dtl.testing import run_distributed  # noqa: E402

# ---------------------------------------------------------------------------------------------
# One 4-rank spawn (starting 4 processes that import torch and megatron-core is most of the run)
# that builds three layouts in turn; the tests below each check one part of its results.
# ---------------------------------------------------------------------------------------------

HIDDEN, FFN, SEQ, BATCH = 8, 16, 3, 2


def _dense_inputs():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)  # megatron's layout: [sequence, batch, hidden]
    b1 = torch.randn(FFN, generator=g)
    b2 = torch.randn(HIDDEN, generator=g)
    grad_y = torch.randn(SEQ, BATCH, HIDDEN, generator=g)  # a non-uniform upstream gradient
    return x, b1, b2, grad_y


def _tp_mlp(grid):
    """megatron's ColumnParallelLinear -> gelu -> RowParallelLinear on this rank's TP group."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    tp, rank = grid.tp_size, grid.tp_rank
    shard = slice(rank * FFN // tp, (rank + 1) * FFN // tp)
    x, b1, b2, grad_y = _dense_inputs()
    out = {"tp_rank": rank}
    with dm.cpu_shim():
        torch.manual_seed(1234)  # the default stream: the same on every rank
        tensor_parallel.model_parallel_cuda_manual_seed(1234)  # + one stream per TP rank
        config = dm.model_parallel_config(grid)

        def init(w):
            return torch.nn.init.normal_(w, std=0.5)

        # use_cpu_initialization: each rank draws the full master weight and keeps its slice
        fc1 = ColumnParallelLinear(
            HIDDEN,
            FFN,
            config=config,
            init_method=init,
            bias=True,
            gather_output=False,
            keep_master_weight_for_test=True,
        )
        fc2 = RowParallelLinear(
            FFN,
            HIDDEN,
            config=config,
            init_method=init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            keep_master_weight_for_test=True,
        )
        with torch.no_grad():  # megatron zeroes biases; give them the dense model's values
            fc1.bias.copy_(b1[shard])
            fc2.bias.copy_(b2)
        x.requires_grad_()
        h, _ = fc1(x)
        y, _ = fc2(F.gelu(h))
        (y * grad_y).sum().backward()

        # the RNG tracker: fork() draws from this TP rank's stream, then the default one resumes
        before = torch.get_rng_state()
        with tensor_parallel.get_cuda_rng_tracker().fork():
            out["tp_stream"] = torch.rand(4)
        out["default_after_fork"] = torch.rand(4)
        torch.set_rng_state(before)
        out["default_without_fork"] = torch.rand(4)
    out.update(
        master1=fc1.master_weight,
        master2=fc2.master_weight,
        w1=fc1.weight.detach(),
        w2=fc2.weight.detach(),
        y=y.detach(),
        dx=x.grad,
        dw1=fc1.weight.grad,
        db1=fc1.bias.grad,
        dw2=fc2.weight.grad,
        db2=fc2.bias.grad,
    )
    return out


def _four_ranks():
    from megatron.core import parallel_state

    out = {}
    for name, sizes in (("tp2pp2", dict(tp=2, pp=2)), ("tp2dp2", dict(tp=2, dp=2))):
        grid = ParallelGrid(**sizes, build_groups=False)  # rank lists only: no groups of its own
        dm.init_parallel_state(grid)
        out[name] = dm.megatron_group_ranks()
        out[name + "_grid"] = dm.grid_group_ranks(grid)
        if name == "tp2dp2":  # TP groups [0,1] and [2,3]: the layers must use theirs, not world
            out["mlp"] = _tp_mlp(grid)
        dm.destroy_parallel_state()
    # The classic mistake: megatron built PP-inner ("tp-pp-dp", a valid megatron order) for a grid
    # that is DP-inner. With pp = dp = 2 the two layouts give different groups.
    grid = ParallelGrid(pp=2, dp=2, build_groups=False)
    right_order, dm.ORDER = dm.ORDER, "tp-cp-ep-pp-dp"
    try:
        dm.init_parallel_state(grid)
        out["wrong_order"] = "no error"
    except dm.ParallelStateMismatch as err:
        out["wrong_order"] = str(err)
    finally:
        dm.ORDER = right_order
    out["left_initialized"] = parallel_state.model_parallel_is_initialized()
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_four_ranks, world_size=4)


def _group(results, name, key):
    for r in results:  # init_parallel_state compared them on the ranks; compare again here
        assert r[name][key] == r[name + "_grid"][key], (name, key)
    return [r[name][key] for r in results]


def test_tp2_pp2_groups_equal_the_grid(four_ranks):
    # ranks view(pp=2, dp=1, cp=1, tp=2) = [[0, 1], [2, 3]]: TP inner, PP outer
    assert _group(four_ranks, "tp2pp2", "tp") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _group(four_ranks, "tp2pp2", "pp") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _group(four_ranks, "tp2pp2", "dp") == [[0], [1], [2], [3]]
    assert _group(four_ranks, "tp2pp2", "cp") == [[0], [1], [2], [3]]
    assert _group(four_ranks, "tp2pp2", "dp-cp") == [[0], [1], [2], [3]]
    assert _group(four_ranks, "tp2pp2", "tp-pp") == [[0, 1, 2, 3]] * 4
    # first and last stage of each pipeline: every rank is one of them at pp = 2
    assert _group(four_ranks, "tp2pp2", "embedding") == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_tp2_dp2_groups_equal_the_grid(four_ranks):
    # ranks view(pp=1, dp=2, cp=1, tp=2) = [[0, 1], [2, 3]]: TP inner, DP outer
    assert _group(four_ranks, "tp2dp2", "tp") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _group(four_ranks, "tp2dp2", "dp") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _group(four_ranks, "tp2dp2", "dp-cp") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _group(four_ranks, "tp2dp2", "pp") == [[0], [1], [2], [3]]
    assert _group(four_ranks, "tp2dp2", "cp") == [[0], [1], [2], [3]]
    assert _group(four_ranks, "tp2dp2", "tp-pp") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _group(four_ranks, "tp2dp2", "embedding") == [[0], [1], [2], [3]]


def test_megatron_built_in_another_order_is_caught(four_ranks):
    # proves the check can fail: the first differing group is named, with both lists, per rank
    expected = [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    for rank, (theirs, ours) in enumerate(expected):
        assert four_ranks[rank]["wrong_order"] == (
            f"rank {rank}: megatron-core's pp group is {theirs} but the grid's is {ours} "
            "(the grid's order is tp-cp-dp-pp, TP innermost)"
        )
        assert not four_ranks[rank]["left_initialized"]  # a failed init leaves nothing behind


def test_megatron_column_then_row_parallel_match_dense_mlp(four_ranks):
    results = [r["mlp"] for r in four_ranks]  # TP2 x DP2: two TP pairs, [0,1] and [2,3]
    # Every rank drew the same master weights from the same seed and kept its own slice.
    master1, master2 = results[0]["master1"], results[0]["master2"]
    for r in results:
        assert torch.equal(r["master1"], master1) and torch.equal(r["master2"], master2)

    # The dense reference, computed here in one process from the same numbers.
    x, b1, b2, grad_y = _dense_inputs()
    w1, w2 = master1.clone().requires_grad_(), master2.clone().requires_grad_()
    for t in (x, b1, b2):
        t.requires_grad_()
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    (y * grad_y).sum().backward()

    # fp32, not bit-exact: the row-parallel output and the column-parallel input gradient are
    # sums of two partial matmuls added by all_reduce, a different summation order than the dense
    # matmul. Rounding differences are ~1e-7 relative; a wrong shard is off by O(1).
    tol = dict(rtol=1e-5, atol=1e-6)
    for r in results:
        shard = slice(r["tp_rank"] * FFN // 2, (r["tp_rank"] + 1) * FFN // 2)
        assert torch.equal(r["w1"], master1[shard])  # ColumnParallel: rows of W1
        assert torch.equal(r["w2"], master2[:, shard])  # RowParallel: columns of W2
        torch.testing.assert_close(r["y"], y.detach(), **tol)
        torch.testing.assert_close(r["dx"], x.grad, **tol)
        torch.testing.assert_close(r["dw1"], w1.grad[shard], **tol)
        torch.testing.assert_close(r["db1"], b1.grad[shard], **tol)
        torch.testing.assert_close(r["dw2"], w2.grad[:, shard], **tol)
        torch.testing.assert_close(r["db2"], b2.grad, **tol)


def test_cpu_rng_tracker_gives_each_tp_rank_its_own_stream(four_ranks):
    r0, r1, r2, _ = (r["mlp"] for r in four_ranks)
    # inside fork(): different across a TP pair, the same across DP replicas (megatron's rule)
    assert (r0["tp_rank"], r1["tp_rank"], r2["tp_rank"]) == (0, 1, 0)
    assert not torch.equal(r0["tp_stream"], r1["tp_stream"])
    assert torch.equal(r0["tp_stream"], r2["tp_stream"])
    # and fork() leaves the default stream exactly where it was, the same on every rank
    for r in (r0, r1, r2):
        assert torch.equal(r["default_after_fork"], r["default_without_fork"])
        assert torch.equal(r["default_after_fork"], r0["default_after_fork"])


# ---------------------------------------------------------------------------------------------
# The shim in this process: patches while active, restores on exit, refuses what it must
# ---------------------------------------------------------------------------------------------

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is off with CUDA")


def _patched_names():
    return (
        torch.cuda.current_device,
        megatron_random.CudaRNGStatesTracker,
        megatron_random._get_cuda_rng_state,
        megatron_random._set_cuda_rng_state,
    )


@needs_no_cuda
def test_cpu_shim_maps_cuda_to_cpu_and_restores_everything_even_on_error():
    originals = _patched_names()
    with pytest.raises(ZeroDivisionError), dm.cpu_shim():
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(1, device=torch.device("cuda", 0)).device.type == "cpu"
        t = torch.ones(3)
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert all(a is not b for a, b in zip(_patched_names(), originals))
        1 / 0  # noqa: B018 - leave the block by an exception
    assert all(a is b for a, b in zip(_patched_names(), originals))
    assert torch.cuda.current_device is originals[0]
    with pytest.raises((AssertionError, RuntimeError)):  # the mode is gone: CUDA is refused again
        torch.zeros(1, device="cuda")


@needs_no_cuda
def test_cpu_shim_refuses_another_megatron_version(monkeypatch):
    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    monkeypatch.delenv(dm.ANY_VERSION_ENV, raising=False)
    original = torch.cuda.current_device
    with pytest.raises(RuntimeError, match=r"patches megatron-core 0\.16\.x, found 0\.17\.0"):
        with dm.cpu_shim():
            pass
    assert torch.cuda.current_device is original
    monkeypatch.setenv(dm.ANY_VERSION_ENV, "1")
    with dm.cpu_shim():
        assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.current_device is original


def test_cpu_shim_is_a_no_op_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(package_info, "__version__", "0.17.0")  # not even the version gate runs
    originals = _patched_names()
    with dm.cpu_shim():
        assert all(a is b for a, b in zip(_patched_names(), originals))
        assert torch.overrides._get_current_function_mode_stack() == []


@needs_no_cuda
def test_activation_recompute_replays_the_same_dropout_masks(monkeypatch):
    # tensor_parallel.checkpoint saves the RNG states (CPU, "CUDA", the tracker's) in forward and
    # restores them before recomputing in backward. Without the shim's CPU stand-ins for the
    # "CUDA" state functions this raises on a CPU; with them the masks replay exactly.
    monkeypatch.setattr(megatron_random, "_CUDA_RNG_STATE_TRACKER", None)  # restored afterwards
    monkeypatch.setattr(megatron_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)

    def block(x):
        with tensor_parallel.get_cuda_rng_tracker().fork():  # dropout in a TP region
            x = F.dropout(x, p=0.5)
        return F.dropout(x, p=0.5).sin()  # and outside one

    def grad(recompute):
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(
            0, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True
        )
        x = torch.linspace(-1, 1, 64, requires_grad=True)
        y = tensor_parallel.checkpoint(block, False, x) if recompute else block(x)
        y.sum().backward()
        return x.grad

    with dm.cpu_shim():
        plain, recomputed = grad(False), grad(True)
    assert (plain == 0).any() and (plain != 0).any()  # dropout did drop, and kept
    assert torch.equal(recomputed, plain)


def test_model_parallel_config_takes_sizes_from_the_grid_and_cpu_settings():
    grid = ParallelGrid(tp=2, pp=2, world_size=4, rank=0)
    config = dm.model_parallel_config(grid, virtual_pipeline_model_parallel_size=2)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 2)
    assert config.use_cpu_initialization and not config.batch_p2p_comm
    assert config.pipeline_dtype == torch.float32 and not config.sequence_parallel
    assert config.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_model_parallel_size comes from the grid"):
        dm.model_parallel_config(grid, tensor_model_parallel_size=4)


@needs_no_cuda
def test_optimizer_shim_names_cpu_tensors_as_cuda_only_inside_and_leaves_casts_alone():
    t = torch.ones(2)
    assert t.type() == "torch.FloatTensor"
    with dm.optimizer_shim():
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float64).dtype == torch.float64  # a cast is still a cast
        with dm.cpu_shim():  # nested under the TorchFunctionMode: answered once, not twice
            assert t.type() == "torch.cuda.FloatTensor"
    assert t.type() == "torch.FloatTensor"


def _run_as(monkeypatch, backend):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)


def test_shims_are_active_for_a_gloo_run_on_a_gpu_machine(monkeypatch):
    # the shims follow the run's device, not "is CUDA present"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _run_as(monkeypatch, "gloo")
    assert dm.run_on_cpu()
    assert dm.shim_state() == "active: the run's device is the CPU (gloo)"
    originals = _patched_names()
    with dm.cpu_shim():
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert all(a is b for a, b in zip(_patched_names(), originals))
    with dm.optimizer_shim():
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_shims_do_nothing_for_an_nccl_run(monkeypatch):
    _run_as(monkeypatch, "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(package_info, "__version__", "0.17.0")  # not even the version gate runs
    assert not dm.run_on_cpu()
    assert dm.shim_state() == "inactive: the run's device is cuda:0 (nccl)"
    originals = _patched_names()
    with dm.cpu_shim(), dm.optimizer_shim():
        assert all(a is b for a, b in zip(_patched_names(), originals))
        assert torch.overrides._get_current_function_mode_stack() == []
        assert torch.ones(1).type() == "torch.FloatTensor"
